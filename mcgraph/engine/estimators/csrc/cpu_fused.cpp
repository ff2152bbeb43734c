// The fused tier's registered log-densities on the CPU: E_q[log p(w)] and its derivatives in one pass
// over the noise rows (built at first use by mcgraph.engine.estimators.cpu_fused).
//
// For all M rows xi[i, j] (i < M, j < P) and w_ij = T(u_ij), u_ij = loc_j + scale_j xi_ij (or scale_j xi_ij
// for a scaling form; T the identity or exp), the loop writes the P-sized means
//
//   out[0][j] = (1/M) sum_i h(w_ij; c_j)                   the value
//   out[1][j] = (1/M) sum_i h'(w_ij) dw/du                 d/d loc   (the chain rule through T)
//   out[2][j] = (1/M) sum_i h'(w_ij) dw/du xi_ij           d/d scale
//   out[3 + k][j] = (1/M) sum_i dh/dc_k (w_ij; c_j)        d/d the k-th parameter of the prior
//
// where log p(w; c) = h(w; c) + A(c): the w-free part A is added once per element (by the caller, as a torch
// expression, when it needs A's gradient), as in the Triton kernels (mcgraph.kernels.integrands), whose
// device functions these mirror term for term. Each element is computed in the rows' precision (float or
// double), summed in double, and its mean rounded once to the rows' precision. Threads split the elements
// into tiles and each element's sum runs over the rows in order, so the result does not depend on the
// number of threads.
//
// Plain C++ and OpenMP, no torch headers; loaded with ctypes.

#include <cmath>
#include <cstdint>

namespace {

enum Integrand { NORMAL, LAPLACE, LOGISTIC, CAUCHY, STUDENT_T, SCALE_MIXTURE, LOG_UNIFORM, GAMMA, LOG_NORMAL,
                 INVERSE_GAMMA, N_INTEGRANDS };
enum Form { LOCATION_SCALE, SCALING, EXP };

constexpr int MAX_PARAMS = 4;
constexpr int N_OUT = 3 + MAX_PARAMS;
constexpr int64_t TILE = 256;

template <typename T>
inline T sign(T x) { return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0)); }

inline float log_gamma(float x) { int sign; return lgammaf_r(x, &sign); }  // reentrant: no global sign write
inline double log_gamma(double x) { int sign; return lgamma_r(x, &sign); }

// What h needs of the parameters c alone (k[0], k[1]), computed once per element instead of once per sample,
// and the w-free part A(c) of log p (k[2]), added to the value when the caller asks (A's gradient in c is
// the caller's: it adds A as a torch expression instead when a parameter of the prior requires grad).
template <typename T, int INTEGRAND>
inline void prepare(const T* c, T* k) {
  const T half_log_2pi = T(0.91893853320467274178), log_pi = T(1.14472988584940017414);
  switch (INTEGRAND) {
    case NORMAL: case LOG_NORMAL: k[2] = -std::log(c[1]) - half_log_2pi; break;
    case LAPLACE: k[2] = -std::log(T(2) * c[1]); break;
    case LOGISTIC: k[2] = -std::log(c[1]); break;
    case CAUCHY: k[2] = -std::log(c[1]) - log_pi; break;
    case STUDENT_T:
      k[2] = log_gamma(T(0.5) * (c[0] + T(1))) - log_gamma(T(0.5) * c[0]) - T(0.5) * std::log(c[0] * T(M_PI)) -
             std::log(c[2]);
      break;
    case SCALE_MIXTURE:  // log(pi / scale1), log((1 - pi) / scale2)
      k[0] = std::log(c[0]) - std::log(c[1]);
      k[1] = std::log1p(-c[0]) - std::log(c[2]);
      k[2] = -half_log_2pi;
      break;
    case GAMMA: case INVERSE_GAMMA: k[2] = c[0] * std::log(c[1]) - log_gamma(c[0]); break;
    default: k[2] = T(0);  // LOG_UNIFORM: improper, its constant dropped
  }
}

// h and its derivatives at w: dh[0] = dh/dw, and dh[1 + k] = dh/dc_k when `params` (k: what prepare computed
// of c).
template <typename T, int INTEGRAND>
inline T evaluate(T w, const T* c, const T* k, bool params, T* dh) {
  switch (INTEGRAND) {
    case NORMAL: {  // h = -z^2/2, z = (w - loc)/scale
      const T z = (w - c[0]) / c[1], dw = -z / c[1];
      dh[0] = dw;
      if (params) { dh[1] = -dw; dh[2] = z * z / c[1]; }
      return T(-0.5) * z * z;
    }
    case LAPLACE: {  // h = -|w - loc|/scale
      const T d = w - c[0], a = std::abs(d), dw = -sign(d) / c[1];
      dh[0] = dw;
      if (params) { dh[1] = -dw; dh[2] = a / (c[1] * c[1]); }
      return -a / c[1];
    }
    case LOGISTIC: {  // h = -|z| - 2 log(1 + e^{-|z|}); dh/dz = -tanh(z/2)
      const T z = (w - c[0]) / c[1], e = std::exp(-std::abs(z));
      const T dz = -sign(z) * (T(1) - e) / (T(1) + e);
      dh[0] = dz / c[1];
      if (params) { dh[1] = -dz / c[1]; dh[2] = -dz * z / c[1]; }
      return -std::abs(z) - T(2) * std::log1p(e);
    }
    case CAUCHY: {  // h = -log(1 + z^2)
      const T z = (w - c[0]) / c[1], dz = T(-2) * z / (T(1) + z * z);
      dh[0] = dz / c[1];
      if (params) { dh[1] = -dz / c[1]; dh[2] = -dz * z / c[1]; }
      return -std::log1p(z * z);
    }
    case STUDENT_T: {  // h = -(nu + 1)/2 log(1 + z^2/nu); parameters (nu, loc, scale)
      const T nu = c[0], z = (w - c[1]) / c[2], z2 = z * z, l1 = std::log1p(z2 / nu);
      const T dz = -(nu + T(1)) * z / (nu + z2);
      dh[0] = dz / c[2];
      if (params) {
        dh[1] = T(-0.5) * l1 + T(0.5) * (nu + T(1)) * z2 / (nu * (nu + z2));
        dh[2] = -dz / c[2]; dh[3] = -dz * z / c[2];
      }
      return T(-0.5) * (nu + T(1)) * l1;
    }
    case SCALE_MIXTURE: {  // h = logaddexp(a, b); parameters (pi, scale1, scale2, loc), k = the log weights
      const T pi = c[0], s1 = c[1], s2 = c[2], z1 = (w - c[3]) / s1, z2 = (w - c[3]) / s2;
      const T a = k[0] - T(0.5) * z1 * z1, b = k[1] - T(0.5) * z2 * z2;
      const T e = a == b ? T(1) : std::exp(-std::abs(a - b));  // (a = b = -inf: logaddexp's -inf, not NaN)
      const T r = a >= b ? T(1) / (T(1) + e) : e / (T(1) + e);  // the first component's responsibility
      const T dw = -(r * z1 / s1 + (T(1) - r) * z2 / s2);
      dh[0] = dw;
      if (params) {
        dh[1] = r / pi - (T(1) - r) / (T(1) - pi);
        dh[2] = r * (z1 * z1 - T(1)) / s1;
        dh[3] = (T(1) - r) * (z2 * z2 - T(1)) / s2;
        dh[4] = -dw;
      }
      return (a > b ? a : b) + std::log1p(e);
    }
    case LOG_UNIFORM:  // h = -log|w|
      dh[0] = T(-1) / w;
      return -std::log(std::abs(w));
    case GAMMA: {  // h = (k - 1) log w - rate w, with 0 log 0 = 0 (torch's xlogy)
      const T lw = std::log(w), km1 = c[0] - T(1);
      dh[0] = km1 / w - c[1];
      if (params) { dh[1] = lw; dh[2] = -w; }
      return (km1 == T(0) ? T(0) : km1 * lw) - c[1] * w;
    }
    case LOG_NORMAL: {  // h = -log w - z^2/2, z = (log w - loc)/scale
      const T lw = std::log(w), z = (lw - c[0]) / c[1];
      dh[0] = (T(-1) - z / c[1]) / w;
      if (params) { dh[1] = z / c[1]; dh[2] = z * z / c[1]; }
      return -lw - T(0.5) * z * z;
    }
    default: {  // INVERSE_GAMMA: h = -(k + 1) log w - rate / w
      const T lw = std::log(w), iw = T(1) / w;
      dh[0] = (c[1] * iw - (c[0] + T(1))) * iw;
      if (params) { dh[1] = -lw; dh[2] = -iw; }
      return -(c[0] + T(1)) * lw - c[1] * iw;
    }
  }
}

// The number of parameters c of each density (what the caller passes as n_params).
constexpr int params_of(int integrand) {
  return integrand == LOG_UNIFORM ? 0 : integrand == STUDENT_T ? 3 : integrand == SCALE_MIXTURE ? 4 : 2;
}

// Per tile of elements: what every row needs, laid out one array per quantity so that the loop over the
// tile's elements runs in SIMD lanes (the sums over rows stay in row order, element by element).
template <typename T>
struct Tile {
  double acc[N_OUT][TILE];
  T c[MAX_PARAMS][TILE], k[3][TILE], loc[TILE], scale[TILE];
};

// One row of xi over a tile's n elements: the sums of h, dh/du, dh/du xi and (params) dh/dc. Everything
// is accumulated whatever the caller wants (a few adds, and no branch in the loop).
template <typename T, int INTEGRAND>
__attribute__((always_inline)) inline void accumulate_row(Tile<T>& tl, const T* row, int64_t n, bool has_loc,
                                                          bool exp, bool params) {
  constexpr int NP = params_of(INTEGRAND);
  for (int64_t t = 0; t < n; ++t) {
    const T x = row[t];
    const T u = has_loc ? tl.loc[t] + tl.scale[t] * x : tl.scale[t] * x;
    const T w = exp ? std::exp(u) : u;
    T c[MAX_PARAMS], k[2];
    for (int q = 0; q < MAX_PARAMS; ++q) c[q] = tl.c[q][t];
    k[0] = tl.k[0][t]; k[1] = tl.k[1][t];
    T dh[1 + MAX_PARAMS] = {T(0), T(0), T(0), T(0), T(0)};
    tl.acc[0][t] += double(evaluate<T, INTEGRAND>(w, c, k, params, dh));
    const T du = exp ? dh[0] * w : dh[0];
    tl.acc[1][t] += double(du);
    tl.acc[2][t] += double(du * x);
    if (params)
      for (int q = 0; q < NP; ++q) tl.acc[3 + q][t] += double(dh[1 + q]);
  }
}

template <typename T, int INTEGRAND>
__attribute__((always_inline)) inline void accumulate_rows(Tile<T>& tl, const T* xi, int64_t rows, int64_t P,
                                                           int64_t n, bool has_loc, bool exp, bool params) {
  for (int64_t i = 0; i < rows; ++i) accumulate_row<T, INTEGRAND>(tl, xi + i * P, n, has_loc, exp, params);
}

// All rows into the tile's sums. Where h calls no libm function per draw (Normal, Laplace), each case of the
// form's flags is its own loop with the flags as constants, which the compiler runs in SIMD lanes across the
// tile's elements; elsewhere the per-draw exp / log calls run one lane at a time anyway, and one loop with
// the flags as branches keeps the build short.
template <typename T, int INTEGRAND>
void accumulate(Tile<T>& tl, const T* xi, int64_t rows, int64_t P, int64_t n, int form, bool params) {
  const bool has_loc = form != SCALING, exp = form == EXP;
  if constexpr (INTEGRAND == NORMAL || INTEGRAND == LAPLACE) {
    if (!exp && has_loc && params) return accumulate_rows<T, INTEGRAND>(tl, xi, rows, P, n, true, false, true);
    if (!exp && has_loc) return accumulate_rows<T, INTEGRAND>(tl, xi, rows, P, n, true, false, false);
    if (!exp && params) return accumulate_rows<T, INTEGRAND>(tl, xi, rows, P, n, false, false, true);
    if (!exp) return accumulate_rows<T, INTEGRAND>(tl, xi, rows, P, n, false, false, false);
  }
  accumulate_rows<T, INTEGRAND>(tl, xi, rows, P, n, has_loc, exp, params);
}

template <typename T, int INTEGRAND>
int run(int form, int64_t rows, int64_t P, const T* xi, const T* loc, int64_t loc_step, const T* scale, int64_t scale_step,
        const T* const* params, const int64_t* param_steps, int n_params, int want, bool normalized, double m,
        T* const* out, int threads) {
  const int64_t tiles = (P + TILE - 1) / TILE;
  const bool parallel = threads > 1 && tiles > 1 && rows * P >= (int64_t(1) << 15);
  const bool param_grads = (want >> 2) != 0;
  int invalid = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel) reduction(| : invalid)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t j0 = tile * TILE, n = (P - j0) < TILE ? (P - j0) : TILE;
    Tile<T> tl;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t j = j0 + t;
      T c[MAX_PARAMS], k[3];
      for (int q = 0; q < MAX_PARAMS; ++q) {
        c[q] = q < n_params ? params[q][j * param_steps[q]] : T(0);
        if (!std::isfinite(c[q])) invalid = 1;
        tl.c[q][t] = c[q];
      }
      tl.scale[t] = scale[j * scale_step];
      tl.loc[t] = form != SCALING ? loc[j * loc_step] : T(0);
      if (!std::isfinite(tl.scale[t]) || !std::isfinite(tl.loc[t])) invalid = 1;
      prepare<T, INTEGRAND>(c, k);
      for (int q = 0; q < 3; ++q) tl.k[q][t] = k[q];
      for (int q = 0; q < N_OUT; ++q) tl.acc[q][t] = 0.0;
    }
    accumulate<T, INTEGRAND>(tl, xi + j0, rows, P, n, form, param_grads);
    for (int q = 0; q < N_OUT; ++q)
      if (q == 0 || (want & (1 << (q - 1))))
        for (int64_t t = 0; t < n; ++t) {
          T mean = T(tl.acc[q][t] / m);
          if (q == 0 && normalized) mean = mean + tl.k[2][t];
          out[q][j0 + t] = mean;
        }
  }
  return invalid;
}

template <typename T, int INTEGRAND>
int run_form(int form, int64_t rows, int64_t P, const void* xi, const void* loc, int64_t loc_step, const void* scale,
             int64_t scale_step, const void* const* params, const int64_t* param_steps, int n_params, int want,
             bool normalized, double m, void* const* out, int threads) {
  return run<T, INTEGRAND>(form, rows, P, static_cast<const T*>(xi), static_cast<const T*>(loc), loc_step,
                    static_cast<const T*>(scale), scale_step, reinterpret_cast<const T* const*>(params),
                    param_steps, n_params, want, normalized, m, reinterpret_cast<T* const*>(out), threads);
}

template <typename T>
int run_integrand(int integrand, int form, int64_t rows, int64_t P, const void* xi, const void* loc,
                  int64_t loc_step, const void* scale, int64_t scale_step, const void* const* params,
                  const int64_t* param_steps, int n_params, int want, bool normalized, double m, void* const* out,
                  int threads) {
#define MCGRAPH_CASE(I)                                                                                       \
  case I:                                                                                                     \
    return run_form<T, I>(form, rows, P, xi, loc, loc_step, scale, scale_step, params, param_steps, n_params, \
                          want, normalized, m, out, threads);
  switch (integrand) {
    MCGRAPH_CASE(NORMAL) MCGRAPH_CASE(LAPLACE) MCGRAPH_CASE(LOGISTIC) MCGRAPH_CASE(CAUCHY)
    MCGRAPH_CASE(STUDENT_T) MCGRAPH_CASE(SCALE_MIXTURE) MCGRAPH_CASE(LOG_UNIFORM) MCGRAPH_CASE(GAMMA)
    MCGRAPH_CASE(LOG_NORMAL) MCGRAPH_CASE(INVERSE_GAMMA)
  }
#undef MCGRAPH_CASE
  return 0;
}

}  // namespace

extern "C" {

int mcgraph_cpu_fused_abi() { return 5; }

// The means over all M rows, written to out[0..6] (arrays of the rows' dtype, P elements each; out[k] may be
// null when not wanted). want: bit 0 loc, bit 1 scale, bit 2 + k the prior's k-th parameter; normalized: the
// value includes A(c) (the caller adds none). Returns 0; -1 when a parameter it read (loc, scale, the prior's)
// is not finite (the means are written all the same: the caller names the argument); or a positive code for
// arguments out of range. An empty draw (P = 0) writes nothing.
int mcgraph_cpu_fused_log_prob(int is_double, int integrand, int form, int64_t rows, int64_t P, const void* xi,
                               const void* loc, int64_t loc_step, const void* scale, int64_t scale_step,
                               const void* const* params, const int64_t* param_steps, int n_params, int want,
                               int normalized, void* const* out, int threads) {
  if (integrand < 0 || integrand >= N_INTEGRANDS || form < LOCATION_SCALE || form > EXP) return 1;
  if (n_params != params_of(integrand) || rows < 1 || P < 0 || threads < 1) return 2;
  if (P == 0) return 0;
  if (form != SCALING && loc == nullptr) return 3;
  const double m = double(rows);
  const int invalid = is_double
      ? run_integrand<double>(integrand, form, rows, P, xi, loc, loc_step, scale, scale_step, params, param_steps,
                              n_params, want, normalized != 0, m, out, threads)
      : run_integrand<float>(integrand, form, rows, P, xi, loc, loc_step, scale, scale_step, params, param_steps,
                             n_params, want, normalized != 0, m, out, threads);
  return invalid ? -1 : 0;
}

}  // extern "C"
