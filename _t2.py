import torch, mcgraph as mg, math, time, os
from torch.distributions import Normal, Laplace
from mcgraph.distributions import ScaleMixtureNormal
from mcgraph.estimators import fused_body
torch.set_num_threads(1)
pr = ScaleMixtureNormal(torch.tensor(0.5), torch.tensor(1.0), torch.tensor(math.exp(-6)))
L0 = torch.randn(16384) * 0.1; R0 = torch.full((16384,), math.log(math.expm1(0.05)))
def run(mode, M=1000, prior=pr):
    os.environ["MCGRAPH_FUSED_COMPILE"] = mode
    loc = L0.clone().requires_grad_(); rho = R0.clone().requires_grad_()
    q = Normal(loc, torch.nn.functional.softplus(rho))
    y = mg.kl_divergence(q, prior, M, seed=3, method="fused").sum()
    y.backward()
    return y.detach(), loc.grad, rho.grad, fused_body.last_path()
t0 = time.time(); c = run("always"); print("first compiled call", time.time() - t0, c[3])
t0 = time.time(); c = run("always", M=999); print("2nd compiled call (M=999)", time.time() - t0, c[3])
e = run("never"); a = run("auto")
print(e[3], a[3], [float((x - y).abs().max()) for x, y in zip(c[:3], e[:3])], float(e[0]))
def best(f, r=5):
    b = 1e9
    for _ in range(r):
        t0 = time.perf_counter(); f(); b = min(b, time.perf_counter() - t0)
    return b
from mcgraph.bench.workloads import randn_floor
for rep in range(2):
    print(os.getloadavg()[0], "randn", best(lambda: randn_floor(16384, 1000)), "compiled", best(lambda: run("always")),
          "eager", best(lambda: run("never")))
