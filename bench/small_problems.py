"""Small problems: the fixed cost of one call, side by side with what a user writes by hand in torch.

Rows (forward + backward, median of ``--reps`` interleaved repeats in one process):

* ``kl``: ``mg.kl_divergence(q, p, 1000)`` with Normal q of P ∈ {5, 100, 10⁴} weights against the
  hand-written vectorised estimate ``-q.entropy() - p.log_prob(q.rsample((M,))).mean(0)``
  (target ≤ 1.5× at every P):

  - scale-mixture prior (π = ½, σ₁ = 1, σ₂ = 0.002): no closed form, ``"auto"`` samples;
  - Laplace prior, ``method="monte-carlo"`` (the sampled estimate the target is about);
  - Laplace prior, ``"auto"``: torch has a Normal ‖ Laplace closed form, which ``"auto"`` takes
    (shown for information: it is exact, the hand-written estimate is not).

* ``expectation``: ``mg.expectation(fn, q, 1000)`` against ``fn(q.rsample((M,))).mean(0)`` for a
  polynomial ``fn`` (collapsed tier) and ``|w|`` (fused tier); no target is stated for it, the KL's
  1.5× is printed beside it.
* ``elbo``: one M = 1 training step (zero_grad, loss, backward, Adam step) of a ``bayesify``'d MLP
  20-50-50-10 (two hidden layers of width 50, Normal prior, batch 32) with ``mg.nn.elbo`` against a
  bayesian-torch model of the same shape (``dnn_to_bnn``, its loop: cross-entropy + ``get_kl_loss``
  / N); target ≤ 1.2×.
* ``pyro``: one SVI step of a Pyro model with 20 latent sites of 5 weights: Student-t prior under
  ``mcgraph.interop.pyro.MeanFieldELBO(kl_samples=100)`` against the same model with a Normal prior
  under Pyro's ``TraceMeanField_ELBO`` (closed form); target ≤ 2×.

The machine may be shared with other jobs: every ratio is measured side by side in one run
(the two providers alternate, repeat by repeat), and by default on the calling thread's CPU clock
(one torch thread), so time spent descheduled is not counted.

``--device cuda`` puts every tensor, model and prior parameter on the GPU; the clock is then the wall clock
with the device synchronised at each reading (the fixed cost of a call there is its launches).

Usage::

    python -m bench.small_problems [--reps 200] [--threads 1] [--json out.json]
    python -m bench.small_problems --device cuda --rows kl expectation elbo
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch
import torch.distributions as D
import torch.nn.functional as F

import mcgraph as mg
from mcgraph.apps.training_run import mlp

M = 1000
PS = (5, 100, 10_000)


#: The clock: ``time.thread_time`` (CPU seconds of this thread, user + system: page faults count)
#: by default, so that a call descheduled by other jobs on a shared machine is not charged for
#: the wait (one torch thread: the forward and the CPU backward run on the calling thread);
#: ``--clock wall`` for ``time.perf_counter``.
CLOCK = time.thread_time
#: Where the tensors, models and priors live (``--device``).
DEVICE = torch.device("cpu")


def synchronized_wall() -> float:
    """``time.perf_counter`` after the CUDA device has finished its queued work (the clock of ``--device cuda``)."""
    torch.cuda.synchronize(DEVICE)
    return time.perf_counter()


def _p(*values):
    """Distribution parameters: the floats themselves on the CPU (as the rows were measured), tensors on the device
    elsewhere."""
    return values if DEVICE.type == "cpu" else tuple(torch.tensor(values, device=DEVICE))


def _interleave(a, b, reps: int, warmup: int = 10) -> tuple[float, float]:
    """Median seconds of ``a()`` and ``b()``, alternated (order flipped every repeat)."""
    for _ in range(warmup):
        a(), b()
    ta, tb = [], []
    for i in range(reps):
        for f, out in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            t0 = CLOCK()
            f()
            out.append(CLOCK() - t0)
    return statistics.median(ta), statistics.median(tb)


def _reps(P: int, reps: int) -> tuple[int, int]:
    """(repeats, warm-up calls): fewer at P = 10⁴, where one hand-written call is 10⁷ elements."""
    return (reps, 10) if P < 10_000 else (max(5, reps // 6), 2)


def _posterior(P: int):
    g = torch.Generator().manual_seed(0)
    mu = (0.1 * torch.randn(P, generator=g)).to(DEVICE).requires_grad_()
    rho = torch.full((P,), -3.0, device=DEVICE).requires_grad_()
    return mu, rho


def kl_rows(reps: int) -> list[dict]:
    rows = []
    priors = {"scale-mixture": (lambda: mg.distributions.ScaleMixtureNormal(*_p(0.5, 1.0, 0.002)), "auto"),
              "laplace (monte-carlo)": (lambda: D.Laplace(*_p(0.0, 1.0)), "monte-carlo"),
              "laplace (auto: closed form)": (lambda: D.Laplace(*_p(0.0, 1.0)), "auto")}
    for P in PS:
        mu, rho = _posterior(P)
        for name, (make_p, method) in priors.items():
            p = make_p()

            def ours():
                q = D.Normal(mu, F.softplus(rho))
                mg.kl_divergence(q, p, M, method=method).sum().backward()

            def torch_mc():
                q = D.Normal(mu, F.softplus(rho))
                (-q.entropy() - p.log_prob(q.rsample((M,))).mean(0)).sum().backward()

            a, b = _interleave(ours, torch_mc, *_reps(P, reps))
            rows.append({"row": "kl", "case": f"{name}, P={P}", "mcgraph_us": a * 1e6, "torch_us": b * 1e6,
                         "ratio": a / b, "target": 1.5 if "closed form" not in name else None})
    return rows


def expectation_rows(reps: int) -> list[dict]:
    rows = []
    fns = {"(w - 1)^2 (collapsed)": lambda w: (w - 1.0) ** 2, "|w| (fused)": torch.abs}
    for P in PS:
        mu, rho = _posterior(P)
        for name, fn in fns.items():
            def ours():
                q = D.Normal(mu, F.softplus(rho))
                mg.expectation(fn, q, M).sum().backward()

            def torch_mc():
                q = D.Normal(mu, F.softplus(rho))
                fn(q.rsample((M,))).mean(0).sum().backward()

            a, b = _interleave(ours, torch_mc, *_reps(P, reps))
            rows.append({"row": "expectation", "case": f"{name}, P={P}", "mcgraph_us": a * 1e6,
                         "torch_us": b * 1e6, "ratio": a / b, "target": 1.5})
    return rows


SIZES = (20, 50, 50, 10)
BATCH, DATASET = 32, 1000


def _mlp():
    torch.manual_seed(0)
    return mlp(SIZES[-1], SIZES[0], SIZES[1:-1], flatten=False)


def elbo_rows(reps: int) -> list[dict]:
    from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn, get_kl_loss

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (BATCH,), generator=g)
    x, y = x.to(DEVICE), y.to(DEVICE)
    ours_net = mg.nn.bayesify(_mlp(), posterior="normal", prior="normal", rho_init=-3.0).to(DEVICE)
    peer = _mlp()
    dnn_to_bnn(peer, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": -3.0,
                      "type": "Reparameterization", "moped_enable": False})
    peer = peer.to(DEVICE)
    opt_a = torch.optim.Adam(ours_net.parameters(), lr=1e-3)
    opt_b = torch.optim.Adam(peer.parameters(), lr=1e-3)

    def ours():
        opt_a.zero_grad(set_to_none=True)
        (-mg.nn.elbo(ours_net, x, y, num_samples=1, dataset_size=DATASET)).backward()
        opt_a.step()

    def bayesian_torch():
        opt_b.zero_grad(set_to_none=True)
        (F.cross_entropy(peer(x), y) + get_kl_loss(peer) / DATASET).backward()
        opt_b.step()

    a, b = _interleave(ours, bayesian_torch, reps)
    return [{"row": "elbo", "case": "M=1 step, MLP 20-50-50-10, batch 32", "mcgraph_us": a * 1e6,
             "torch_us": b * 1e6, "ratio": a / b, "target": 1.2, "peer": "bayesian-torch"}]


def pyro_rows(reps: int) -> list[dict]:
    import pyro
    import pyro.distributions as dist
    from pyro.infer import SVI, TraceMeanField_ELBO
    from pyro.infer.autoguide import AutoNormal

    from mcgraph.interop.pyro import MeanFieldELBO

    sites, width = 20, 5
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, width, generator=g).to(DEVICE), torch.randn(16, generator=g).to(DEVICE)

    def model_of(prior, tag):
        def model(x, y):
            out = 0.0
            for s in range(sites):
                w = pyro.sample(f"{tag}{s}", prior().expand([width]).to_event(1))
                out = out + x @ w
            pyro.sample(f"{tag}y", dist.Normal(out, *_p(1.0)).to_event(1), obs=y)
        return model

    def svi_of(prior, loss, tag):  # site names apart: both models share Pyro's global param store
        model = model_of(prior, tag)
        guide = AutoNormal(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss=loss)
        svi.step(x, y)
        return lambda: svi.step(x, y)

    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = svi_of(lambda: dist.StudentT(*_p(3.0, 0.0, 1.0)), MeanFieldELBO(kl_samples=100), "t")
        theirs = svi_of(lambda: dist.Normal(*_p(0.0, 1.0)), TraceMeanField_ELBO(), "n")
        a, b = _interleave(ours, theirs, max(20, reps // 4))
    return [{"row": "pyro", "case": "20 sites x 5 weights, Student-t (MeanFieldELBO, M=100) vs Normal "
             "(TraceMeanField_ELBO)", "mcgraph_us": a * 1e6, "torch_us": b * 1e6, "ratio": a / b, "target": 2.0,
             "peer": "pyro"}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", nargs="+", default=["kl", "expectation", "elbo", "pyro"],
                    choices=["kl", "expectation", "elbo", "pyro"])
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: this thread's CPU time (default; needs --threads 1), wall: perf_counter")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where tensors, models and priors live (cuda: the synchronised wall clock)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    global CLOCK, DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    if DEVICE.type == "cuda":
        CLOCK = synchronized_wall
    elif args.clock == "wall" or args.threads != 1:
        CLOCK = time.perf_counter
    torch.set_num_threads(args.threads)
    makers = {"kl": kl_rows, "expectation": expectation_rows, "elbo": elbo_rows, "pyro": pyro_rows}
    rows = []
    print(f"{'row':12s} {'case':62s} {'mcgraph':>11s} {'reference':>11s} {'ratio':>7s} {'target':>8s}")
    for name in args.rows:
        try:
            new = makers[name](args.reps)
        except ImportError as e:  # a peer library is missing
            print(f"{name:12s} skipped: {e}")
            continue
        for r in new:
            target = f"<= {r['target']}x" if r["target"] else "(exact)"
            print(f"{r['row']:12s} {r['case']:62s} {r['mcgraph_us']:9.0f}us {r['torch_us']:9.0f}us "
                  f"{r['ratio']:6.2f}x {target:>8s}", flush=True)
        rows += new
    if args.json:
        meta = {"threads": args.threads, "reps": args.reps, "clock": CLOCK.__name__, "torch": torch.__version__,
                **({} if DEVICE.type == "cpu" else {"device": DEVICE.type})}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
