"""Table 1 (the recipe): posterior family × prior family → tier and d_P of KL(q ‖ p), generated.

Rows are the posterior families of the engine's registry (``mcgraph.FAMILIES.registered()``),
plus the paper's posteriors that the registry lacks; columns are the named priors of
``mcgraph.nn.PRIORS`` plus the paper's priors that registry lacks. Nothing in a cell is typed:
for each pair the KL integrands (``log p(w)``, and ``log q(w)`` when ``q`` has no closed-form
entropy) are classified by :func:`mcgraph.explain`, and every cell whose KL is finite is
*measured*: ``mg.graph_size`` of ``mg.kl_divergence(q, p, M).sum()`` at M = 1 and M = 1000
(equal for collapsed, fused and chunked terms), beside the direct graph (which grows with M).

The paper's Table 1 lists three groups (scaling posteriors with their priors, location-scale
posteriors with theirs, Log-Normal with Pareto). Its text extraction interleaves the columns;
the grouping used here is our reading of it (see :data:`PAPER_GROUPS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import distributions as D
from torch.distributions import transforms as T

import mcgraph as mg
from mcgraph import distributions as mgd

from .common import TargetResult, fmt_bytes, md_table, timed, write_target

NAME = "table1"
TITLE = "Table 1: posterior × prior families, tier and d_P (generated from the registry)"

#: Our reading of the paper's Table 1: group → (posteriors, priors), names as printed.
#: "Logistic" as a location-scale prior is a guess: in the text extraction it stands alone
#: between the location-scale posteriors and Log-Normal.
PAPER_GROUPS = {
    "scaling (Thm 1, Cor 1)": (
        ("Exponential", "Rayleigh", "Erlang", "Error", "Inverse-Gamma", "Standard Wald", "Weibull", "Gamma",
         "Log-Gamma"),
        ("Exponential", "Dirichlet", "Inverse-Gamma", "Log-normal", "Inverse-Gaussian", "Standard Wald",
         "Chi-squared", "Gamma", "Error", "Normal", "Rayleigh", "Pareto", "Erlang", "Weibull")),
    "location-scale (Thm 2, Cor 2)": (
        ("Normal", "Logistic", "Radial", "Laplace", "Horseshoe"),
        ("Exponential", "Normal", "Laplace", "Horseshoe", "Radial", "Dirichlet", "Logistic")),
    "transformed (Cor 1-2)": (("Log-Normal",), ("Pareto",)),
}

P_WEIGHTS = 8  #: weights per cell (the KL is a sum over them)
M_SMALL, M_LARGE = 1, 1000

_TIER_RANK = {"collapsed": 0, "fused": 1, "chunked": 2, "direct": 3}
_TIER_CODE = {"collapsed": "C", "fused": "F", "chunked": "K"}


def _c(v, like):
    return torch.as_tensor(v, dtype=like.dtype)


@dataclass(frozen=True)
class Entry:
    """A row (posterior) or column (prior).

    ``make`` builds the distribution: posteriors ``make(mu, s)`` from a location and a positive
    scale that require grad; priors ``make(like)``. ``None`` with ``missing`` saying why.
    """

    label: str
    paper: str | None
    make: Callable | None
    missing: str = ""


#: Example instance per registered posterior class (the rows iterate the registry; a registered
#: class without an example here is shown as a row saying so, never dropped).
POSTERIOR_EXAMPLES: dict = {
    D.Normal: ("Normal", lambda mu, s: D.Normal(mu, s)),
    D.Laplace: ("Laplace", lambda mu, s: D.Laplace(mu, s)),
    D.Cauchy: (None, lambda mu, s: D.Cauchy(mu, s)),
    mgd.Logistic: ("Logistic", lambda mu, s: mgd.Logistic(mu, s)),
    D.Gumbel: (None, lambda mu, s: D.Gumbel(mu, s)),
    D.StudentT: (None, lambda mu, s: D.StudentT(_c(5.0, mu), mu, s)),
    D.Uniform: (None, lambda mu, s: D.Uniform(mu, mu + s)),
    mgd.Radial: ("Radial", lambda mu, s: mgd.Radial(mu, s)),
    D.Exponential: ("Exponential", lambda mu, s: D.Exponential(s)),
    D.Gamma: ("Gamma", lambda mu, s: D.Gamma(_c(2.5, s), s)),
    D.InverseGamma: ("Inverse-Gamma", lambda mu, s: D.InverseGamma(_c(3.0, s), s)),
    D.Weibull: ("Weibull", lambda mu, s: D.Weibull(s, _c(1.7, s))),
    D.HalfNormal: (None, lambda mu, s: D.HalfNormal(s)),
    D.HalfCauchy: (None, lambda mu, s: D.HalfCauchy(s)),
    mgd.Rayleigh: ("Rayleigh", lambda mu, s: mgd.Rayleigh(s)),
    D.Independent: (None, lambda mu, s: D.Independent(D.Normal(mu, s), 1)),
    D.TransformedDistribution: (None, lambda mu, s: D.TransformedDistribution(
        D.Normal(mu, s), [T.AffineTransform(_c(0.5, mu), _c(2.0, mu)), T.ExpTransform()])),
    D.LogNormal: ("Log-Normal", lambda mu, s: D.LogNormal(mu, s)),
}

#: Paper posteriors the registry has no class for (or reaches only through a parent class).
EXTRA_POSTERIORS = (
    Entry("Erlang(k=3) = Gamma(3, θ)", "Erlang", lambda mu, s: D.Gamma(_c(3.0, s), s)),
    Entry("Horseshoe (mcgraph.distributions)", "Horseshoe", lambda mu, s: mgd.Horseshoe(mu, s)),
    Entry("Error (generalised normal)", "Error", None, "no distribution class in torch or mcgraph"),
    Entry("Standard Wald (inverse Gaussian)", "Standard Wald", None, "no distribution class in torch or mcgraph"),
    Entry("Log-Gamma", "Log-Gamma", None, "no distribution class in torch or mcgraph"),
)

#: mcgraph.nn prior names → the paper's names.
_NN_PRIOR_PAPER = {"normal": "Normal", "laplace": "Laplace", "horseshoe": "Horseshoe"}

#: Paper priors that mcgraph.nn.PRIORS does not name (scalar parameters, chosen here); the first
#: three stand in for mcgraph.nn's own when that module is not importable.
EXTRA_PRIORS = (
    Entry("Normal(0, 1)", "Normal", lambda like: D.Normal(_c(0.0, like), _c(1.0, like))),
    Entry("Laplace(0, 1)", "Laplace", lambda like: D.Laplace(_c(0.0, like), _c(1.0, like))),
    Entry("Horseshoe(0, 1)", "Horseshoe", lambda like: mgd.Horseshoe(_c(0.0, like), _c(1.0, like))),
    Entry("Exponential(1)", "Exponential", lambda like: D.Exponential(_c(1.0, like))),
    Entry("Gamma(2, 2)", "Gamma", lambda like: D.Gamma(_c(2.0, like), _c(2.0, like))),
    Entry("Erlang(3, 1)", "Erlang", lambda like: D.Gamma(_c(3.0, like), _c(1.0, like))),
    Entry("Chi-squared(3)", "Chi-squared", lambda like: D.Chi2(_c(3.0, like))),
    Entry("Inverse-Gamma(2, 1)", "Inverse-Gamma", lambda like: D.InverseGamma(_c(2.0, like), _c(1.0, like))),
    Entry("Log-normal(0, 1)", "Log-normal", lambda like: D.LogNormal(_c(0.0, like), _c(1.0, like))),
    Entry("Rayleigh(1)", "Rayleigh", lambda like: mgd.Rayleigh(_c(1.0, like))),
    Entry("Weibull(1, 1.5)", "Weibull", lambda like: D.Weibull(_c(1.0, like), _c(1.5, like))),
    Entry("Pareto(0.1, 2)", "Pareto", lambda like: D.Pareto(_c(0.1, like), _c(2.0, like))),
    Entry("Logistic(0, 1)", "Logistic", lambda like: mgd.Logistic(_c(0.0, like), _c(1.0, like))),
    Entry("Radial(0, 1)", "Radial", lambda like: mgd.Radial(torch.zeros_like(like), torch.ones_like(like))),
    Entry("Dirichlet", "Dirichlet", None, "simplex-valued: not a prior on one real weight"),
    Entry("Inverse-Gaussian / Standard Wald", "Inverse-Gaussian", None, "no distribution class in torch or mcgraph"),
    Entry("Error (generalised normal)", "Error", None, "no distribution class in torch or mcgraph"),
)


def posterior_entries() -> tuple[list[Entry], str]:
    """One row per registered family (registry order), then the paper's extra posteriors."""
    rows = []
    for cls in mg.FAMILIES.registered():
        if cls in POSTERIOR_EXAMPLES:
            paper, make = POSTERIOR_EXAMPLES[cls]
            rows.append(Entry(cls.__name__, paper, make))
        else:
            rows.append(Entry(cls.__name__, None, None, "registered, but paper_tables has no example instance"))
    return rows + list(EXTRA_POSTERIORS), "mcgraph.FAMILIES.registered()"


def prior_entries() -> tuple[list[Entry], str]:
    """The named priors of ``mcgraph.nn.PRIORS`` (when importable), then the paper's extra priors."""
    cols, source = [], "mcgraph.nn.PRIORS"
    try:
        from mcgraph.nn import PRIORS, make_prior
    except Exception as e:  # noqa: BLE001 — mcgraph.nn is optional here: fall back to the paper's list
        PRIORS, source = {}, f"mcgraph.nn.PRIORS not importable ({type(e).__name__}); paper priors only"
    for name in PRIORS:
        if getattr(PRIORS[name](torch.zeros(())), "posterior_dependent", False):
            continue  # a prior set from q (ARD): its KL is a layer rule, not an integrand of the engine
        cols.append(Entry(f"{name} (nn)", _NN_PRIOR_PAPER.get(name),
                          lambda like, n=name: make_prior(n, like)))
    covered = {c.paper for c in cols if c.paper}
    cols += [e for e in EXTRA_PRIORS if e.paper not in covered]
    return cols, source


def paper_groups_of(q_paper: str | None, p_paper: str | None) -> list[str]:
    """Paper groups listing both names (empty: the paper does not list this cell)."""
    if q_paper is None or p_paper is None:
        return []
    return [g for g, (qs, ps) in PAPER_GROUPS.items() if q_paper in qs and p_paper in ps]


def _leaves(seed: int):
    g = torch.Generator().manual_seed(seed)
    mu = (0.3 * torch.randn(P_WEIGHTS, generator=g, dtype=torch.float64) + 0.5).float().requires_grad_()
    s = (0.5 + 0.5 * torch.rand(P_WEIGHTS, generator=g, dtype=torch.float64)).float().requires_grad_()
    return mu, s


def _interval(c):
    """``(lo, lo_closed, hi)`` of a univariate support constraint, or ``None`` when unknown."""
    from torch.distributions import constraints as C

    while isinstance(c, C.independent):
        c = c.base_constraint
    if isinstance(c, type(C.real)):
        return (-math.inf, False, math.inf)
    if isinstance(c, type(C.positive)) or isinstance(c, C.greater_than):
        return (_lowest(c.lower_bound), False, math.inf)
    if isinstance(c, type(C.nonnegative)) or isinstance(c, C.greater_than_eq):
        return (_lowest(c.lower_bound), True, math.inf)
    if isinstance(c, (C.interval, C.half_open_interval)):
        return (_lowest(c.lower_bound), True, _highest(c.upper_bound))
    return None


def _lowest(v) -> float:
    return float(v.detach().min()) if torch.is_tensor(v) else float(v)


def _highest(v) -> float:
    return float(v.detach().max()) if torch.is_tensor(v) else float(v)


def _support_ok(q, p, seed: int) -> bool:
    """Whether supp q ⊆ supp p up to a null set (else KL(q‖p) = ∞).

    Compared as intervals (an endpoint has probability 0, so open/closed does not matter),
    else on 256 samples.
    """
    try:
        iq, ip = _interval(q.support), _interval(p.support)
    except (NotImplementedError, AttributeError):
        iq = ip = None
    if iq is not None and ip is not None:
        (qlo, _, qhi), (plo, _, phi) = iq, ip
        return qlo >= plo and qhi <= phi
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            w = q.sample((256,))
    try:
        return bool(p.support.check(w).all())
    except (NotImplementedError, AttributeError):
        return True


def _support_name(d) -> str:
    try:
        iv = _interval(d.support)
    except (NotImplementedError, AttributeError):
        iv = None
    if iv is None:
        return "?"
    lo, closed, hi = iv
    return f"{'[' if closed else '('}{lo:.3g}, {hi:.3g})"


def _sum_rightmost(x, n):
    return x.sum(tuple(range(-n, 0))) if n > 0 else x


def classify_cell(q, p) -> dict:
    """Tier and d_P of the KL's integrands (the engine's classifier, nothing typed)."""
    p._validate_args = False
    extra = len(q.event_shape) - len(p.event_shape)
    plans = [("E_q[log p]", mg.explain(lambda w: _sum_rightmost(p.log_prob(w), extra), q))]
    try:
        q.entropy()
        entropy = "closed form"
    except NotImplementedError:
        entropy = "Monte Carlo"
        plans.append(("E_q[log q]", mg.explain(q.log_prob, q)))
    terms = [(which, t) for which, plan in plans for t in plan.terms]
    if not terms:
        return {"tier": "constant", "d_P": 0, "entropy": entropy, "reasons": [], "terms": []}
    tier = max((t.tier.value for _, t in terms), key=_TIER_RANK.__getitem__)
    dps = [t.d_P for _, t in terms]
    reasons = sorted({f"{which}: {t.label}: {t.reason}" for which, t in terms if t.reason})
    return {"tier": tier, "d_P": None if any(d is None for d in dps) else sum(dps), "entropy": entropy,
            "reasons": reasons, "terms": [f"{which}: {t.label} → {t.tier.value} (d_P {t.d_P})" for which, t in terms]}


def measure_cell(make_q, p, seed: int, direct: bool) -> dict:
    """``graph_size`` of the KL at M = 1 and M = 1000 (mcgraph's default method, and direct)."""
    out = {}
    for method in ("auto", "direct") if direct else ("auto",):
        for M in (M_SMALL, M_LARGE):
            mu, s = _leaves(seed)
            q = make_q(mu, s)
            gs = mg.graph_size(lambda: mg.kl_divergence(q, p, M, seed=seed, method=method).sum())
            out[f"{method}_nodes_M{M}"], out[f"{method}_bytes_M{M}"] = gs.nodes, gs.saved_bytes
    out["constant_graph"] = (out[f"auto_nodes_M{M_SMALL}"] == out[f"auto_nodes_M{M_LARGE}"]
                             and out[f"auto_bytes_M{M_SMALL}"] == out[f"auto_bytes_M{M_LARGE}"])
    return out


def build_cells(seed: int, direct: bool) -> tuple[list, list, list, dict]:
    """Every posterior × prior cell (torch's argument validation off: supports are compared explicitly)."""
    before = D.Distribution._validate_args
    D.Distribution.set_default_validate_args(False)
    try:
        return _build_cells(seed, direct)
    finally:
        D.Distribution.set_default_validate_args(before)


def _build_cells(seed: int, direct: bool) -> tuple[list, list, list, dict]:
    qs, q_source = posterior_entries()
    ps, p_source = prior_entries()
    cells = []
    for qe in qs:
        for pe in ps:
            cell = {"posterior": qe.label, "prior": pe.label, "q_paper": qe.paper, "p_paper": pe.paper,
                    "paper_groups": paper_groups_of(qe.paper, pe.paper)}
            if qe.make is None or pe.make is None:
                cell["status"] = "missing"
                cell["reason"] = qe.missing if qe.make is None else pe.missing
                cells.append(cell)
                continue
            try:
                mu, s = _leaves(seed)
                q = qe.make(mu, s)
                p = pe.make(mu.detach())
                if len(p.event_shape) > len(q.event_shape):
                    cell["status"] = "missing"
                    cell["reason"] = (f"p has event shape {tuple(p.event_shape)} (a law of the whole tensor), q "
                                      f"{tuple(q.event_shape)}: KL per q element undefined")
                    cells.append(cell)
                    continue
                if not _support_ok(q, p, seed):
                    cell["status"] = "infinite"
                    cell["reason"] = (f"supp q ({_support_name(q)}) ⊄ supp p ({_support_name(p)}): KL(q‖p) = ∞; "
                                      "tier shown is the integrand's classification only")
                    try:
                        cell.update(classify_cell(q, p))
                    except Exception as e:  # noqa: BLE001 — the KL is infinite anyway
                        cell["tier"] = f"unclassified ({type(e).__name__})"
                    cells.append(cell)
                    continue
                cell.update(classify_cell(q, p))
                cell.update(measure_cell(qe.make, p, seed, direct))
                cell["status"] = "ok"
            except Exception as e:  # noqa: BLE001 — one failing pair is recorded, the table goes on
                cell["status"] = "error"
                cell["reason"] = f"{type(e).__name__}: {str(e)[:200]}"
            cells.append(cell)
    return cells, qs, ps, {"posteriors": q_source, "priors": p_source}


def cell_code(c: dict) -> str:
    mark = "•" if c.get("paper_groups") else ""
    if c["status"] == "missing":
        return mark + "n/a"
    if c["status"] == "error":
        return mark + "error"
    if c["status"] == "infinite":
        return mark + "∞"
    code = _TIER_CODE.get(c["tier"], c["tier"])
    dp = "" if c["d_P"] is None else str(c["d_P"])
    check = "✓" if c.get("constant_graph") else "✗"
    return f"{mark}{code}{dp}{check}"


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Classify and measure every posterior × prior cell; write ``table1.{md,png,json}``."""
    result = TargetResult(NAME, TITLE, quick, seed)
    with timed(result):
        cells, qs, ps, sources = build_cells(seed, direct=not quick)
    result.rows = cells
    result.seeds = [seed]
    result.scale = (f"Every cell: KL(q ‖ p) summed over P = {P_WEIGHTS} weights (float32), "
                    f"`mg.graph_size` at M = {M_SMALL} and M = {M_LARGE}"
                    + ("" if quick else ", also for `method=\"direct\"`")
                    + f". Rows from {sources['posteriors']} (+ the paper's posteriors the registry lacks), "
                    f"columns from {sources['priors']} (+ the paper's priors it lacks). The paper gives no "
                    "d_P per cell, only that every listed cell has d_P independent of M.")
    _compare(result, cells)
    _sections(result, cells, qs, ps)
    if any(c["status"] == "error" for c in cells):
        result.status = f"ok ({sum(c['status'] == 'error' for c in cells)} cells raised; see the list)"
    return write_target(out_dir, result, plot)


def _find(cells, q, p):
    for c in cells:
        if c["posterior"].startswith(q) and c["prior"].startswith(p):
            return c
    return None


def _describe(c: dict | None) -> str:
    if c is None:
        return "not in the table"
    if c["status"] != "ok":
        return f"{c['status']}: {c.get('reason', '')}"
    same = "equal" if c["constant_graph"] else "DIFFERENT"
    return (f"{c['tier']}, d_P = {c['d_P']}; graph at M=1 / M=1000: {c[f'auto_nodes_M{M_SMALL}']} / "
            f"{c[f'auto_nodes_M{M_LARGE}']} nodes, {fmt_bytes(c[f'auto_bytes_M{M_SMALL}'])} / "
            f"{fmt_bytes(c[f'auto_bytes_M{M_LARGE}'])} saved ({same})")


def _compare(result: TargetResult, cells: list) -> None:
    scale = f"P = {P_WEIGHTS}, M = 1 vs 1000"
    listed = [c for c in cells if c["paper_groups"]]
    by = {}
    for c in listed:
        key = c["tier"] if c["status"] == "ok" else c["status"]
        by[key] = by.get(key, 0) + 1
    ok = [c for c in listed if c["status"] == "ok"]
    verified = sum(1 for c in ok if c.get("constant_graph"))
    tiers = ", ".join(f"{k} {v}" for k, v in sorted(by.items()) if k in _TIER_RANK)
    result.compare("paper-listed cells with d_P independent of M", f"all {len(listed)} (by the table's claim)",
                   f"{len(ok)} computable, {verified} of them with a graph equal at M = 1 and 1000 ({tiers}); "
                   f"{by.get('infinite', 0)} with KL = ∞; {by.get('missing', 0)} n/a (no class)",
                   scale, "collapsed = the paper's tuple; fused keeps the graph constant without a polynomial "
                   "tuple (non-polynomial log p, e.g. |w|, or a log-Jacobian the tracer does not simplify); "
                   "chunked = no sampling form or an untraceable op; ∞ = q's support is not inside p's (the KL "
                   "is infinite, so the cell is vacuous); n/a = no distribution class exists")
    for q, p, paper in (("Normal", "normal", "Normal × Normal listed (location-scale group)"),
                        ("Radial", "normal", "Radial × Normal: the paper's experiments (§5)"),
                        ("Normal", "laplace", "Normal × Laplace listed"),
                        ("Exponential", "Gamma", "Exponential × Gamma listed (scaling group)"),
                        ("Exponential", "Log-normal", "Exponential × Log-normal listed"),
                        ("Exponential", "Weibull", "Exponential × Weibull listed"),
                        ("Exponential", "Inverse-Gamma", "Exponential × Inverse-Gamma listed (Thm 1: 1/w, log w)"),
                        ("LogNormal", "Pareto", "Log-Normal × Pareto listed"),
                        ("Horseshoe", "normal", "Horseshoe × Normal listed")):
        c = _find(cells, q, p)
        why = "—"
        if c is not None and c["status"] == "ok" and c["tier"] != "collapsed":
            why = "; ".join(c["reasons"])[:300] or "—"
        elif c is not None and c["status"] != "ok":
            why = c.get("reason", "")
        result.compare(f"{c['posterior'] if c else q} × {c['prior'] if c else p}", paper, _describe(c), scale, why)


def _sections(result: TargetResult, cells: list, qs: list, ps: list) -> None:
    grid = {(c["posterior"], c["prior"]): c for c in cells}
    header = ["posterior \\ prior"] + [p.label for p in ps]
    rows = [[q.label] + [cell_code(grid[(q.label, p.label)]) for p in ps] for q in qs]
    legend = ("Cell code: tier letter (C = collapsed, F = fused, K = chunked), then d_P (summed over the KL's "
              "terms; none for chunked), then ✓ when `graph_size` (nodes and saved bytes) is equal at "
              f"M = {M_SMALL} and M = {M_LARGE}, ✗ when not. • marks a cell the paper's Table 1 lists. "
              "∞: q's samples leave p's support (KL = ∞). n/a: no class exists (reason in the list below).")
    result.section("The generated table", legend + "\n\n" + md_table(header, rows))
    lines = []
    for c in cells:
        if not c["paper_groups"]:
            continue
        direct = ""
        if f"direct_bytes_M{M_LARGE}" in c:
            direct = f"{fmt_bytes(c[f'direct_bytes_M{M_SMALL}'])} → {fmt_bytes(c[f'direct_bytes_M{M_LARGE}'])}"
        graph = ""
        if c["status"] == "ok":
            graph = (f"{c[f'auto_nodes_M{M_SMALL}']}/{c[f'auto_nodes_M{M_LARGE}']} nodes, "
                     f"{fmt_bytes(c[f'auto_bytes_M{M_SMALL}'])}/{fmt_bytes(c[f'auto_bytes_M{M_LARGE}'])}")
        lines.append((c["posterior"], c["prior"], ", ".join(c["paper_groups"]) or "no", c["status"],
                      c.get("tier", ""), c.get("d_P", ""), c.get("entropy", ""), graph, direct,
                      c.get("reason", "") or "; ".join(c.get("reasons", []))[:400]))
    others = {}
    for c in cells:
        if not c["paper_groups"]:
            key = c["tier"] if c["status"] == "ok" else c["status"]
            others[key] = others.get(key, 0) + 1
    result.section("Cells the paper lists",
                   "Cells the paper does not list: " + ", ".join(f"{k} {v}" for k, v in sorted(others.items()))
                   + f" (every cell, with its terms and reasons, is in `{NAME}.json`).\n\n" +
                   md_table(("posterior", "prior", "paper group", "status", "tier", "d_P", "entropy",
                             f"mcgraph graph M={M_SMALL}/{M_LARGE}", f"direct saved bytes M={M_SMALL} → {M_LARGE}",
                             "reason"), lines))


def plot(result: TargetResult, path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    cells = result.rows
    qs = list(dict.fromkeys(c["posterior"] for c in cells))
    ps = list(dict.fromkeys(c["prior"] for c in cells))
    grid = {(c["posterior"], c["prior"]): c for c in cells}
    codes = {"collapsed": 0, "fused": 1, "chunked": 2, "infinite": 3, "missing": 4, "error": 5}
    colors = ["#2b8a3e", "#f08c00", "#c92a2a", "#adb5bd", "#ffffff", "#000000"]
    img = np.zeros((len(qs), len(ps)))
    for i, q in enumerate(qs):
        for j, p in enumerate(ps):
            c = grid[(q, p)]
            img[i, j] = codes[c["tier"] if c["status"] == "ok" else c["status"]]
    from matplotlib.colors import ListedColormap

    fig, ax = plt.subplots(figsize=(1.0 + 0.55 * len(ps), 1.5 + 0.38 * len(qs)))
    ax.imshow(img, cmap=ListedColormap(colors), vmin=-0.5, vmax=5.5, aspect="auto")
    for i, q in enumerate(qs):
        for j, p in enumerate(ps):
            c = grid[(q, p)]
            txt = cell_code(c).replace("•", "")
            ax.text(j, i, txt, ha="center", va="center", fontsize=6,
                    fontweight="bold" if c["paper_groups"] else "normal")
            if c["paper_groups"]:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=1.2, ec="#1c7ed6"))
    ax.set_xticks(range(len(ps)), ps, rotation=70, ha="right", fontsize=7)
    ax.set_yticks(range(len(qs)), qs, fontsize=7)
    ax.set_xlabel("prior p")
    ax.set_ylabel("posterior q")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[v], ec="k", lw=0.3) for v in range(5)]
    ax.legend(handles, ["collapsed", "fused", "chunked", "KL = ∞", "n/a"], loc="upper left",
              bbox_to_anchor=(1.01, 1), fontsize=7)
    ax.set_title("KL(q‖p): tier, d_P, ✓ = graph equal at M=1 and M=1000 (blue box: listed in paper's Table 1)",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


__all__ = ["run", "plot", "classify_cell", "measure_cell", "posterior_entries", "prior_entries", "PAPER_GROUPS"]

