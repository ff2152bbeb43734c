"""Bayesian layers, ``bayesify``, many-sample likelihood, prediction and the ELBO.

>>> import torch, mcgraph as mg
>>> bnn = mg.nn.bayesify(mg.models.get_model("lenet5"), posterior="radial", prior="normal", kl_samples=1000)
>>> x, y = torch.zeros(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
>>> loss = -mg.nn.elbo(bnn, x, y, num_samples=4, dataset_size=60_000, seed=0)   # KL via mg.nn.kl(bnn)
>>> loss.backward()

Layers return only their output; the KL is collected by :func:`kl`. Noise is
functional (fresh per forward, seeded inside sample runs), never kept in buffers.
"""

from .context import SampleRun, bayesian_modules, sample_run
from .bayesify import bayesify, freeze, frozen, last_layer, set_mode, unfreeze
from .network_kl import kl
from .variational import (KL_SCHEDULES, BlundellKL, ConstantKL, ELBOTerms, KLSchedule, LinearWarmupKL, WholeNetworkMC,
                   default_chunk, elbo, elbo_terms, expected_data_term, kl_schedule)
from .layers import (BayesConv, BayesConv1d, BayesConv2d, BayesConv3d, BayesConvTranspose, BayesConvTranspose1d,
                     BayesConvTranspose2d, BayesConvTranspose3d, BayesLayer, BayesLinear, SampleMode)
from .likelihood import (LIKELIHOODS, SoftmaxCrossEntropyMC, expected_log_likelihood, log_likelihood,
                         softmax_cross_entropy_mc, token_log_likelihood)
from .estimator import Estimator
from .prediction import Prediction, can_vectorize, forward_samples, predict
from .priors import POSTERIORS, PRIORS, layer_options, make_prior, register_posterior, register_prior
from .layer_kl import LAYER_KL, divergence, find_layer_kl, register_layer_kl
from . import sparse_vd
from .sparse_vd import SparseVD, SparseVDNormal
from .ard import ARDPrior, ard_kl, ard_precision
from .pruning import LayerSparsity, SparsityReport, layer_log_alpha, prune, prune_l1, sparsity
from .mc_dropout import MCDropout, MCDropoutRNN, mc_dropout
from .recurrent import BayesGRU, BayesLSTM, BayesRNN, BayesRNNBase
from .embedding import BayesEmbedding
from .attention import BayesMultiheadAttention
from .lora import AdapterDropout, BayesLoRA, bayesian_lora
from .scales import SCALE_TRANSFORMS, ScaleTransform, register_scale_transform, scale_transform, softplus_beta

__all__ = [
    "BayesConv", "BayesConv1d", "BayesConv2d", "BayesConv3d", "BayesConvTranspose", "BayesConvTranspose1d",
    "BayesConvTranspose2d", "BayesConvTranspose3d", "BayesLayer", "BayesLinear", "BlundellKL", "ConstantKL", "Estimator",
    "ELBOTerms", "KLSchedule", "KL_SCHEDULES", "LIKELIHOODS", "LinearWarmupKL", "POSTERIORS", "PRIORS",
    "Prediction", "SampleMode", "SampleRun", "SoftmaxCrossEntropyMC", "WholeNetworkMC", "bayesian_modules",
    "bayesify", "last_layer", "can_vectorize", "default_chunk", "elbo", "elbo_terms", "expected_data_term",
    "expected_log_likelihood",
    "forward_samples", "freeze", "frozen", "kl", "kl_schedule", "log_likelihood", "make_prior", "predict",
    "register_posterior", "register_prior", "register_scale_transform", "sample_run", "scale_transform",
    "set_mode", "softmax_cross_entropy_mc", "softplus_beta", "unfreeze", "SCALE_TRANSFORMS", "ScaleTransform",
    "layer_options", "LAYER_KL", "divergence", "find_layer_kl", "register_layer_kl", "sparse_vd", "SparseVD",
    "SparseVDNormal", "ARDPrior", "ard_kl", "ard_precision", "LayerSparsity", "SparsityReport", "layer_log_alpha",
    "prune", "prune_l1", "sparsity", "MCDropout", "MCDropoutRNN", "mc_dropout", "BayesLSTM", "BayesGRU", "BayesRNN",
    "BayesRNNBase", "BayesEmbedding", "BayesMultiheadAttention", "BayesLoRA", "AdapterDropout", "bayesian_lora",
    "token_log_likelihood",
]
