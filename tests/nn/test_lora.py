"""Variational LoRA (``mg.nn.bayesian_lora``), last-layer Bayesian networks (``mg.nn.last_layer``) and
``bayesify(only=...)`` freezing the rest, on torch models and on a GPT-2 built from a tiny config."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributions import Normal, kl_divergence
from torch.func import functional_call

import mcgraph as mg
from mcgraph.engine.plan.families import family_of
from mcgraph.nn import BayesLoRA
from mcgraph.nn.context import NoiseKind, sample_run
from support.tiny_lm import NextToken, tiny_gpt2


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed (make interop installs it)")


def _gpt2(seed=0, dtype=torch.float64):
    return tiny_gpt2(seed, dtype)


def _mlp(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def _randomise_b(model, scale=0.3, seed=1):
    """B = 0 at initialisation makes the gradient of A zero: tests of A's gradients move B first."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BayesLoRA):
                b = m.lora_B.weight
                b.copy_(scale * torch.randn(b.shape, generator=g, dtype=b.dtype))


def _adapters(model):
    return [m for m in model.modules() if isinstance(m, BayesLoRA)]


# --------------------------------------------------------------------------------- the pretrained model intact

def test_default_targets_are_every_linear_and_conv1d_and_the_output_at_init_is_the_base_output():
    gpt = _gpt2()
    lora = mg.nn.bayesian_lora(gpt, rank=4, alpha=8.0, posterior="laplace", prior="normal")
    names = [n for n, m in lora.named_modules() if isinstance(m, BayesLoRA)]
    assert names == [f"transformer.h.{i}.{p}" for i in range(2) for p in
                     ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")] + ["lm_head"]
    ids = torch.randint(0, 50, (3, 6), generator=torch.Generator().manual_seed(0))
    base = gpt(ids).logits
    assert torch.equal(lora(ids).logits, base)  # B = 0: every weight sample of ΔW is 0, float64 bitwise
    one_at_a_time = mg.nn.forward_samples(NextToken(lora), ids, 5, seed=0, chunk_size=1)
    assert torch.equal(one_at_a_time, base[:, -1].expand(5, -1, -1))
    together = mg.nn.forward_samples(NextToken(lora), ids, 5, seed=0, chunk_size=5)  # the batch repeated 5 times
    assert torch.equal(together, gpt(ids.repeat(5, 1)).logits[:, -1].reshape(5, 3, -1))
    with mg.nn.frozen(lora):
        assert torch.equal(lora(ids).logits, base)


def test_only_adapters_train_and_pretrained_weights_are_bitwise_unchanged_after_10_steps():
    gpt = _gpt2()
    lora = NextToken(mg.nn.bayesian_lora(gpt, rank=2, kl_samples=4))
    frozen = {n: p.detach().clone() for n, p in lora.named_parameters() if not p.requires_grad}
    trainable = sorted(n for n, p in lora.named_parameters() if p.requires_grad)
    assert trainable and all(n.rsplit(".", 2)[-2:] in (["lora_A", "weight_mu"], ["lora_A", "weight_rho"],
                                                       ["lora_B", "weight"]) for n in trainable), trainable
    assert len(frozen) == len(list(gpt.parameters()))  # every pretrained Parameter
    ids = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(1))
    y = torch.tensor([1, 2, 3, 4])
    opt = torch.optim.Adam([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    before = lora(ids).detach()
    for step in range(10):
        opt.zero_grad()
        loss = -mg.nn.elbo(lora, ids, y, num_samples=mg.Sampling(3, chunk_size=2), dataset_size=100, seed=step)
        loss.backward()
        opt.step()
    for n, p in lora.named_parameters():
        if n in frozen:
            assert p.grad is None and not p.requires_grad, n
            assert torch.equal(p, frozen[n]), n
        else:
            assert p.grad is not None, n
    with mg.nn.frozen(lora):
        assert not torch.allclose(lora(ids), before)  # the adapters did move the function
    for m in _adapters(lora):
        assert m.lora_B.weight.abs().sum() > 0


def test_kl_is_the_adapters_only_against_torch_closed_form():
    lora = mg.nn.bayesian_lora(_gpt2(), rank=3, rho_init=-2.0, prior=Normal(0.0, 0.5))
    sites = mg.nn.bayesian_modules(lora)
    assert len(sites) == 9 and all(isinstance(s, mg.nn.BayesLinear) for s in sites)
    expected = sum(kl_divergence(s.posterior, Normal(torch.zeros((), dtype=torch.float64), 0.5)).sum() for s in sites)
    torch.testing.assert_close(mg.nn.kl(lora, seed=0), expected, rtol=1e-12, atol=1e-12)


def test_conv1d_layout_delta_weight_and_mean_forward():
    _transformers()
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(7, 5).double()  # nf = 7 out, nx = 5 in: weight (5, 7)
    with torch.no_grad():
        conv.bias.normal_()
    lora = mg.nn.bayesian_lora(conv, rank=3, alpha=6.0)
    assert isinstance(lora, BayesLoRA) and (lora.in_features, lora.out_features, lora.scaling) == (5, 7, 2.0)
    assert lora.lora_A.weight_mu.shape == (3, 5) and lora.lora_B.weight.shape == (7, 3)
    _randomise_b(lora)
    x = torch.randn(4, 2, 5, dtype=torch.float64)
    with mg.nn.frozen(lora):
        out = lora(x)
    ref = x @ (conv.weight + lora.delta_weight()) + conv.bias
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert lora.delta_weight().shape == conv.weight.shape


# --------------------------------------------------------------------------------- ELBO, graph, prediction

def _merged_params(lm, model, samples, i):
    """The pretrained model's weights with adapter sample ``i`` merged in: W0 + s·B A_i (Conv1D: transposed)."""
    params = {}
    for name, m in model.named_modules():
        if isinstance(m, BayesLoRA):
            key = name.removeprefix("lm.") + ".weight"
            delta = m.scaling * m.lora_B.weight @ samples[name][i]
            params[key] = m.base_layer.weight + (delta.T if mg.nn.lora.is_conv1d(m.base_layer) else delta)
    return params


def test_elbo_gradients_match_a_per_sample_merged_weight_reference_float64():
    """The chunked ELBO on the adapted GPT-2 against plain autograd through the pretrained model run with
    merged weights W0 + (α/r) B A_i, one per sample, on the same noise; the KL from torch's closed form
    (the strict ELBO: prior N(0, 1) on every variational parameter, ``prior_on="all"``)."""
    gpt = _gpt2()
    model = NextToken(mg.nn.bayesian_lora(gpt, rank=2, alpha=3.0, rho_init=-1.5, prior="normal", prior_on="all"))
    _randomise_b(model)
    ids = torch.randint(0, 50, (3, 6), generator=torch.Generator().manual_seed(2))
    y = torch.tensor([5, 7, 11])
    M, N, seed = 5, 40, 3
    value = mg.nn.elbo(model, ids, y, num_samples=mg.Sampling(M, chunk_size=2), dataset_size=N, seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(value, params)

    run = sample_run(model, M, seed=seed)
    samples = {}
    for name, m in model.named_modules():
        if isinstance(m, BayesLoRA):
            form = family_of(m.lora_A.posterior)
            samples[name] = form.sample(run.form_rows(m.lora_A, NoiseKind.WEIGHT, form, 0, M))  # (M, r, in)
    ll = 0
    for i in range(M):
        merged = _merged_params(gpt, model, samples, i)  # lm_head is tied to wte: replace lm_head only
        logits = functional_call(gpt, merged, (ids,), tie_weights=False).logits[:, -1]
        ll = ll + torch.distributions.Categorical(logits=logits).log_prob(y).mean()
    prior = Normal(torch.zeros((), dtype=torch.float64), 1.0)
    kl = sum(kl_divergence(s.posterior, prior).sum() for s in mg.nn.bayesian_modules(model))
    ref = ll / M - kl / N
    torch.testing.assert_close(value, ref, rtol=1e-10, atol=1e-12)
    for p, g, r in zip(params, grads, torch.autograd.grad(ref, params), strict=True):
        assert r.abs().sum() > 0
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-10)


def test_elbo_graph_bytes_flat_in_num_samples():
    model = NextToken(mg.nn.bayesian_lora(_gpt2(dtype=torch.float32), rank=2, kl_samples=8))
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    y = torch.tensor([1, 2])

    def size(M):
        return mg.graph_size(lambda: mg.nn.elbo(model, ids, y, num_samples=M, dataset_size=100, seed=0)).saved_bytes

    a, b = size(2), size(64)
    assert abs(b - a) <= 0.05 * a, (a, b)


def test_predict_stderr_and_chunking_on_an_adapted_model():
    model = mg.nn.bayesian_lora(_mlp(), rank=2, rho_init=-1.0)
    _randomise_b(model, scale=1.0)
    x = torch.randn(5, 6, dtype=torch.float64)
    probs = mg.nn.predict(model, x, 32, chunk_size=5, seed=0)
    ref = torch.softmax(mg.nn.forward_samples(model, x, 32, seed=0), -1).mean(0)
    torch.testing.assert_close(probs, ref, rtol=1e-12, atol=1e-14)
    y = torch.tensor([0, 1, 2, 0, 1])
    a = mg.nn.elbo(model, x, y, num_samples=mg.Sampling(8, chunk_size=3), dataset_size=50, seed=4)
    b = mg.nn.elbo(model, x, y, num_samples=mg.Sampling(8, method="direct"), dataset_size=50, seed=4)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    terms = mg.nn.elbo_terms(model, x, y, num_samples=8, dataset_size=50, kl_samples=4, seed=4, return_stderr=True)
    assert terms.log_likelihood_stderr > 0 and torch.isfinite(terms.elbo_stderr)


def test_lora_dropout_is_replayed_by_the_chunked_elbo_and_off_in_eval():
    model = mg.nn.bayesian_lora(_mlp(), rank=2, dropout=0.3).train()
    _randomise_b(model, scale=1.0)
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    a = mg.nn.elbo(model, x, y, num_samples=mg.Sampling(6, chunk_size=4), dataset_size=50, seed=1)
    b = mg.nn.elbo(model, x, y, num_samples=mg.Sampling(6, method="direct"), dataset_size=50, seed=1)
    params = [p for p in model.parameters() if p.requires_grad]
    for u, v in zip(torch.autograd.grad(a, params), torch.autograd.grad(b, params), strict=True):
        torch.testing.assert_close(u, v)
    with mg.nn.frozen(model):
        train_out = model(x)
        assert not torch.equal(train_out, model(x))  # dropout draws fresh masks in train()
        model.eval()
        assert torch.equal(model(x), model(x))


def test_variational_both_has_two_sites_per_adapter_and_sample_noise_at_init():
    net = _mlp()
    lora = mg.nn.bayesian_lora(net, rank=2, variational="both", targets=["0", "4"])
    assert len(mg.nn.bayesian_modules(lora)) == 4
    x = torch.randn(3, 6, dtype=torch.float64)
    with mg.nn.frozen(lora):
        assert torch.equal(lora(x), net(x))  # mean of B is 0
    assert not torch.equal(lora(x), net(x))  # a sample of B is not
    b_only = mg.nn.bayesian_lora(net, rank=2, variational="B", targets="2")
    assert isinstance(b_only[2].lora_B, mg.nn.BayesLinear) and isinstance(b_only[2].lora_A, nn.Linear)


def test_sparsification_tools_reach_the_adapters():
    lora = mg.nn.bayesian_lora(_mlp(), rank=2, posterior="sparse_vd")
    assert lora[0].lora_A.local_reparameterization  # the family's defaults
    report = mg.nn.prune(lora, threshold=-float("inf"))
    assert report.total == 2 * (6 + 16 + 16) and report.kept == 0
    x = torch.randn(3, 6, dtype=torch.float64)
    assert torch.equal(lora(x), _mlp()(x))  # every A weight pruned: ΔW = 0 again
    assert mg.nn.prune_l1(mg.nn.bayesian_lora(_mlp(), rank=2), fraction=0.25).sparsity == pytest.approx(0.25, abs=0.02)


def test_targets_select_names_patterns_and_types_and_trainable_keeps_modules_trainable():
    gpt = _gpt2()
    by_pattern = mg.nn.bayesian_lora(gpt, rank=2, targets="transformer.h.*.attn")
    assert sorted(n for n, m in by_pattern.named_modules() if isinstance(m, BayesLoRA)) == [
        f"transformer.h.{i}.attn.{p}" for i in range(2) for p in ("c_attn", "c_proj")]
    by_type = mg.nn.bayesian_lora(gpt, rank=2, targets=nn.Linear, trainable="transformer.ln_f")
    assert [n for n, m in by_type.named_modules() if isinstance(m, BayesLoRA)] == ["lm_head"]
    assert by_type.transformer.ln_f.weight.requires_grad and not by_type.transformer.wpe.weight.requires_grad
    mha = nn.Sequential(nn.Linear(4, 8))
    mha.add_module("attn", nn.MultiheadAttention(8, 2))
    assert [n for n, m in mg.nn.bayesian_lora(mha, 2).named_modules() if isinstance(m, BayesLoRA)] == ["0"]
    assert isinstance(gpt.lm_head, nn.Linear)  # a copy was adapted
    same = mg.nn.bayesian_lora(gpt, rank=2, targets="lm_head", inplace=True)
    assert same is gpt and isinstance(gpt.lm_head, BayesLoRA)


def test_bad_arguments_name_them():
    net = _mlp()
    with pytest.raises(ValueError, match="rank must be >= 1"):
        mg.nn.bayesian_lora(net, 0)
    with pytest.raises(TypeError, match="rank"):
        mg.nn.bayesian_lora(net, 2.0)
    with pytest.raises(ValueError, match=r"rank=4 is larger than the layer '4'.*min\(16, 3\) = 3"):
        mg.nn.bayesian_lora(net, 4)
    mg.nn.bayesian_lora(net, 4, targets=["0", "2"])  # fine once the narrow head is left out
    with pytest.raises(ValueError, match="targets: no modules named"):
        mg.nn.bayesian_lora(net, 2, targets="encoder")
    with pytest.raises(ValueError, match="targets: the pattern"):
        mg.nn.bayesian_lora(net, 2, targets="h.*")
    with pytest.raises(ValueError, match="targets: .* selects no nn.Linear"):
        mg.nn.bayesian_lora(net, 2, targets=nn.Tanh)
    with pytest.raises(TypeError, match="targets"):
        mg.nn.bayesian_lora(net, 2, targets=[3])
    with pytest.raises(ValueError, match="model: .* has no nn.Linear"):
        mg.nn.bayesian_lora(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), 1)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        mg.nn.bayesian_lora("gpt2", 2)
    with pytest.raises(ValueError, match="alpha"):
        mg.nn.bayesian_lora(net, 2, alpha=0.0)
    with pytest.raises(ValueError, match="dropout"):
        mg.nn.bayesian_lora(net, 2, dropout=1.0)
    with pytest.raises(ValueError, match="variational"):
        mg.nn.bayesian_lora(net, 2, variational="C")
    with pytest.raises(ValueError, match="trainable"):
        mg.nn.bayesian_lora(net, 2, trainable="head")
    with pytest.raises(ValueError, match="posterior"):
        mg.nn.bayesian_lora(net, 2, posterior="nope")
    assert all(isinstance(m, nn.Linear) for m in net if not isinstance(m, nn.Tanh))  # untouched by the failures


# --------------------------------------------------------------------------------- what the prior regularises

def _kl_and_grads(model):
    sites = mg.nn.bayesian_modules(model)
    value = mg.nn.kl(model, seed=0)
    grads = torch.autograd.grad(value, [p for s in sites for p in (s.weight_mu, s.weight_rho)])
    return value, grads[0::2], grads[1::2]


_F64 = {"dtype": torch.float64}


@pytest.mark.parametrize("prior", [None, "normal", Normal(torch.tensor(0.0, **_F64), torch.tensor(0.3, **_F64)),
                                   torch.distributions.Laplace(torch.tensor(0.0, **_F64), torch.tensor(0.2, **_F64))],
                         ids=["init_normal", "normal", "normal_0.3", "laplace"])
@pytest.mark.parametrize("method", ["auto", "monte-carlo"])
def test_prior_on_scale_is_the_kl_at_a_stopped_mean(prior, method):
    """prior_on="scale": the KL's value is the ELBO's, its gradient on μ is 0 and on ρ it is the gradient of
    KL(q(sg μ, σ) ‖ p), in the closed form and the Monte Carlo tier alike, and under return_stderr."""
    kwargs = {} if prior is None else {"prior": prior}
    scale = mg.nn.bayesian_lora(_mlp(), rank=2, rho_init=-1.0, **kwargs)
    strict = mg.nn.bayesian_lora(_mlp(), rank=2, rho_init=-1.0, prior_on="all", **kwargs)
    for a, b in zip(mg.nn.bayesian_modules(scale), mg.nn.bayesian_modules(strict)):
        with torch.no_grad():
            b.weight_mu.copy_(a.weight_mu)
    kl_samples = 64 if method == "monte-carlo" else None
    v_scale = mg.nn.kl(scale, kl_samples, seed=3, method=method)
    v_strict = mg.nn.kl(strict, kl_samples, seed=3, method=method)
    torch.testing.assert_close(v_scale, v_strict, rtol=1e-12, atol=1e-12)  # the same KL
    sites = mg.nn.bayesian_modules(scale)
    params = [p for s in sites for p in (s.weight_mu, s.weight_rho)]
    grads = torch.autograd.grad(v_scale, params)
    assert all(float(g.abs().max()) <= 1e-13 for g in grads[0::2])  # nothing reaches μ (up to rounding)
    # the reference: the strict model's KL with its means out of the graph (the same closed form or MC draws)
    ref_sites = mg.nn.bayesian_modules(strict)
    for s in ref_sites:
        s.weight_mu.requires_grad_(False)
    ref = mg.nn.kl(strict, kl_samples, seed=3, method=method)
    for s in ref_sites:
        s.weight_mu.requires_grad_(True)
    if method == "auto" and type(ref_sites[0].prior) is Normal:  # and torch's closed form
        closed = sum(kl_divergence(Normal(s.weight_mu.detach(), s.weight_sigma), s.prior).sum() for s in ref_sites)
        torch.testing.assert_close(v_scale, closed, rtol=1e-12, atol=1e-12)
    ref_grads = torch.autograd.grad(ref, [s.weight_rho for s in ref_sites])
    for g, r in zip(grads[1::2], ref_grads):
        assert r.abs().sum() > 0
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    terms = mg.nn.elbo_terms(scale, torch.randn(4, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0]),
                             num_samples=4, dataset_size=50, kl_samples=4, seed=1, return_stderr=True)
    assert torch.isfinite(terms.elbo_stderr) and torch.isfinite(terms.kl_stderr)


def test_defaults_init_normal_prior_on_sigma_only_and_their_documented_alternatives():
    from mcgraph.nn.lora import InitNormal, ScaleOnlyPrior

    lora = mg.nn.bayesian_lora(_mlp(), rank=2)
    site = lora[2].lora_A  # A of shape (2, 16)
    assert isinstance(site.prior_spec, ScaleOnlyPrior) and isinstance(site.prior_spec.prior, InitNormal)
    assert float(site.prior.scale.flatten()[0]) == pytest.approx(1 / (3 * 16) ** 0.5)
    assert torch.equal(site.prior.loc.detach(), torch.zeros_like(site.weight_mu))  # 0 in value
    # the spread of A's own initialisation: Kaiming-uniform U(±1/√fan_in) has variance 1/(3·fan_in)
    wide = mg.nn.bayesian_lora(nn.Linear(4000, 8), rank=8).lora_A.weight_mu
    assert float(wide.detach().std()) == pytest.approx(InitNormal().scale(wide), rel=0.02)
    old = mg.nn.bayesian_lora(_mlp(), rank=2, prior="normal", prior_on="all")[2].lora_A
    assert old.prior_spec == "normal" and float(old.prior.scale) == 1.0
    assert not isinstance(mg.nn.bayesian_lora(_mlp(), rank=2, posterior="sparse_vd")[0].lora_A.prior_spec,
                          ScaleOnlyPrior)  # a log-uniform prior acts through the means by design: "all"
    assert InitNormal(2.0).scale(torch.empty(3, 12)) == pytest.approx(2 / 6)
    both = mg.nn.bayesian_lora(_mlp(), rank=2, variational="both")[2].lora_B  # B of shape (16, 2): fan_in 2
    assert float(both.prior.scale.flatten()[0]) == pytest.approx(1 / 6 ** 0.5)


def test_prior_on_bad_arguments_name_them():
    from mcgraph.nn.lora import InitNormal

    with pytest.raises(ValueError, match="prior_on must be one of"):
        mg.nn.bayesian_lora(_mlp(), 2, prior_on="mean")
    with pytest.raises(ValueError, match="prior_on must be one of"):
        mg.nn.bayesian_lora(_mlp(), 2, prior_on=True)
    with pytest.raises(ValueError, match="prior_on='scale' needs a prior of a location family"):
        mg.nn.bayesian_lora(_mlp(), 2, prior="log_uniform", prior_on="scale")
    with pytest.raises(ValueError, match="gain"):
        InitNormal(0.0)


#: The digits task of paper_tables/lora_table at a test's size: a 1-block transformer (d_model 16) pretrained on
#: 1000 upright digits read by rows, fine-tuned on 300 rotated ones for 60 epochs of 10 steps (batch 32, Adam
#: lr 1e-2, 4 samples per step, KL / N at weight 1), tested on the 497 others.
_DIGITS = {"dataset": "digits", "source": 1000, "finetune": 300, "steps": 8, "features": 8, "pretrain_epochs": 20,
           "pretrain_batch": 64, "pretrain_lr": 3e-3, "network": {"d_model": 16, "heads": 2, "layers": 1, "ff": 32}}


def _digits_fine_tune(**lora_options):
    """Fine-tune ``bayesian_lora`` (rank 4, α 8, on every projection, the head a point estimate) on the rotated
    digits (seed 0, one thread); returns the adapters' diagnostics and the 32-sample predictive's scores."""
    pytest.importorskip("sklearn")
    lt = pytest.importorskip("paper_tables.lora_table")
    from paper_tables import vogn_table as vt

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ds = lt.data(_DIGITS, 0)
        base, before = lt.pretrained(_DIGITS, 0, ds)
        assert before < 0.3  # the shift is real: the pretrained network is near chance on the rotated digits
        torch.manual_seed(1)
        model = mg.nn.bayesian_lora(base, rank=4, alpha=8, targets=[f"blocks.*.{n}" for n in lt.ADAPTED],
                                    trainable="head", **lora_options)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        gen, n, step = torch.Generator().manual_seed(0), ds.x_train.shape[0], 0
        for _ in range(60):
            model.train()
            perm = torch.randperm(n, generator=gen)
            for b in range(0, n, 32):
                idx = perm[b:b + 32]
                loss = -mg.nn.elbo(model, ds.x_train[idx], ds.y_train[idx], num_samples=4, dataset_size=n, seed=step)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
        probs = mg.nn.predict(model.eval(), ds.x_test, 32, seed=0).double()
        return lt.adapter_diagnostics(model), vt.score(probs, ds.y_test)
    finally:
        torch.set_num_threads(threads)


def test_digits_defaults_keep_the_mean_above_the_noise_and_calibrate():
    """The defaults of bayesian_lora (prior InitNormal, prior_on="scale") on the digits task: A's mean stays above
    its noise (median SNR |μ_A|/σ_A about 2, ΔW's noise about a quarter of its mean) and the predictive is
    calibrated (ECE about 0.04). With the strict ELBO and N(0, 1) (``prior="normal", prior_on="all"``) the same
    run ends with SNR 0.74, noise at 0.69 of the mean and ECE 0.11 (underconfident): this test fails there."""
    diagnostics, scores = _digits_fine_tune()
    assert diagnostics["snr_median"] > 1.2 and diagnostics["noise_to_mean"] < 0.45, diagnostics
    assert scores["accuracy"] >= 0.75 and scores["ece"] <= 0.07 and scores["nll"] <= 0.6, scores


# --------------------------------------------------------------------------------- last layer, only=

def test_last_layer_makes_the_last_linear_bayesian_and_freezes_the_rest():
    net = _mlp()
    bnn = mg.nn.last_layer(net, posterior="normal", kl_samples=2)
    assert [type(m).__name__ for m in bnn] == ["Linear", "Tanh", "Linear", "Tanh", "BayesLinear"]
    assert {n for n, p in bnn.named_parameters() if p.requires_grad} == {"4.weight_mu", "4.weight_rho", "4.bias"}
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    frozen = {n: p.detach().clone() for n, p in bnn.named_parameters() if not p.requires_grad}
    opt = torch.optim.SGD([p for p in bnn.parameters() if p.requires_grad], lr=0.1)
    for step in range(3):
        opt.zero_grad()
        (-mg.nn.elbo(bnn, x, y, num_samples=4, dataset_size=40, seed=step)).backward()
        opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in bnn.named_parameters() if n in frozen)
    assert mg.nn.last_layer(net, freeze_rest=False)[0].weight.requires_grad
    gpt_head = mg.nn.last_layer(_gpt2(), kl_samples=2)
    assert isinstance(gpt_head.lm_head, mg.nn.BayesLinear)
    assert [n for n, p in gpt_head.named_parameters() if p.requires_grad] == ["lm_head.weight_mu", "lm_head.weight_rho"]
    with pytest.raises(ValueError, match="model: .* has no nn.Linear"):
        mg.nn.last_layer(nn.Sequential(nn.ReLU()))
    both = mg.nn.last_layer(mg.nn.bayesian_lora(net, rank=2, targets=["0", "2"]))  # adapters + a Bayesian head
    assert isinstance(both[4], mg.nn.BayesLinear) and isinstance(both[2].lora_B, nn.Linear)
    assert {n for n, p in both.named_parameters() if p.requires_grad} == {
        f"{i}.lora_{f}" for i in (0, 2) for f in ("A.weight_mu", "A.weight_rho", "B.weight")} | {
        "4.weight_mu", "4.weight_rho", "4.bias"}
    with pytest.raises(ValueError, match="model: .* has no nn.Linear"):
        mg.nn.last_layer(mg.nn.bayesian_lora(net, rank=2, targets=["0", "2", "4"]))
    with pytest.raises(TypeError, match="only"):
        mg.nn.last_layer(net, only="0")


def test_bayesify_only_freezes_the_rest_unless_told_otherwise():
    net = _mlp()
    part = mg.nn.bayesify(net, only="2")
    assert {n for n, p in part.named_parameters() if p.requires_grad} == {"2.weight_mu", "2.weight_rho", "2.bias"}
    assert all(p.requires_grad for p in mg.nn.bayesify(net, only="2", freeze_rest=False).parameters())
    assert all(p.requires_grad for p in mg.nn.bayesify(net).parameters())
    with pytest.raises(TypeError, match="freeze_rest"):
        mg.nn.bayesify(net, only="2", freeze_rest="yes")


# --------------------------------------------------------------------------------- many processes

def _process_group_case(group) -> dict:
    model = mg.nn.bayesian_lora(_mlp(), rank=2, rho_init=-1.0, kl_samples=6)
    _randomise_b(model, scale=1.0)
    x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0, 1])
    params = [p for p in model.parameters() if p.requires_grad]
    loss = -mg.nn.elbo(model, x, y, num_samples=mg.Sampling(7, chunk_size=2, process_group=group), dataset_size=50,
                       seed=4)
    grads = torch.autograd.grad(loss, params)
    return {"elbo": torch.cat([loss.detach().reshape(1)] + [g.reshape(-1) for g in grads]),
            "predict": mg.nn.predict(model, x, 9, chunk_size=2, seed=5, process_group=group)}


def _process_group_worker(rank: int, world: int, store: str, outdir: str) -> None:
    import datetime

    import torch.distributed as dist

    from mcgraph.apps.launch import exit_process

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(_process_group_case(dist.group.WORLD), f"{outdir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_process(0)  # gloo's threads must not meet interpreter shutdown (see mcgraph.apps.launch)


@pytest.mark.slow
def test_adapters_split_samples_over_a_process_group(tmp_path):
    """2 gloo ranks split the ELBO's and the prediction's samples: the value and gradients of one process."""
    import torch.multiprocessing as mp

    mp.start_processes(_process_group_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    ref = _process_group_case(None)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("padding_mask", [False, True])
def test_adapters_inside_a_torch_transformer_encoder_are_used_in_inference(padding_mask):
    """nn.TransformerEncoderLayer's fused inference path (eval, no grad) reads linear1/linear2's weights
    directly; the adapted layers must still go through the adapters there: same output with and without
    grad, and different from the base model once B moves away from 0."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    base = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    model = mg.nn.bayesian_lora(base, 2, targets=["layers.0.linear1", "layers.1.linear2"]).eval()
    for m in model.modules():
        if isinstance(m, BayesLoRA):
            nn.init.normal_(m.lora_B.weight, std=0.5)
    x = torch.randn(3, 5, 8)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]]) if padding_mask else None
    with mg.nn.frozen(model):
        with_grad = model(x, src_key_padding_mask=mask)
        with torch.no_grad():
            without = model(x, src_key_padding_mask=mask)
    keep = ~mask if padding_mask else torch.ones(3, 5, dtype=torch.bool)
    torch.testing.assert_close(without[keep], with_grad[keep].detach())
    with torch.no_grad():
        assert (without[keep] - base(x, src_key_padding_mask=mask)[keep]).abs().max() > 1e-3
