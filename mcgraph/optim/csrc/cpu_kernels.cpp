// The variational optimizers' element-wise updates in one pass over memory (built at first use by
// mcgraph.optim.cpu_kernels): IVON's update and the passes of its weight samples (forming theta,
// recording a sample's statistics); VOGN's update and its noise variance.
//
// IVON. mcgraph.optim.IVON.step runs Algorithm 1, lines 3-6, of Shen et al. (ICML 2024) as about twenty
// element-wise torch operations, each a pass over every parameter-sized buffer. This loop does the
// same operations, in the same order and the same precision, on each element once:
//
//   g  <- b1 g + (1 - b1) g_avg                                          (line 3)
//   f  <- ess * (price ? h_avg * (h + wd) : h_avg)                       (line 2: lambda h-hat)
//   h' <- b2 h + (1 - b2) f + 0.5 (1 - b2)^2 (h - f)^2 / (h + wd)        (line 4, eq. 8)
//   s  <- clip((g / debias + wd m) / (h' + wd), rho)                     (lines 5-6)
//   m  <- m - lr s
//
// and writes the next step's h' + wd and ess (h' + wd) (whose square root is 1/sigma), which the
// torch path computes in three more passes. Every operation is one IEEE-rounded multiply, add,
// subtract or divide (compiled with -ffp-contract=off, no FMA the source does not write), so the
// results equal the torch path's bit for bit; the tests compare them with torch.equal.
//
// VOGN. mcgraph.optim.VOGN's step (seed 003, Algorithm 1, lines 17-19) with a scalar prior term d:
//
//   m' <- b1 m + (g + d mu)        s' <- keep s + b2 h        mu' <- mu - lr m' / (s' + d + damping)
//
// into new buffers (the optimizer commits them only when every number is finite), and the noise
// variance 1 / (N (s + d + damping)) (times tau for the torchsso variant), the same operations as
// the torch expressions, in their order.
//
// Plain C++ and OpenMP, no torch headers; loaded with ctypes. Threads split the elements into
// blocks; an element's result does not depend on the number of threads.

#include <cstdint>

namespace {

template <typename T>
struct Scalars {
  T b1, one_minus_b1, ess, half_corr, b2, one_minus_b2, debias, wd, lr, clip;
};

template <typename T, bool PRICE, bool CLIP>
void step_block(int64_t n, T* __restrict mean, T* __restrict momentum, T* __restrict hess,
                const T* __restrict grad_avg, const T* __restrict hess_avg, T* __restrict hess_wd,
                T* __restrict scale_sq, const Scalars<T> c) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    T g = momentum[i] * c.b1;
    T gbar = grad_avg[i] * c.one_minus_b1;
    g = g + gbar;
    momentum[i] = g;
    const T hw = hess_wd[i];  // h + wd of the step's start
    T f = hess_avg[i];
    if (PRICE) f = f * hw;  // g-hat * (theta - m) / sigma^2 = g-hat * noise * (h + wd) * ess
    f = f * c.ess;
    const T h0 = hess[i];
    T corr = h0 - f;
    corr = corr * corr;
    corr = corr * c.half_corr;
    corr = corr / hw;
    T h = h0 * c.b2;
    f = f * c.one_minus_b2;
    h = h + f;
    h = h + corr;
    hess[i] = h;
    T s = g / c.debias;
    const T decay = mean[i] * c.wd;
    s = s + decay;
    const T hw_next = h + c.wd;
    s = s / hw_next;
    if (CLIP) {
      s = s < -c.clip ? -c.clip : s;  // NaN stays NaN, as with torch.clamp
      s = s > c.clip ? c.clip : s;
    }
    s = s * c.lr;
    mean[i] = mean[i] - s;
    hess_wd[i] = hw_next;
    scale_sq[i] = hw_next * c.ess;
  }
}

template <typename T, bool PRICE, bool CLIP>
void step_all(int64_t n, T* mean, T* momentum, T* hess, const T* grad_avg, const T* hess_avg, T* hess_wd,
              T* scale_sq, const Scalars<T> c, int threads) {
  const int64_t block = 1 << 14;
  const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * block;
    const int64_t len = n - lo < block ? n - lo : block;
    step_block<T, PRICE, CLIP>(len, mean + lo, momentum + lo, hess + lo, grad_avg + lo, hess_avg + lo,
                               hess_wd + lo, scale_sq + lo, c);
  }
}

template <typename T>
void step(int64_t n, void* mean, void* momentum, void* hess, const void* grad_avg, const void* hess_avg,
         void* hess_wd, void* scale_sq, const double* s, int price, int clip, int threads) {
  // Each scalar rounded once to T, as torch rounds a Python number or a 0-d tensor of T.
  const Scalars<T> c{T(s[0]), T(s[1]), T(s[2]), T(s[3]), T(s[4]), T(s[5]), T(s[6]), T(s[7]), T(s[8]), T(s[9])};
  auto m = static_cast<T*>(mean);
  auto g = static_cast<T*>(momentum);
  auto h = static_cast<T*>(hess);
  auto ga = static_cast<const T*>(grad_avg);
  auto ha = static_cast<const T*>(hess_avg);
  auto hw = static_cast<T*>(hess_wd);
  auto sq = static_cast<T*>(scale_sq);
  if (price) {
    if (clip) step_all<T, true, true>(n, m, g, h, ga, ha, hw, sq, c, threads);
    else step_all<T, true, false>(n, m, g, h, ga, ha, hw, sq, c, threads);
  } else {
    if (clip) step_all<T, false, true>(n, m, g, h, ga, ha, hw, sq, c, threads);
    else step_all<T, false, false>(n, m, g, h, ga, ha, hw, sq, c, threads);
  }
}

// A weight sample: eps <- eps / inv (sigma * epsilon), theta <- mean + eps.
template <typename T>
void sample(int64_t n, T* __restrict eps, const T* __restrict inv, const T* __restrict mean, T* __restrict theta,
            int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads) if (threads > 1 && n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const T noise = eps[i] / inv[i];
    eps[i] = noise;
    theta[i] = mean[i] + noise;
  }
}

// The first sample of a step: grad_avg <- grad; hess_avg <- noise * grad (price) or grad * grad.
// hess_avg may be noise itself (the price estimator overwrites the sample's noise).
template <typename T>
void record_first(int64_t n, const T* __restrict grad, const T* noise, T* __restrict grad_avg, T* hess_avg,
                  int price, int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads) if (threads > 1 && n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i];
    grad_avg[i] = g;
    hess_avg[i] = price ? noise[i] * g : g * g;
  }
}

// VOGN's update into new buffers; momentum == nullptr at the first step (m' = g + d mu).
template <typename T>
void vogn_update(int64_t n, const T* __restrict mean, const T* __restrict grad, const T* __restrict hess,
                 const T* __restrict momentum, const T* __restrict precision, T* __restrict mean_out,
                 T* __restrict momentum_out, T* __restrict precision_out, const double* sc, int threads) {
  const T delta = T(sc[0]), beta1 = T(sc[1]), keep = T(sc[2]), beta2 = T(sc[3]), lr = T(sc[4]),
          damping = T(sc[5]);
#pragma omp parallel for simd schedule(static) num_threads(threads) if (threads > 1 && n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const T mu = mean[i];
    T g = mu * delta;  // delta * mu
    g = grad[i] + g;
    T m = g;
    if (momentum) {
      m = momentum[i] * beta1;
      m = m + g;
    }
    T s = precision[i] * keep;
    const T h = hess[i] * beta2;
    s = s + h;
    T den = s + delta;
    den = den + damping;
    T step = m * lr;
    step = step / den;
    mean_out[i] = mu - step;
    momentum_out[i] = m;
    precision_out[i] = s;
  }
}

// VOGN's noise variance: 1 / (N ((s + d) + damping)), times tau when scale_by_tau.
template <typename T>
void vogn_variance(int64_t n, const T* __restrict precision, T* __restrict out, const double* sc, int scale_by_tau,
                   int threads) {
  const T delta = T(sc[0]), damping = T(sc[1]), size = T(sc[2]), tau = T(sc[3]);
#pragma omp parallel for simd schedule(static) num_threads(threads) if (threads > 1 && n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    T v = precision[i] + delta;
    v = v + damping;
    v = v * size;
    v = T(1) / v;  // torch's 1.0 / t: reciprocal(t) * 1.0
    if (scale_by_tau) v = v * tau;
    out[i] = v;
  }
}

// A later sample of a step (Welford, as ivon-opt): a <- a + (v - a) / count for v = grad and for
// v = noise * grad (price) or grad * grad.
template <typename T>
void record_next(int64_t n, const T* __restrict grad, const T* __restrict noise, T* __restrict grad_avg,
                 T* __restrict hess_avg, T count, int price, int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads) if (threads > 1 && n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i];
    T d = g - grad_avg[i];
    d = d / count;
    grad_avg[i] = grad_avg[i] + d;
    T h = price ? noise[i] * g : g * g;
    h = h - hess_avg[i];
    h = h / count;
    hess_avg[i] = hess_avg[i] + h;
  }
}

// Calls f(T{}) with T the buffers' element type (float64: 0 for float32, 1 for float64) and returns 0,
// or returns -1 for another code.
template <typename F>
int by_dtype(int float64, F&& f) {
  if (float64 == 1) {
    f(double{});
    return 0;
  }
  if (float64 == 0) {
    f(float{});
    return 0;
  }
  return -1;
}

}  // namespace

extern "C" {

// Every entry point returns 0, or -1 for an unknown dtype code (float64: 0 for float32 buffers, 1 for float64).

int mcgraph_ivon_record_next(int float64, int64_t n, const void* grad, const void* noise, void* grad_avg,
                             void* hess_avg, double count, int price, int threads) {
  return by_dtype(float64, [&](auto zero) {
    using T = decltype(zero);
    record_next<T>(n, static_cast<const T*>(grad), static_cast<const T*>(noise), static_cast<T*>(grad_avg),
                   static_cast<T*>(hess_avg), T(count), price, threads);
  });
}

// scalars: delta, beta1, keep, beta2, lr, damping (6 doubles); momentum may be NULL.
int mcgraph_vogn_update(int float64, int64_t n, const void* mean, const void* grad, const void* hess,
                        const void* momentum, const void* precision, void* mean_out, void* momentum_out,
                        void* precision_out, const double* scalars, int threads) {
  return by_dtype(float64, [&](auto zero) {
    using T = decltype(zero);
    vogn_update<T>(n, static_cast<const T*>(mean), static_cast<const T*>(grad), static_cast<const T*>(hess),
                   static_cast<const T*>(momentum), static_cast<const T*>(precision), static_cast<T*>(mean_out),
                   static_cast<T*>(momentum_out), static_cast<T*>(precision_out), scalars, threads);
  });
}

// scalars: delta, damping, N, tau (4 doubles).
int mcgraph_vogn_variance(int float64, int64_t n, const void* precision, void* out, const double* scalars,
                          int scale_by_tau, int threads) {
  return by_dtype(float64, [&](auto zero) {
    using T = decltype(zero);
    vogn_variance<T>(n, static_cast<const T*>(precision), static_cast<T*>(out), scalars, scale_by_tau, threads);
  });
}

int mcgraph_ivon_sample(int float64, int64_t n, void* eps, const void* inv, const void* mean, void* theta,
                        int threads) {
  return by_dtype(float64, [&](auto zero) {
    using T = decltype(zero);
    sample<T>(n, static_cast<T*>(eps), static_cast<const T*>(inv), static_cast<const T*>(mean),
              static_cast<T*>(theta), threads);
  });
}

int mcgraph_ivon_record_first(int float64, int64_t n, const void* grad, void* noise, void* grad_avg,
                              void* hess_avg, int price, int threads) {
  return by_dtype(float64, [&](auto zero) {
    using T = decltype(zero);
    record_first<T>(n, static_cast<const T*>(grad), static_cast<const T*>(noise), static_cast<T*>(grad_avg),
                    static_cast<T*>(hess_avg), price, threads);
  });
}

// scalars: b1, 1 - b1, ess, 0.5 (1 - b2)^2, b2, 1 - b2, debias, wd, lr, clip radius (10 doubles).
int mcgraph_ivon_step(int float64, int64_t n, void* mean, void* momentum, void* hess, const void* grad_avg,
                      const void* hess_avg, void* hess_wd, void* scale_sq, const double* scalars, int price,
                      int clip, int threads) {
  return by_dtype(float64, [&](auto zero) {
    step<decltype(zero)>(n, mean, momentum, hess, grad_avg, hess_avg, hess_wd, scale_sq, scalars, price, clip,
                         threads);
  });
}

int mcgraph_cpu_kernels_abi() { return 2; }

}  // extern "C"
