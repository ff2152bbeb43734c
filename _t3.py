import torch, mcgraph as mg, math, time, os
from torch.distributions import Normal
from mcgraph.distributions import ScaleMixtureNormal
from mcgraph.estimators import fused_body
torch.set_num_threads(1)
os.environ["MCGRAPH_FUSED_COMPILE"] = "always"
pr = ScaleMixtureNormal(torch.tensor(0.5), torch.tensor(1.0), torch.tensor(math.exp(-6)))
L0 = torch.randn(16384) * 0.1; R0 = torch.full((16384,), math.log(math.expm1(0.05)))
def run(M=1000):
    loc = L0.clone().requires_grad_(); rho = R0.clone().requires_grad_()
    q = Normal(loc, torch.nn.functional.softplus(rho))
    y = mg.kl_divergence(q, pr, M, seed=3, method="fused").sum()
    y.backward()
run()
spec = next(iter(k for k, v in fused_body._COMPILED.items() if v is not None))
fn = fused_body._COMPILED[spec]
from mcgraph.estimators.derivatives import lower
block = torch.randn(1000, 16384)
import mcgraph.integrands as I
loc = L0; scale = torch.full((16384,), 0.05)
# tensors: rebuild by tracing
plan = mg.explain(pr.log_prob, Normal(loc, scale))
low = lower(plan.terms[0].node)
tensors = tuple(t.detach() for t in low.tensors)
def body(rows):
    for s in range(0, 1000, rows):
        xi = block[s:s+rows]; torch._dynamo.mark_dynamic(xi, 0)
        fn(xi, loc, scale, *tensors)
def best(f, r=5):
    b = 1e9
    for _ in range(r):
        t0 = time.perf_counter(); f(); b = min(b, time.perf_counter() - t0)
    return b
for rep in range(2):
    print(os.getloadavg()[0], "randn", best(lambda: torch.randn(1000, 16384)), "body64", best(lambda: body(64)),
          "body16", best(lambda: body(16)), "body4", best(lambda: body(4)), "call", best(run), "call M=1", best(lambda: run(1)))
