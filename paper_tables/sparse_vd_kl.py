"""Seed 001 / Molchanov et al. (2017), Eq. 14: the log-uniform KL's closed-form fit against mcgraph's estimate.

KL(N(θ, αθ²) ‖ p(w) ∝ 1/|w|) depends on α only and has no closed form. Sparse variational dropout
uses the fit k1 − k1·sigmoid(k2 + k3 log α) + ½ log(1 + 1/α). mcgraph estimates the same KL with
M samples per point (``mg.nn.sparse_vd.kl_log_uniform``: closed-form entropy, E_q[log|w|] by the
fused tier, memory independent of M), and an adaptive quadrature (scipy) of the one-dimensional
integral is a third, independent value. The table and figure give the fit's error against both over
log α ∈ [−8, 8], and the standard error of the estimate.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .common import TargetResult, log, md_table, timed, write_target

NAME = "sparse_vd_kl"
TITLE = "Seed 001: Sparse VD's KL approximation (k1, k2, k3) against mcgraph's many-sample estimate"
PAPER = ("Molchanov, Ashukha, Vetrov. Variational Dropout Sparsifies Deep Neural Networks. ICML 2017, Eq. 14 "
         "(seed 001's 'Approximating KL-divergence' slide)")


def _settings(quick: bool) -> dict:
    if quick:
        return {"points": 33, "num_samples": 1 << 16, "se_draws": 2048, "table_every": 4}
    return {"points": 161, "num_samples": 1 << 22, "se_draws": 16384, "table_every": 10}


def quadrature(log_alpha: float) -> float:
    """KL(α) with the fit's constant (→ 0 as α → ∞), by adaptive quadrature of E log|1 + √α ε|."""
    from scipy import integrate
    from scipy.stats import norm

    from mcgraph.nn.sparse_vd import C_INF

    s = math.exp(0.5 * log_alpha)

    def f(e):
        return math.log(abs(1.0 + s * e)) * norm.pdf(e)

    # |ε| > 12 carries < 1e-32 of the mass; split at 0 and at the singularity ε = −1/√α when it is inside
    cuts = sorted({-12.0, 0.0, 12.0} | ({-1.0 / s} if -1.0 / s > -12.0 else set()))
    total = sum(integrate.quad(f, lo, hi, limit=500, epsabs=1e-13, epsrel=1e-12)[0] for lo, hi in zip(cuts, cuts[1:]))
    return -0.5 * math.log(2 * math.pi * math.e) - 0.5 * log_alpha + total - C_INF


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Evaluate the three KLs on the grid and write ``sparse_vd_kl.{md,png,json}``."""
    import mcgraph as mg
    from mcgraph.nn import sparse_vd as svd

    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    with timed(result):
        la = torch.linspace(-8.0, 8.0, s["points"], dtype=torch.float64)
        theta = torch.ones_like(la, requires_grad=True)
        sigma = torch.exp(0.5 * la)
        q = torch.distributions.Normal(theta, theta * sigma)
        log(f"{s['points']} points × M = {s['num_samples']}")
        est = svd.kl_log_uniform(q, s["num_samples"], seed=seed)
        size_big = mg.graph_size(est)
        size_one = mg.graph_size(svd.kl_log_uniform(q, 1, seed=seed))
        est = est.detach()
        eps = torch.randn(s["se_draws"], la.numel(), dtype=torch.float64,
                          generator=torch.Generator().manual_seed(seed + 1))
        se = torch.log(torch.abs(1 + sigma * eps)).std(0) / math.sqrt(s["num_samples"])
        approx = svd.kl_approx(la)
        quad = torch.tensor([quadrature(float(v)) for v in la], dtype=torch.float64)
    rows = [{"log_alpha": float(a), "approx": float(p), "mcgraph": float(e), "se": float(d), "quadrature": float(r),
             "approx_minus_mcgraph": float(p - e), "approx_minus_quadrature": float(p - r),
             "mcgraph_minus_quadrature": float(e - r)} for a, p, e, d, r in zip(la, approx, est, se, quad)]
    result.rows = {"grid": rows, "graph_size": {"M1": list(size_one), f"M{s['num_samples']}": list(size_big)}}
    result.seeds = [seed]
    result.scale = (f"log α on {s['points']} equally spaced points of [−8, 8] (θ = 1, σ² = α); mcgraph's estimate "
                    f"with M = {s['num_samples']:,} samples per point, seed {seed}; standard errors from "
                    f"{s['se_draws']} independent draws of the integrand; quadrature by scipy.integrate.quad "
                    "on ε ∈ [−12, 12] split at 0 and at the singularity ε = −1/√α. All three share the fit's "
                    "constant (KL → 0 as α → ∞).")
    return report(out_dir, result)


def report(out_dir, result: TargetResult) -> dict:
    rows = result.rows["grid"]
    s = result.params
    worst = max(rows, key=lambda r: abs(r["approx_minus_mcgraph"]))
    worst_q = max(rows, key=lambda r: abs(r["approx_minus_quadrature"]))
    max_se = max(r["se"] for r in rows)
    within = all(abs(r["approx_minus_mcgraph"]) <= 0.01 + 5 * r["se"] for r in rows)
    result.compare("max |fit − KL| over log α ∈ [−8, 8]", "≈ 0.01 (the fit's stated accuracy)",
                   f"{abs(worst['approx_minus_mcgraph']):.4f} at log α = {worst['log_alpha']:.2f} vs mcgraph "
                   f"(max SE {max_se:.1e}); {abs(worst_q['approx_minus_quadrature']):.4f} at log α = "
                   f"{worst_q['log_alpha']:.2f} vs quadrature",
                   f"{s['points']} points, M = {s['num_samples']:,}",
                   "agrees" if within else "the estimate's noise is larger than the fit's error at this M")
    agree = max(abs(r["mcgraph_minus_quadrature"]) / r["se"] for r in rows)
    result.compare("mcgraph estimate vs quadrature", "—", f"max |Δ| / SE = {agree:.2f}", f"M = {s['num_samples']:,}",
                   "—" if agree < 5 else "larger than 5 standard errors: investigate")
    g = result.rows["graph_size"]
    big = next(k for k in g if k != "M1")
    result.compare("graph of the estimate (autograd nodes, saved bytes)", "—",
                   f"M = 1: {tuple(g['M1'])}; {big}: {tuple(g[big])}", "the whole grid", "—")
    every = s["table_every"]
    table = [(f"{round(r['log_alpha'], 6) + 0.0:.1f}", f"{r['approx']:.5f}", f"{r['mcgraph']:.5f} ± {r['se']:.5f}",
              f"{r['quadrature']:.5f}", f"{r['approx_minus_mcgraph']:+.5f}", f"{r['approx_minus_quadrature']:+.5f}")
             for i, r in enumerate(rows) if i % every == 0 or r is worst]
    result.section("Error of the fit", md_table(("log α", "fit (k1, k2, k3)", "mcgraph (± SE)", "quadrature",
                                                 "fit − mcgraph", "fit − quadrature"), table))
    return write_target(out_dir, result, plot)


def plot(result: TargetResult, path) -> None:
    import matplotlib.pyplot as plt

    rows = result.rows["grid"]
    la = np.array([r["log_alpha"] for r in rows])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(la, [r["approx"] for r in rows], label="fit k1, k2, k3")
    a.plot(la, [r["mcgraph"] for r in rows], "o", ms=3, label="mcgraph, M samples")
    a.set_xlabel("log α")
    a.set_ylabel("KL (constant: 0 as α → ∞)")
    a.legend()
    err = np.array([r["approx_minus_mcgraph"] for r in rows])
    se = np.array([r["se"] for r in rows])
    b.fill_between(la, err - 2 * se, err + 2 * se, alpha=0.3, label="fit − mcgraph ± 2 SE")
    b.plot(la, err, "o-", ms=3)
    b.plot(la, [r["approx_minus_quadrature"] for r in rows], "k--", label="fit − quadrature")
    b.axhline(0, color="grey", lw=0.5)
    b.set_xlabel("log α")
    b.set_ylabel("error of the fit")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = ["run", "report", "plot", "quadrature"]
