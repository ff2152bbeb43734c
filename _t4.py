import torch, mcgraph as mg, math, os
from torch.distributions import Normal
from mcgraph.distributions import ScaleMixtureNormal
os.environ["MCGRAPH_FUSED_COMPILE"] = "always"
pr = ScaleMixtureNormal(torch.tensor(0.5), torch.tensor(1.0), torch.tensor(math.exp(-6)))
loc = (torch.randn(4096) * 0.1).requires_grad_(); s = torch.full((4096,), 0.05, requires_grad=True)
mg.kl_divergence(Normal(loc, s), pr, 100, seed=3, method="fused").sum().backward()
