"""Optimizers whose result is a posterior: VOGN, IVON, adaptive VB (and its SGHMC form), EM spike-and-slab pruning.

Every variational optimizer here takes the network itself (not ``model.parameters()``)
and trains its plain layers; the learned posterior is exposed as torch distributions
(``optimizer.posterior``) and as a model that :func:`mcgraph.nn.predict` and the
metrics take unchanged (``optimizer.posterior_model()``). The SGHMC form's posterior is
a :class:`SnapshotEnsemble`, which :func:`mcgraph.nn.predict` also takes.

=============================== ==========================================================
:class:`VOGN`                   natural-gradient VI (seed 003, Algorithm 1)
:class:`IVON`                   improved variational online Newton (Shen et al., 2024), Adam's cost
:class:`AdaptiveVB`             adaptive VB, α ∈ {½, 1} (seed 004, §2.2)
:class:`AdaptiveSGHMC`          its memory-lean SGHMC form (the seed's released code)
:class:`CyclicalCosineLR`       the cyclical cosine schedule; :class:`SnapshotEnsemble`
:class:`SpikeSlabEM`            group spike-and-slab EM and one-shot pruning (seed 004)
:func:`shrink`                  the physically smaller network; :func:`count_compute`
:class:`SquaredGradients`       per-example squared gradients in one backward
=============================== ==========================================================
"""

from .adaptive_vb import AdaptiveVB
from .gaussian import GaussianVariationalOptimizer, posterior_model
from .ivon import IVON, HessApprox
from .choices import ConvGroups, Curvature, EStep, HardStatistic, LinearGroups, LossReduction, Parallel, PruneConv
from .per_example import SquaredGradients, register_rule
from .schedules import CyclicalCosineLR
from .sghmc import AdaptiveSGHMC
from .shrink import SelectFeatures, count_compute, shrink
from .snapshots import SnapshotEnsemble
from .spike_slab import GroupSpec, SpikeSlabEM, register_groups
from .vogn import VOGN, VOGNVariant

__all__ = ["AdaptiveSGHMC", "AdaptiveVB", "ConvGroups", "Curvature", "CyclicalCosineLR", "EStep",
           "GaussianVariationalOptimizer", "GroupSpec", "HardStatistic", "HessApprox", "IVON", "LinearGroups",
           "LossReduction", "Parallel", "PruneConv", "SelectFeatures", "SnapshotEnsemble", "SpikeSlabEM", "SquaredGradients", "VOGN", "VOGNVariant",
           "count_compute", "posterior_model", "register_groups", "register_rule", "shrink"]
