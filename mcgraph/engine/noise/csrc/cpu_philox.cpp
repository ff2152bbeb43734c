// The compiled CPU Philox noise stream of mcgraph (built at first use by mcgraph.cpu_philox).
//
// Stream layout: the Triton backend's (kernels/noise_laws.py), so that both backends draw the same xi.
// For sample i and element j of a draw of P elements:
//
//     offset  = i*P + j
//     counter = (lo32(offset), hi32(offset), tag, 0)    key = (lo32(seed), hi32(seed))
//     words   = Philox4x32-10(counter, key)
//
// tag = 0 is the element noise; tag = 1 the Radial radius of (sample i, batch element b), drawn as a
// normal at offset i*B + b (B = batch elements per draw).
//
// float32: u1 = ((w0 >> 9) + 1/2) 2^-23, u2 = ((w1 >> 9) + 1/2) 2^-23 (open uniforms, never 0 or 1);
// float64: u1 = ((w0 << 20 | w1 >> 12) + 1/2) 2^-52, u2 likewise from (w2, w3).
// A noise law maps (u1, u2) to xi (Box-Muller for the normal, inverse CDFs otherwise).
//
// Two entry points, both one OpenMP parallel loop (torch.get_num_threads() threads, passed in):
//   mcgraph_philox_rows   -> the (stop-start) x P noise rows
//   mcgraph_philox_stats  -> per segment of samples, the K x P sums of xi^a (log xi)^j
// and mcgraph_philox_radius (the (stop-start) x B Radial radii, tag 1).
// The statistics never materialise the M x P noise: each work item owns LANES elements and a
// segment of samples, keeps its sums in L1 and writes K x LANES numbers. The work items and the
// caller's sum over segments depend on (P, M, segments) only: the same result for any thread count.
// Items are handed out dynamically, so a core taken by another process does not hold the loop back.
// Plain C++ and OpenMP, no torch headers: one compiler call of about a second, loaded with ctypes.
//
// Built with -ffp-contract=off: rows and stats must produce bit-identical xi, which a contraction
// into FMA in one inlined context but not in the other would break.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int LANES = 32;  // elements drawn together (two AVX-512 vectors of float32)

enum Law : int {
  NORMAL = 0, LAPLACE = 1, LOGISTIC = 2, CAUCHY = 3, GUMBEL = 4, UNIFORM = 5, EXPONENTIAL = 6,
  HALF_NORMAL = 7, HALF_CAUCHY = 8, RAYLEIGH = 9, NUM_LAWS = 10
};

// Philox4x32-10 on LANES consecutive offsets; the four output words per lane. One round:
//     (c0, c1, c2, c3) <- (hi(B c2) ^ c1 ^ k0, lo(B c2), hi(A c0) ^ c3 ^ k1, lo(A c0)),  k += (KA, KB)
// (the round of tl.philox). The portable loop is the definition; the AVX-512 / AVX2 versions compute
// the same words with 32x32->64 multiplies of even and odd lanes (vpmuludq), which compilers do not
// find on their own.
constexpr uint32_t ROUND_A = 0xD2511F53u, ROUND_B = 0xCD9E8D57u, KEY_A = 0x9E3779B9u, KEY_B = 0xBB67AE85u;

inline void philox_portable(uint64_t seed, uint64_t offset0, uint32_t* w0, uint32_t* w1, uint32_t* w2,
                            uint32_t* w3, uint32_t tag = 0u) {
  uint32_t c0[LANES], c1[LANES], c2[LANES], c3[LANES];
  for (int l = 0; l < LANES; ++l) {
    const uint64_t off = offset0 + static_cast<uint64_t>(l);
    c0[l] = static_cast<uint32_t>(off);
    c1[l] = static_cast<uint32_t>(off >> 32);
    c2[l] = tag;
    c3[l] = 0u;
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    for (int l = 0; l < LANES; ++l) {
      const uint64_t p0 = static_cast<uint64_t>(ROUND_A) * c0[l];
      const uint64_t p2 = static_cast<uint64_t>(ROUND_B) * c2[l];
      const uint32_t n0 = static_cast<uint32_t>(p2 >> 32) ^ c1[l] ^ k0;
      const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[l] ^ k1;
      c1[l] = static_cast<uint32_t>(p2);
      c3[l] = static_cast<uint32_t>(p0);
      c0[l] = n0;
      c2[l] = n2;
    }
    k0 += KEY_A;
    k1 += KEY_B;
  }
  for (int l = 0; l < LANES; ++l) {
    w0[l] = c0[l];
    w1[l] = c1[l];
    w2[l] = c2[l];
    w3[l] = c3[l];
  }
}

#if defined(__AVX512F__)
#define MCGRAPH_PHILOX_ISA "avx512"
constexpr int VW = 16;  // 32-bit lanes per vector
using vec = __m512i;
inline vec v_load_offsets(uint64_t offset0, int v, vec* hi) {
  // lanes v*VW ... v*VW+VW-1: low and high words of offset0 + lane (the carry of the low word goes high)
  const vec lane = _mm512_add_epi32(_mm512_set1_epi32(v * VW),
                                    _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const vec base = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset0)));
  const vec lo = _mm512_add_epi32(base, lane);
  const __mmask16 carry = _mm512_cmplt_epu32_mask(lo, base);
  *hi = _mm512_mask_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset0 >> 32))),
                              carry, _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset0 >> 32))),
                              _mm512_set1_epi32(1));
  return lo;
}
inline void v_mulhilo(vec a, vec m, vec* hi, vec* lo) {
  const vec pe = _mm512_mul_epu32(a, m);
  const vec po = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(pe, 32), po);
  *lo = _mm512_mullo_epi32(a, m);
}
inline vec v_xor3(vec a, vec b, vec c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
inline vec v_set1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline vec v_zero() { return _mm512_setzero_si512(); }
inline void v_store(uint32_t* p, vec x) { _mm512_storeu_si512(reinterpret_cast<void*>(p), x); }
#elif defined(__AVX2__)
#define MCGRAPH_PHILOX_ISA "avx2"
constexpr int VW = 8;
using vec = __m256i;
inline vec v_load_offsets(uint64_t offset0, int v, vec* hi) {
  const vec lane = _mm256_add_epi32(_mm256_set1_epi32(v * VW), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const vec base = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset0)));
  const vec lo = _mm256_add_epi32(base, lane);
  // unsigned lo < base  <=>  carry; compare via the sign-flipped signed comparison
  const vec flip = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const vec carry = _mm256_cmpgt_epi32(_mm256_xor_si256(base, flip), _mm256_xor_si256(lo, flip));
  *hi = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset0 >> 32))), carry);
  return lo;
}
inline void v_mulhilo(vec a, vec m, vec* hi, vec* lo) {
  const vec pe = _mm256_mul_epu32(a, m);
  const vec po = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(pe, 32), po, 0xAA);
  *lo = _mm256_mullo_epi32(a, m);
}
inline vec v_xor3(vec a, vec b, vec c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
inline vec v_set1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline vec v_zero() { return _mm256_setzero_si256(); }
inline void v_store(uint32_t* p, vec x) { _mm256_storeu_si256(reinterpret_cast<vec*>(p), x); }
#else
#define MCGRAPH_PHILOX_ISA "portable"
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
inline void philox(uint64_t seed, uint64_t offset0, uint32_t* w0, uint32_t* w1, uint32_t* w2, uint32_t* w3,
                   uint32_t tag = 0u) {
  constexpr int NV = LANES / VW;
  vec c0[NV], c1[NV], c2[NV], c3[NV];
  for (int v = 0; v < NV; ++v) {
    c0[v] = v_load_offsets(offset0, v, &c1[v]);
    c2[v] = v_set1(tag);
    c3[v] = v_zero();
  }
  const vec ma = v_set1(ROUND_A), mb = v_set1(ROUND_B);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    const vec vk0 = v_set1(k0), vk1 = v_set1(k1);
    for (int v = 0; v < NV; ++v) {
      vec hi0, lo0, hi2, lo2;
      v_mulhilo(c0[v], ma, &hi0, &lo0);
      v_mulhilo(c2[v], mb, &hi2, &lo2);
      c0[v] = v_xor3(hi2, c1[v], vk0);
      c2[v] = v_xor3(hi0, c3[v], vk1);
      c1[v] = lo2;
      c3[v] = lo0;
    }
    k0 += KEY_A;
    k1 += KEY_B;
  }
  for (int v = 0; v < NV; ++v) {
    v_store(w0 + v * VW, c0[v]);
    v_store(w1 + v * VW, c1[v]);
    v_store(w2 + v * VW, c2[v]);
    v_store(w3 + v * VW, c3[v]);
  }
}
#else
inline void philox(uint64_t seed, uint64_t offset0, uint32_t* w0, uint32_t* w1, uint32_t* w2, uint32_t* w3,
                   uint32_t tag = 0u) {
  philox_portable(seed, offset0, w0, w1, w2, w3, tag);
}
#endif

// ---------------------------------------------------------------- float32 math that vectorises
// (glibc's logf/cosf are scalar calls unless -ffast-math; these are branch-free and ~1 ulp. The
// polynomials use explicit std::fma: one instruction where the CPU has FMA, and the same rounding in
// every inlined context, which -ffp-contract=off guarantees for the rest.)

inline float as_float(uint32_t i) { float f; std::memcpy(&f, &i, 4); return f; }
inline uint32_t as_bits(float f) { uint32_t i; std::memcpy(&i, &f, 4); return i; }

// log x for normal positive x: x = (1 + m) 2^e with 1 + m in [sqrt(1/2), sqrt(2)) by integer arithmetic on
// the bits (musl's reduction: no branch, so it vectorises on AVX2 too), then Cephes logf's degree-9
// polynomial and ln 2 split in two.
inline float log_f(float x) {
  const uint32_t ix = as_bits(x) + (0x3f800000u - 0x3f3504f3u);
  const int e = static_cast<int>(ix >> 23) - 0x7f;
  const float m = as_float((ix & 0x007fffffu) + 0x3f3504f3u) - 1.0f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = std::fma(y, m, -1.1514610310e-1f);
  y = std::fma(y, m, 1.1676998740e-1f);
  y = std::fma(y, m, -1.2420140846e-1f);
  y = std::fma(y, m, 1.4249322787e-1f);
  y = std::fma(y, m, -1.6668057665e-1f);
  y = std::fma(y, m, 2.0000714765e-1f);
  y = std::fma(y, m, -2.4999993993e-1f);
  y = std::fma(y, m, 3.3333331174e-1f);
  y = y * m * z;
  const float fe = static_cast<float>(e);
  y += -2.12194440e-4f * fe;
  y += -0.5f * z;
  return (m + y) + 0.693359375f * fe;
}

// cos(2 pi t) for float t > -1/2: t reduced to a in [0, 1/2], then sin(2 pi (1/4 - a)) by its Taylor
// polynomial on [-pi/2, pi/2] (terms to x^15: truncation < 1e-9). The truncating conversion is floor
// for t + 1/2 > 0 and, unlike floorf, vectorises.
inline float cos2pi_f(float t) {
  const float a = std::fabs(t - static_cast<float>(static_cast<int32_t>(t + 0.5f)));
  const float x = 6.28318530717958648f * (0.25f - a);
  const float z = x * x;
  float s = -7.6471637318198164759e-13f;  // -1/15!
  s = std::fma(s, z, 1.6059043836821614599e-10f);  // 1/13!
  s = std::fma(s, z, -2.5052108385441718775e-8f);   // -1/11!
  s = std::fma(s, z, 2.7557319223985890653e-6f);   // 1/9!
  s = std::fma(s, z, -1.9841269841269841270e-4f);   // -1/7!
  s = std::fma(s, z, 8.3333333333333333333e-3f);   // 1/5!
  s = std::fma(s, z, -1.6666666666666666667e-1f);   // -1/3!
  return x + x * z * s;
}

// float64 versions, also branch-free (libm's log/cos are scalar calls): a few ulp.
inline double as_double(uint64_t i) { double d; std::memcpy(&d, &i, 8); return d; }
inline uint64_t as_bits(double d) { uint64_t i; std::memcpy(&i, &d, 8); return i; }

// log x for normal positive x: x = (1 + f) 2^e, 1 + f in [sqrt(1/2), sqrt(2)) (musl's reduction), then
// log(1 + f) = f - s (f - R), s = f / (2 + f), R = 2 (s^2/3 + s^4/5 + ... + s^20/21) (2 atanh s = log(1 + f);
// |s| < 0.172, so the first omitted term is < 1e-18 relative), and ln 2 split in two.
inline double log_d(double x) {
  const uint64_t ix = as_bits(x) + (0x3ff0000000000000ull - 0x3fe6a09e667f3bcdull);
  const double e = static_cast<double>(static_cast<int32_t>(ix >> 52) - 0x3ff);
  const double f = as_double((ix & 0x000fffffffffffffull) + 0x3fe6a09e667f3bcdull) - 1.0;
  const double s = f / (2.0 + f);
  const double z = s * s;
  double r = 2.0 / 21;
  r = std::fma(r, z, 2.0 / 19);
  r = std::fma(r, z, 2.0 / 17);
  r = std::fma(r, z, 2.0 / 15);
  r = std::fma(r, z, 2.0 / 13);
  r = std::fma(r, z, 2.0 / 11);
  r = std::fma(r, z, 2.0 / 9);
  r = std::fma(r, z, 2.0 / 7);
  r = std::fma(r, z, 2.0 / 5);
  r = std::fma(r, z, 2.0 / 3);
  r = r * z;
  const double log1p = f - s * (f - r);
  return std::fma(e, 6.93147180369123816490e-01, std::fma(e, 1.90821492927058770002e-10, log1p));
}

// cos(2 pi t) for double t > -1/2, as cos2pi_f: sin(2 pi (1/4 - a)) by its Taylor polynomial to x^25
// (truncation < 1e-22 on [-pi/2, pi/2]).
inline double cos2pi_d(double t) {
  const double a = std::fabs(t - static_cast<double>(static_cast<int32_t>(t + 0.5)));
  const double x = 6.283185307179586477 * (0.25 - a);
  const double z = x * x;
  double q = 1.0 / 15511210043330985984000000.0;  // 1/25!
  q = std::fma(q, z, -1.0 / 25852016738884976640000.0);  // -1/23!
  q = std::fma(q, z, 1.0 / 51090942171709440000.0);      // 1/21!
  q = std::fma(q, z, -1.0 / 121645100408832000.0);       // -1/19!
  q = std::fma(q, z, 1.0 / 355687428096000.0);           // 1/17!
  q = std::fma(q, z, -1.0 / 1307674368000.0);            // -1/15!
  q = std::fma(q, z, 1.0 / 6227020800.0);                // 1/13!
  q = std::fma(q, z, -1.0 / 39916800.0);                 // -1/11!
  q = std::fma(q, z, 1.0 / 362880.0);                    // 1/9!
  q = std::fma(q, z, -1.0 / 5040.0);                     // -1/7!
  q = std::fma(q, z, 1.0 / 120.0);                       // 1/5!
  q = std::fma(q, z, -1.0 / 6.0);                        // -1/3!
  return std::fma(x * z, q, x);
}

inline float log_(float x) { return log_f(x); }
inline double log_(double x) { return log_d(x); }
inline float cos2pi_(float t) { return cos2pi_f(t); }
inline double cos2pi_(double t) { return cos2pi_d(t); }
inline float sqrt_(float x) { return std::sqrt(x); }
inline double sqrt_(double x) { return std::sqrt(x); }

template <typename Real>
inline Real sin_pi_over_cos_pi(Real v) {  // tan(pi v), v in (-1/2, 1/2)
  return cos2pi_(v * Real(0.5) - Real(0.25)) / cos2pi_(v * Real(0.5));
}

template <typename Real>
inline Real transform(int law, Real u1, Real u2) {
  switch (law) {
    case NORMAL: return sqrt_(Real(-2) * log_(u1)) * cos2pi_(u2);
    case LAPLACE: {
      const Real v = u1 - Real(0.5);
      return -std::copysign(Real(1), v) * log_(Real(1) - Real(2) * std::fabs(v));  // v != 0 on the grid
    }
    case LOGISTIC: return log_(u1) - log_(Real(1) - u1);
    case CAUCHY: return sin_pi_over_cos_pi(u1 - Real(0.5));
    case GUMBEL: return -log_(-log_(u1));
    case UNIFORM: return u1;
    case EXPONENTIAL: return -log_(u1);
    case HALF_NORMAL: return std::fabs(sqrt_(Real(-2) * log_(u1)) * cos2pi_(u2));
    case HALF_CAUCHY: return std::fabs(sin_pi_over_cos_pi(u1 - Real(0.5)));
    default: return sqrt_(Real(-2) * log_(u1));  // RAYLEIGH
  }
}

// xi for LANES consecutive offsets (the law switch is hoisted so each case is one vector loop).
template <typename Real>
void draw(int law, uint64_t seed, uint64_t offset0, Real* xi, uint32_t tag = 0u);

template <int LAW, typename Real>
inline void draw_law(const Real* u1, const Real* u2, Real* xi) {
#pragma omp simd
  for (int l = 0; l < LANES; ++l) xi[l] = transform<Real>(LAW, u1[l], u2[l]);
}

template <typename Real>
inline void dispatch(int law, const Real* u1, const Real* u2, Real* xi) {
  switch (law) {
    case NORMAL: draw_law<NORMAL>(u1, u2, xi); break;
    case LAPLACE: draw_law<LAPLACE>(u1, u2, xi); break;
    case LOGISTIC: draw_law<LOGISTIC>(u1, u2, xi); break;
    case CAUCHY: draw_law<CAUCHY>(u1, u2, xi); break;
    case GUMBEL: draw_law<GUMBEL>(u1, u2, xi); break;
    case UNIFORM: draw_law<UNIFORM>(u1, u2, xi); break;
    case EXPONENTIAL: draw_law<EXPONENTIAL>(u1, u2, xi); break;
    case HALF_NORMAL: draw_law<HALF_NORMAL>(u1, u2, xi); break;
    case HALF_CAUCHY: draw_law<HALF_CAUCHY>(u1, u2, xi); break;
    default: draw_law<RAYLEIGH>(u1, u2, xi); break;
  }
}

template <>
void draw<float>(int law, uint64_t seed, uint64_t offset0, float* xi, uint32_t tag) {
  uint32_t w0[LANES], w1[LANES], w2[LANES], w3[LANES];
  philox(seed, offset0, w0, w1, w2, w3, tag);
  float u1[LANES], u2[LANES];
#pragma omp simd
  for (int l = 0; l < LANES; ++l) {
    u1[l] = (static_cast<float>(static_cast<int32_t>(w0[l] >> 9)) + 0.5f) * 1.1920928955078125e-07f;
    u2[l] = (static_cast<float>(static_cast<int32_t>(w1[l] >> 9)) + 0.5f) * 1.1920928955078125e-07f;
  }
  dispatch<float>(law, u1, u2, xi);
}

template <>
void draw<double>(int law, uint64_t seed, uint64_t offset0, double* xi, uint32_t tag) {
  uint32_t w0[LANES], w1[LANES], w2[LANES], w3[LANES];
  philox(seed, offset0, w0, w1, w2, w3, tag);
  double u1[LANES], u2[LANES];
  for (int l = 0; l < LANES; ++l) {
    const uint64_t a = (static_cast<uint64_t>(w0[l]) << 20) | static_cast<uint64_t>(w1[l] >> 12);
    const uint64_t b = (static_cast<uint64_t>(w2[l]) << 20) | static_cast<uint64_t>(w3[l] >> 12);
    u1[l] = (static_cast<double>(a) + 0.5) * 2.220446049250313e-16;
    u2[l] = (static_cast<double>(b) + 0.5) * 2.220446049250313e-16;
  }
  dispatch<double>(law, u1, u2, xi);
}

// ---------------------------------------------------------------- rows

template <typename Real>
void rows_impl(int law, int64_t P, int64_t start, int64_t n, uint64_t seed, Real* out, int threads,
               uint32_t tag = 0u) {
  const int64_t tiles = (P + LANES - 1) / LANES;
#pragma omp parallel for schedule(dynamic, 256) num_threads(threads)
  for (int64_t item = 0; item < n * tiles; ++item) {
    alignas(64) Real xi[LANES];
    const int64_t r = item / tiles, j0 = (item % tiles) * LANES;
    draw<Real>(law, seed, static_cast<uint64_t>((start + r) * P + j0), xi, tag);
    const int64_t width = std::min<int64_t>(LANES, P - j0);
    std::memcpy(out + r * P + j0, xi, sizeof(Real) * width);
  }
}

// ---------------------------------------------------------------- statistics
// Sums over samples [i0, i1) of xi^a (log xi)^j for the LANES elements from j0; acc is K x LANES.
template <typename Real>
void stats_item(int law, int64_t P, int64_t i0, int64_t i1, int64_t j0, uint64_t seed, int K,
                const int64_t* a, const int64_t* jl, double* acc) {
  alignas(64) Real xi[LANES];
  alignas(64) Real inv[LANES];
  alignas(64) Real lg[LANES];
  alignas(64) Real term[LANES];
  bool need_inv = false, need_log = false;
  int64_t top = 0;
  for (int k = 0; k < K; ++k) {
    need_inv |= a[k] < 0;
    need_log |= jl[k] > 0;
    top = std::max(top, a[k]);
  }
  // The common location-scale case (keys (1,0), (2,0), ... (top,0) in order): one running product.
  bool powers = !need_inv && !need_log && K == top;
  for (int k = 0; powers && k < K; ++k) powers = a[k] == k + 1;
  for (int64_t i = i0; i < i1; ++i) {
    draw<Real>(law, seed, static_cast<uint64_t>(i * P + j0), xi);
    if (powers) {
#pragma omp simd
      for (int l = 0; l < LANES; ++l) term[l] = xi[l];
      for (int k = 0; k < K; ++k) {
        double* row = acc + k * LANES;
        if (k > 0) {
#pragma omp simd
          for (int l = 0; l < LANES; ++l) term[l] = term[l] * xi[l];
        }
#pragma omp simd
        for (int l = 0; l < LANES; ++l) row[l] += static_cast<double>(term[l]);
      }
      continue;
    }
    if (need_inv) {
#pragma omp simd
      for (int l = 0; l < LANES; ++l) inv[l] = Real(1) / xi[l];
    }
    if (need_log) {
#pragma omp simd
      for (int l = 0; l < LANES; ++l) lg[l] = log_(xi[l]);
    }
    for (int k = 0; k < K; ++k) {
#pragma omp simd
      for (int l = 0; l < LANES; ++l) term[l] = Real(1);
      for (int64_t r = 0; r < a[k]; ++r) {
#pragma omp simd
        for (int l = 0; l < LANES; ++l) term[l] = term[l] * xi[l];
      }
      for (int64_t r = 0; r < -a[k]; ++r) {
#pragma omp simd
        for (int l = 0; l < LANES; ++l) term[l] = term[l] * inv[l];
      }
      for (int64_t r = 0; r < jl[k]; ++r) {
#pragma omp simd
        for (int l = 0; l < LANES; ++l) term[l] = term[l] * lg[l];
      }
      double* row = acc + k * LANES;
#pragma omp simd
      for (int l = 0; l < LANES; ++l) row[l] += static_cast<double>(term[l]);
    }
  }
}

}  // namespace

extern "C" {

// out: (stop-start) x P of float32 (fp64 = 0) or float64 (fp64 = 1). Returns 0, or -1 for a bad argument.
int mcgraph_philox_rows(int law, int64_t P, int64_t start, int64_t stop, uint64_t seed, int fp64, void* out,
                        int threads) {
  if (law < 0 || law >= NUM_LAWS || P < 0 || start < 0 || stop < start || threads < 1) return -1;
  if (fp64) {
    rows_impl<double>(law, P, start, stop - start, seed, static_cast<double*>(out), threads);
  } else {
    rows_impl<float>(law, P, start, stop - start, seed, static_cast<float*>(out), threads);
  }
  return 0;
}

// partial: segments x K x (tiles*LANES) float64, zeroed by the caller; segment s covers samples
// [first + s*seg_len, min(first + M, first + (s+1)*seg_len)) of the stream, by their absolute counters
// (first = 0: the whole stream; else one process's share of it). Returns 0, or -1 for a bad argument.
int mcgraph_philox_stats_window(int law, int64_t P, int64_t first, int64_t M, uint64_t seed, int K,
                                const int64_t* a, const int64_t* jl, int fp64, int64_t segments, int64_t seg_len,
                                double* partial, int threads) {
  if (law < 0 || law >= NUM_LAWS || P < 1 || first < 0 || M < 1 || K < 1 || segments < 1 || seg_len < 1 ||
      threads < 1) {
    return -1;
  }
  const int64_t tiles = (P + LANES - 1) / LANES;
#pragma omp parallel num_threads(threads)
  {
    std::vector<double> acc(static_cast<size_t>(K) * LANES);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < segments * tiles; ++item) {
      const int64_t s = item / tiles, t = item % tiles;
      std::fill(acc.begin(), acc.end(), 0.0);
      const int64_t i0 = first + s * seg_len, i1 = std::min(first + M, i0 + seg_len);
      if (fp64) {
        stats_item<double>(law, P, i0, i1, t * LANES, seed, K, a, jl, acc.data());
      } else {
        stats_item<float>(law, P, i0, i1, t * LANES, seed, K, a, jl, acc.data());
      }
      for (int k = 0; k < K; ++k) {
        std::memcpy(partial + (s * K + k) * tiles * LANES + t * LANES, acc.data() + k * LANES,
                    sizeof(double) * LANES);
      }
    }
  }
  return 0;
}

int mcgraph_philox_stats(int law, int64_t P, int64_t M, uint64_t seed, int K, const int64_t* a,
                         const int64_t* jl, int fp64, int64_t segments, int64_t seg_len, double* partial,
                         int threads) {
  return mcgraph_philox_stats_window(law, P, 0, M, seed, K, a, jl, fp64, segments, seg_len, partial, threads);
}

// out: (stop-start) x B Radial radii (standard normals at counter (i*B + b, tag 1)), float32 or float64.
int mcgraph_philox_radius(int64_t B, int64_t start, int64_t stop, uint64_t seed, int fp64, void* out,
                          int threads) {
  if (B < 0 || start < 0 || stop < start || threads < 1) return -1;
  if (fp64) {
    rows_impl<double>(NORMAL, B, start, stop - start, seed, static_cast<double*>(out), threads, 1u);
  } else {
    rows_impl<float>(NORMAL, B, start, stop - start, seed, static_cast<float*>(out), threads, 1u);
  }
  return 0;
}

// acc[k*P + j] += sum over rows r < n of (x[r*P + j] * factor[r*B + j/D])^a[k] (a[k] >= 1; B = P/D), in
// float64: the collapsed statistics of Radial rows drawn as eps (x) and factors r/|eps| by the caller,
// xi = x*factor rounded as the rows round it. Each thread owns whole column tiles and sums the rows in
// order: the same result for any thread count. Returns 0, or -1 for a bad argument.
}  // extern "C"

namespace {
template <typename Real>
void scaled_power_sums_impl(const Real* x, int64_t n, int64_t P, int64_t D, const Real* factor, int K,
                            const int64_t* a, double* acc, int threads) {
  // Work items: blocks of BLOCK_TILES column tiles, each read row by row (streaming access).
  constexpr int64_t BLOCK_TILES = 64;
  const int64_t B = P / D, tiles = (P + LANES - 1) / LANES, blocks = (tiles + BLOCK_TILES - 1) / BLOCK_TILES;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t t1 = std::min(tiles, (blk + 1) * BLOCK_TILES);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t t = blk * BLOCK_TILES; t < t1; ++t) {
        const int64_t j0 = t * LANES, width = std::min<int64_t>(LANES, P - j0);
        const Real* row = x + r * P;
        const Real* f = factor + r * B;
        alignas(64) Real xi[LANES];
        alignas(64) Real term[LANES];
        if (j0 / D == (j0 + width - 1) / D) {  // the tile lies in one event: one factor
          const Real fs = f[j0 / D];
          if (width == LANES) {
#pragma omp simd
            for (int l = 0; l < LANES; ++l) xi[l] = row[j0 + l] * fs;
          } else {
            for (int64_t l = 0; l < width; ++l) xi[l] = row[j0 + l] * fs;
          }
        } else {
          for (int64_t l = 0; l < width; ++l) xi[l] = row[j0 + l] * f[(j0 + l) / D];
        }
        for (int64_t l = width; l < LANES; ++l) xi[l] = Real(0);
        for (int k = 0; k < K; ++k) {
          double* out = acc + k * P + j0;
#pragma omp simd
          for (int l = 0; l < LANES; ++l) term[l] = xi[l];
          for (int64_t e = 1; e < a[k]; ++e) {
#pragma omp simd
            for (int l = 0; l < LANES; ++l) term[l] = term[l] * xi[l];
          }
          if (width == LANES) {
#pragma omp simd
            for (int l = 0; l < LANES; ++l) out[l] += static_cast<double>(term[l]);
          } else {
            for (int64_t l = 0; l < width; ++l) out[l] += static_cast<double>(term[l]);
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// out[e] = sqrt(sum_d x[e*D + d]^2) for the E = rows x batch events of D elements: one event per work
// item, summed in order in float64 — the same norms for any chunking and any thread count.
int mcgraph_event_norms(const void* x, int64_t E, int64_t D, int fp64, double* out, int threads) {
  if (E < 0 || D < 1 || threads < 1) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t e = 0; e < E; ++e) {
    double s = 0.0;
    if (fp64) {
      const double* p = static_cast<const double*>(x) + e * D;
      for (int64_t d = 0; d < D; ++d) s += p[d] * p[d];
    } else {
      const float* p = static_cast<const float*>(x) + e * D;
      for (int64_t d = 0; d < D; ++d) s += static_cast<double>(p[d]) * static_cast<double>(p[d]);
    }
    out[e] = std::sqrt(s);
  }
  return 0;
}

}  // extern "C"

namespace {
// Normal rows as rows_impl draws them, and the Euclidean norm of each event of D = P / B elements
// (B == 1, or D a multiple of LANES, so that no tile straddles two events): each tile's squares are
// summed in float64 pairwise over its lanes while the tile is in registers, then each event's tile
// sums in order. No second pass over the rows, and the same norms for any thread count and any
// range of rows.
// sq[0] <- the sum of sq[0 .. LANES), added pairwise in a fixed order (LANES is a power of two).
inline void fold_lanes(double* sq) {
#pragma omp simd
  for (int l = 0; l < 16; ++l) sq[l] += sq[l + 16];
#pragma omp simd
  for (int l = 0; l < 8; ++l) sq[l] += sq[l + 8];
#pragma omp simd
  for (int l = 0; l < 4; ++l) sq[l] += sq[l + 4];
  sq[0] += sq[2];
  sq[1] += sq[3];
  sq[0] += sq[1];
}
static_assert(LANES == 32, "fold_lanes sums 32 lanes");

// Rows of at least this many elements are written by streaming stores (store_tile).
constexpr int64_t STREAM_MIN_ELEMENTS = int64_t(1) << 21;

// dst[0 .. width) <- xi. With `stream`, a whole float32 tile aligned to 32 bytes goes to memory by streaming
// stores: rows of 8 MiB and more are read back by a later pass from memory anyway, and a plain store would first
// read each line into the cache, evicting what that pass reads. The caller fences (_mm_sfence) before the reads.
template <typename Real>
inline void store_tile(Real* dst, const Real* xi, int64_t width, bool stream) {
#if defined(__AVX2__)
  if constexpr (sizeof(Real) == 4) {
    if (stream && width == LANES && reinterpret_cast<uintptr_t>(dst) % 32 == 0) {
      for (int l = 0; l < LANES; l += 8) _mm256_stream_ps(dst + l, _mm256_load_ps(xi + l));
      return;
    }
  }
#endif
  std::memcpy(dst, xi, sizeof(Real) * width);
}

template <typename Real>
void rows_norms_impl(int64_t P, int64_t B, int64_t start, int64_t n, uint64_t seed, Real* out, double* norms,
                     int threads) {
  const int64_t tiles = (P + LANES - 1) / LANES;
  const int64_t per = B == 1 ? tiles : (P / B) / LANES;  // tiles per event
  std::vector<double> sums(static_cast<size_t>(n * tiles));
  const bool stream = n * P >= STREAM_MIN_ELEMENTS;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 256)
    for (int64_t item = 0; item < n * tiles; ++item) {
      alignas(64) Real xi[LANES];
      alignas(64) double sq[LANES];
      const int64_t r = item / tiles, j0 = (item % tiles) * LANES;
      draw<Real>(NORMAL, seed, static_cast<uint64_t>((start + r) * P + j0), xi);
      const int64_t width = std::min<int64_t>(LANES, P - j0);
      store_tile(out + r * P + j0, xi, width, stream);
      if (width == LANES) {
#pragma omp simd
        for (int l = 0; l < LANES; ++l) sq[l] = static_cast<double>(xi[l]) * static_cast<double>(xi[l]);
      } else {
        for (int l = 0; l < LANES; ++l) {
          sq[l] = l < width ? static_cast<double>(xi[l]) * static_cast<double>(xi[l]) : 0.0;
        }
      }
      fold_lanes(sq);
      sums[static_cast<size_t>(item)] = sq[0];
    }
#if defined(__AVX2__)
    if (stream) _mm_sfence();  // this thread's streaming stores are visible before anyone reads the rows
#endif
  }
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t e = 0; e < n * B; ++e) {
    const double* s = sums.data() + (e / B) * tiles + (e % B) * per;
    double acc = 0.0;
    for (int64_t t = 0; t < per; ++t) acc += s[t];
    norms[e] = std::sqrt(acc);
  }
}
}  // namespace

extern "C" {

// out: (stop-start) x P normal rows (as mcgraph_philox_rows with the normal law); norms: (stop-start) x B
// event norms, float64. Needs B == 1 or (P / B) % LANES == 0. Returns 0, or -1 for a bad argument.
int mcgraph_philox_rows_norms(int64_t P, int64_t B, int64_t start, int64_t stop, uint64_t seed, int fp64,
                              void* out, double* norms, int threads) {
  if (P < 1 || B < 1 || P % B != 0 || (B != 1 && (P / B) % LANES != 0) || start < 0 || stop < start ||
      threads < 1) {
    return -1;
  }
  if (fp64) {
    rows_norms_impl<double>(P, B, start, stop - start, seed, static_cast<double*>(out), norms, threads);
  } else {
    rows_norms_impl<float>(P, B, start, stop - start, seed, static_cast<float*>(out), norms, threads);
  }
  return 0;
}

int mcgraph_scaled_power_sums(const void* x, int64_t n, int64_t P, int64_t D, const void* factor, int K,
                              const int64_t* a, int fp64, double* acc, int threads) {
  if (n < 0 || P < 1 || D < 1 || P % D != 0 || K < 1 || threads < 1) return -1;
  for (int k = 0; k < K; ++k) {
    if (a[k] < 1) return -1;
  }
  if (fp64) {
    scaled_power_sums_impl<double>(static_cast<const double*>(x), n, P, D,
                                   static_cast<const double*>(factor), K, a, acc, threads);
  } else {
    scaled_power_sums_impl<float>(static_cast<const float*>(x), n, P, D, static_cast<const float*>(factor), K,
                                  a, acc, threads);
  }
  return 0;
}

int mcgraph_philox_lanes() { return LANES; }

// The instruction set the Philox rounds were compiled for: "avx512", "avx2" or "portable".
const char* mcgraph_philox_isa() { return MCGRAPH_PHILOX_ISA; }

// Philox4x32-10 words of LANES consecutive offsets by the vector path and by the portable loop
// (out: 8 x LANES words, vector then portable), for the tests that compare the two.
void mcgraph_philox_words(uint64_t seed, uint64_t offset0, uint32_t* out) {
  philox(seed, offset0, out, out + LANES, out + 2 * LANES, out + 3 * LANES);
  philox_portable(seed, offset0, out + 4 * LANES, out + 5 * LANES, out + 6 * LANES, out + 7 * LANES);
}

}  // extern "C"
