"""mcgraph.interop.peft: peft LoRA models (GPT-2 from a tiny config, never downloaded) as variational LoRA
holding peft's very Parameters as the means."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributions import Normal, kl_divergence

import mcgraph as mg
from mcgraph.nn import BayesLoRA
from support.tiny_lm import NextToken, gpt2_config, tiny_gpt2

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make interop installs it)")
peft = pytest.importorskip("peft", reason="peft is not installed (make interop installs it)")
ipeft = pytest.importorskip("mcgraph.interop.peft")


def _peft_gpt2(seed=0, **lora):
    base = tiny_gpt2(seed)
    options = dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                   init_lora_weights=False)  # random B, so the adapters change the output
    options.update(lora)
    return peft.get_peft_model(base, peft.LoraConfig(**options))


def _pairs(peft_model, converted):
    originals = dict(ipeft.lora_layers(peft_model))
    pairs = [(name, originals[name], m) for name, m in converted.named_modules() if isinstance(m, BayesLoRA)]
    assert sorted(n for n, _, _ in pairs) == sorted(originals)
    return pairs


def _ids(seed=0, batch=3):
    return torch.randint(0, 50, (batch, 6), generator=torch.Generator().manual_seed(seed))


def test_the_means_are_peft_parameters_and_mean_mode_is_peft_forward():
    pm = _peft_gpt2().eval()
    bnn = ipeft.to_mcgraph(pm, prior="normal", kl_samples=4, rho_init=-3.0)
    pairs = _pairs(pm, bnn)
    assert len(pairs) == 6  # c_attn, attn.c_proj and mlp.c_proj of 2 blocks
    for _, layer, ours in pairs:
        assert ours.lora_A.weight_mu is layer.lora_A["default"].weight
        assert ours.lora_B.weight is layer.lora_B["default"].weight
        assert ours.base_layer.weight is layer.base_layer.weight
        assert ours.scaling == layer.scaling["default"] == 2.0
    assert all(isinstance(m, peft.tuners.lora.LoraLayer) for _, m in ipeft.lora_layers(pm))  # pm untouched
    ids = _ids()
    expected = pm(input_ids=ids).logits
    with mg.nn.frozen(bnn):
        assert torch.equal(bnn(input_ids=ids).logits, expected)
    assert not torch.equal(bnn(input_ids=ids).logits, expected)  # sample mode draws A
    with torch.no_grad():  # peft's own forward sees the same parameters: B = 0 gives the base model
        for _, layer, _ in pairs:
            layer.lora_B["default"].weight.zero_()
        with pm.disable_adapter():
            base = pm(input_ids=ids).logits
    assert torch.equal(bnn(input_ids=ids).logits, base)


def test_one_optimizer_step_moves_peft_parameters_and_save_pretrained_keeps_working(tmp_path):
    pm = _peft_gpt2()
    bnn = ipeft.to_mcgraph(pm, kl_samples=2)
    model = NextToken(bnn)
    frozen = {n: p.detach().clone() for n, p in pm.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A.default." in n or ".lora_B.default." in n for n in adapters)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == len(adapters) + 6  # peft's A and B, and one ρ per adapter
    opt = torch.optim.Adam(trainable, lr=1e-2)
    loss = -mg.nn.elbo(model, _ids(), torch.tensor([1, 2, 3]), num_samples=mg.Sampling(4, chunk_size=2),
                       dataset_size=30, seed=0)
    loss.backward()
    opt.step()
    for n, p in pm.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]) and p.grad is None, n
        else:
            assert not torch.equal(p, adapters[n]), n  # peft's lora_A and lora_B moved
    pm.save_pretrained(tmp_path)  # the means, in peft's format
    torch.save(bnn.state_dict(), tmp_path / "mcgraph.pt")  # σ too
    torch.manual_seed(0)
    again = peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel(gpt2_config()).double(), tmp_path)
    for (n, p), (m, q) in zip(pm.named_parameters(), again.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n
    restored = ipeft.to_mcgraph(again, kl_samples=2)
    restored.load_state_dict(torch.load(tmp_path / "mcgraph.pt", weights_only=True))
    for (_, _, a), (_, _, b) in zip(_pairs(pm, bnn), _pairs(again, restored), strict=True):
        assert torch.equal(a.lora_A.weight_rho, b.lora_A.weight_rho) and not torch.equal(
            a.lora_A.weight_rho, torch.full_like(a.lora_A.weight_rho, -5.0))
    x = _ids(1)
    assert torch.equal(mg.nn.forward_samples(model, x, 3, seed=1),
                       mg.nn.forward_samples(NextToken(restored), x, 3, seed=1))


def test_elbo_on_a_converted_peft_model_same_noise_any_chunk_and_kl_closed_form():
    pm = _peft_gpt2(lora_dropout=0.2).train()
    prior = Normal(torch.zeros((), dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64))
    bnn = ipeft.to_mcgraph(pm, rho_init=-2.0, prior=prior)
    model = NextToken(bnn)
    assert all(isinstance(m.lora_dropout, mg.nn.AdapterDropout) and m.lora_dropout.p == 0.2 for m in
               bnn.modules() if isinstance(m, BayesLoRA))
    ids, y = _ids(2), torch.tensor([4, 5, 6])
    params = [p for p in model.parameters() if p.requires_grad]
    a = mg.nn.elbo(model, ids, y, num_samples=mg.Sampling(5, chunk_size=2), dataset_size=40, seed=7)
    b = mg.nn.elbo(model, ids, y, num_samples=mg.Sampling(5, method="direct"), dataset_size=40, seed=7)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for u, v in zip(torch.autograd.grad(a, params), torch.autograd.grad(b, params), strict=True):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)
    expected = sum(kl_divergence(m.lora_A.posterior, prior).sum() for m in bnn.modules() if isinstance(m, BayesLoRA))
    torch.testing.assert_close(mg.nn.kl(bnn, seed=0), expected, rtol=1e-12, atol=1e-12)

    def size(M):
        return mg.graph_size(lambda: mg.nn.elbo(model, ids, y, num_samples=M, dataset_size=40, seed=0)).saved_bytes

    s2, s64 = size(2), size(64)
    assert abs(s64 - s2) <= 0.05 * s2, (s2, s64)


def test_variational_both_and_a_plain_torch_model():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    pm = peft.get_peft_model(net, peft.LoraConfig(r=2, lora_alpha=2, target_modules=["0", "2"],
                                                  init_lora_weights=False))
    bnn = ipeft.to_mcgraph(pm, variational="both")
    layer = bnn.base_model.model[2]
    assert layer.lora_B.weight_mu is pm.base_model.model[2].lora_B["default"].weight
    assert len(mg.nn.bayesian_modules(bnn)) == 4
    x = torch.randn(5, 8)
    with mg.nn.frozen(bnn):
        assert torch.equal(bnn(x), pm(x))
    probs = mg.nn.predict(bnn, x, 16, seed=0)
    assert probs.shape == (5, 3) and torch.allclose(probs.sum(-1), torch.ones(5))


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="peft_model must be an nn.Module"):
        ipeft.to_mcgraph("gpt2")
    with pytest.raises(ValueError, match="peft_model: .* holds no peft LoRA layer"):
        ipeft.to_mcgraph(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="variational"):
        ipeft.to_mcgraph(_peft_gpt2(), variational="C")
    with pytest.raises(TypeError, match="DoRA"):
        ipeft.to_mcgraph(_peft_gpt2(use_dora=True))
    with pytest.raises(TypeError, match="around Embedding"):
        ipeft.to_mcgraph(_peft_gpt2(target_modules=["wte", "c_attn"]))
    merged = _peft_gpt2()
    merged.merge_adapter()
    with pytest.raises(ValueError, match="merged"):
        ipeft.to_mcgraph(merged)
    with pytest.raises(ValueError, match="posterior"):
        ipeft.to_mcgraph(_peft_gpt2(), posterior="nope")
