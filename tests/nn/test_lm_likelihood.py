"""Causal language models in ``mg.nn``: the ``token_categorical`` likelihood against transformers' own loss,
padding masks, ELBO gradients against a per-sample autograd reference, next-token ``predict`` and its
memory in M, and the errors for ill-shaped batches. Models are GPT-2s built from a tiny config."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.func import functional_call

import mcgraph as mg
from mcgraph.engine.plan.families import family_of
from mcgraph.nn import BayesLoRA
from mcgraph.nn.context import NoiseKind, sample_run
from support.tiny_lm import tiny_gpt2

TOKEN = "token_categorical"


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed (make interop installs it)")


def _gpt2(seed=0, dtype=torch.float64, **config):
    return tiny_gpt2(seed, dtype, **config).eval()


def _lora(gpt, seed=1, **options):
    """A Bayesian-LoRA GPT-2 whose B factors are moved off 0 (else every sample is the base model)."""
    model = mg.nn.bayesian_lora(gpt, rank=2, alpha=3.0, rho_init=-1.5, **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, BayesLoRA):
                m.lora_B.weight.copy_(0.3 * torch.randn(m.lora_B.weight.shape, generator=g, dtype=m.lora_B.weight.dtype))
    return model


def _batch(lengths=(10, 7, 4), length=10, seed=2, vocab=50):
    """Right-padded token ids, their attention mask, and labels = ids with the padding at −100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), length), generator=g)
    mask = (torch.arange(length) < torch.tensor(lengths)[:, None]).long()
    return ids, mask, ids.masked_fill(mask == 0, -100)


# --------------------------------------------------------------------------------- transformers' loss


def test_data_term_in_mean_mode_is_transformers_loss_times_tokens_per_sequence():
    """M = 1 with the posterior means: the data term is −outputs.loss · n_tokens / B (the sum over the
    batch's counted tokens, averaged over its B sequences), with the labels shifted inside as transformers'."""
    model = _lora(_gpt2())
    ids, mask, labels = _batch()
    with mg.nn.frozen(model):
        hf = model(input_ids=ids, attention_mask=mask, labels=labels)
        n_tokens = int((labels[:, 1:] != -100).sum())
        expected = -hf.loss.double() * n_tokens / ids.shape[0]
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        got = mg.nn.expected_data_term(model, batch, num_samples=1, likelihood=TOKEN, seed=0)
        # labels = input_ids: the attention mask does what −100 does
        same = mg.nn.expected_data_term(model, {"input_ids": ids, "attention_mask": mask}, ids, num_samples=1,
                                        likelihood=TOKEN, seed=0)
        unpadded = mg.nn.expected_data_term(model, ids[:1], ids[:1], num_samples=1, likelihood=TOKEN, seed=0)
        hf_unpadded = model(input_ids=ids[:1], labels=ids[:1]).loss.double() * (ids.shape[1] - 1)
    # transformers computes its loss in float32 (ForCausalLMLoss upcasts the logits with .float())
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=0)
    torch.testing.assert_close(same, got, rtol=1e-12, atol=0)
    torch.testing.assert_close(unpadded, -hf_unpadded, rtol=2e-6, atol=0)
    # the ELBO is that data term minus the adapters' KL over the number of sequences
    terms = mg.nn.elbo_terms(mg.nn.freeze(model), batch, num_samples=1, dataset_size=100, likelihood=TOKEN, seed=0)
    torch.testing.assert_close(terms.log_likelihood, got, rtol=1e-12, atol=0)
    torch.testing.assert_close(terms.elbo, got - terms.kl / 100, rtol=1e-12, atol=0)


def test_token_log_likelihood_against_a_hand_count():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    labels = torch.tensor([[3, 1, -100, 4, 6], [0, 2, 5, -100, -100]])
    ll = mg.nn.token_log_likelihood(logits, labels)
    logp = logits.log_softmax(-1)
    expected = torch.stack([logp[0, 0, 1] + logp[0, 2, 4] + logp[0, 3, 6], logp[1, 0, 2] + logp[1, 1, 5]])
    torch.testing.assert_close(ll, expected, rtol=1e-14, atol=0)


# --------------------------------------------------------------------------------- padding


def test_padded_positions_contribute_nothing_to_value_or_gradients():
    """Changing the ids under attention_mask = 0 (right padding, labels = input_ids) changes neither the
    M-sample data term nor its gradients."""
    model = _lora(_gpt2())
    ids, mask, _ = _batch()
    other = ids.clone()
    other[mask == 0] = torch.randint(1, 50, (int((mask == 0).sum()),), generator=torch.Generator().manual_seed(9))
    assert not torch.equal(other, ids)
    params = [p for p in model.parameters() if p.requires_grad]
    values, grads = [], []
    for tokens in (ids, other):
        value = mg.nn.expected_data_term(model, {"input_ids": tokens, "attention_mask": mask, "labels": tokens},
                                         num_samples=4, likelihood=TOKEN, seed=5)
        values.append(value)
        grads.append(torch.autograd.grad(value, params))
    torch.testing.assert_close(values[0], values[1], rtol=1e-12, atol=0)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    # without the mask the padded labels count: the value moves (the test can fail)
    unmasked = mg.nn.expected_data_term(model, other, other, num_samples=4, likelihood=TOKEN, seed=5)
    assert not torch.allclose(unmasked, values[1])


# --------------------------------------------------------------------------------- gradients


def _merged(gpt, model, samples, i):
    """The pretrained weights with adapter sample ``i`` merged in: W0 + s·B A_i (Conv1D: transposed)."""
    params = {}
    for name, m in model.named_modules():
        if isinstance(m, BayesLoRA):
            delta = m.scaling * m.lora_B.weight @ samples[name][i]
            params[name + ".weight"] = m.base_layer.weight + (delta.T if mg.nn.lora.is_conv1d(m.base_layer) else delta)
    return params


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_elbo_gradients_match_a_per_sample_autograd_reference_float64(chunk_size):
    """The ELBO of a padded batch against plain autograd: the pretrained GPT-2 run once per sample with
    merged weights W0 + (α/r) B A_i on the same noise, its log-likelihood counted by hand."""
    gpt = _gpt2()
    model = _lora(gpt)
    ids, mask, labels = _batch()
    M, N, seed = 5, 40, 3
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    value = mg.nn.elbo(model, batch, num_samples=mg.Sampling(M, chunk_size=chunk_size), dataset_size=N, seed=seed,
                       likelihood=TOKEN)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(value, params)

    run = sample_run(model, M, seed=seed)
    samples = {}
    for name, m in model.named_modules():
        if isinstance(m, BayesLoRA):
            form = family_of(m.lora_A.posterior)
            samples[name] = form.sample(run.form_rows(m.lora_A, NoiseKind.WEIGHT, form, 0, M))
    counted = (labels[:, 1:] != -100)
    ll = 0
    for i in range(M):
        logits = functional_call(gpt, _merged(gpt, model, samples, i), (ids,), {"attention_mask": mask},
                                 tie_weights=False).logits
        logp = logits[:, :-1].log_softmax(-1).gather(-1, labels[:, 1:].clamp_min(0)[..., None])[..., 0]
        ll = ll + (logp * counted).sum() / ids.shape[0]
    kl = mg.nn.kl(model, seed=0)  # the adapters' KL (kl_samples=1, closed form for normal-normal)
    ref = ll / M - kl / N
    torch.testing.assert_close(value, ref, rtol=1e-10, atol=1e-12)
    for p, g, r in zip(params, grads, torch.autograd.grad(ref, params), strict=True):
        assert r.abs().sum() > 0
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-10)


# --------------------------------------------------------------------------------- predict


def test_predict_next_token_reads_each_rows_last_attended_position():
    """Right-padded rows of different lengths: the predictive of each row's next token equals that of the
    row alone, unpadded (weight noise, so the samples do not depend on the batch)."""
    model = _lora(_gpt2(), estimator="reparameterization")
    ids, mask, _ = _batch()
    M = 6
    probs = mg.nn.predict(model, {"input_ids": ids, "attention_mask": mask}, M, seed=4, likelihood=TOKEN)
    assert probs.shape == (3, 50)
    for b, length in enumerate(mask.sum(1).tolist()):
        alone = mg.nn.forward_samples(model, ids[b:b + 1, :length], M, seed=4)  # (M, 1, T, V)
        ref = torch.softmax(alone[:, 0, -1], -1).mean(0)
        torch.testing.assert_close(probs[b], ref, rtol=1e-10, atol=1e-12)
    # chunking and the full logits (no logits_to_keep, a plain (B, T, V) model) change nothing
    chunked = mg.nn.predict(model, {"input_ids": ids, "attention_mask": mask}, M, chunk_size=4, seed=4,
                            likelihood=TOKEN)
    torch.testing.assert_close(chunked, probs, rtol=1e-12, atol=1e-14)


class _Logits(nn.Module):
    """A causal LM that returns plain ``(B, T, V)`` logits (no ``logits_to_keep``, no ModelOutput)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask=None):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask).logits


def test_predict_left_padding_and_a_plain_logits_model():
    model = _Logits(_lora(_gpt2(), estimator="reparameterization"))
    ids, _, _ = _batch(lengths=(6, 6), length=6)
    got = mg.nn.predict(model, ids, 5, seed=1, likelihood=TOKEN, return_samples=True)
    ref = torch.softmax(mg.nn.forward_samples(model, ids, 5, seed=1)[:, :, -1], -1)
    torch.testing.assert_close(got.sample_probs, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.probs, ref.mean(0), rtol=1e-12, atol=1e-14)
    # left padding: the last position is every row's last; the padded ids do not matter
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    noisy = ids.clone()
    noisy[0, :2] = torch.tensor([7, 9])
    a = mg.nn.predict(model, {"input_ids": ids, "attention_mask": left}, 5, seed=1, likelihood=TOKEN)
    b = mg.nn.predict(model, {"input_ids": noisy, "attention_mask": left}, 5, seed=1, likelihood=TOKEN)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_predict_with_a_bayesian_lm_head_runs_the_trunk_once():
    model = mg.nn.last_layer(_gpt2(), estimator="reparameterization", rho_init=-2.0)
    ids, mask, _ = _batch()
    x = {"input_ids": ids, "attention_mask": mask}
    once = mg.nn.predict(model, x, 8, seed=2, likelihood=TOKEN)
    full = mg.nn.predict(model, x, 8, seed=2, likelihood=TOKEN, trunk_once=False)
    torch.testing.assert_close(once, full, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(once, mg.nn.predict(model, x, 8, seed=3, likelihood=TOKEN))


_RSS_SCRIPT = textwrap.dedent("""
    import json
    import torch, transformers
    import mcgraph as mg


    def peak_kib():  # VmHWM: this process's own peak (ru_maxrss keeps the forking parent's across exec)
        with open("/proc/self/status") as status:
            return int(next(line for line in status if line.startswith("VmHWM:")).split()[1])

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=4096, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    gpt = transformers.GPT2LMHeadModel(config).eval()

    class Logits(torch.nn.Module):  # full (B, T, V) logits per forward: 4 MiB at B = 16
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids).logits

    model = Logits(mg.nn.bayesian_lora(gpt, rank=2))
    ids = torch.randint(0, 4096, (16, 16))
    peaks = {}
    for name, M, chunk in (("one", 1, None), ("many", 256, None), ("wide", 32, 32)):  # peaks only grow
        probs = mg.nn.predict(model, ids, M, chunk_size=chunk, seed=0, likelihood="token_categorical")
        assert probs.shape == (16, 4096)
        peaks[name] = peak_kib()
    print(json.dumps(peaks))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc/self/status")
def test_predict_256_samples_peak_rss_within_1_3x_of_one_sample():
    """Peak RSS of a fresh process (the peak only grows, so the points run in increasing order): M = 256
    with the default chunking within 1.3× of M = 1 (imports included); M = 32 in one chunk
    (32 forwards' logits at once) exceeds it, so the measurement can tell."""
    _transformers()
    done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    assert peaks["many"] <= 1.3 * peaks["one"], peaks
    assert peaks["wide"] > 1.3 * peaks["one"], peaks


# --------------------------------------------------------------------------------- errors


def test_bad_batches_raise_errors_naming_the_argument():
    model = _lora(_gpt2())
    ids, mask, labels = _batch()

    def data(x, y=None, **kw):
        return mg.nn.expected_data_term(model, x, y, num_samples=2, likelihood=TOKEN, seed=0, **kw)

    with pytest.raises(ValueError, match=r"y \(the labels\) must have shape \(3, 10\)"):
        data(ids, labels[:, :5])
    with pytest.raises(TypeError, match="y must hold integer token ids"):
        data(ids, labels.double())
    with pytest.raises(ValueError, match="needs labels"):
        data({"input_ids": ids, "attention_mask": mask})
    with pytest.raises(ValueError, match="labels given twice"):
        data({"input_ids": ids, "labels": labels}, labels)
    with pytest.raises(ValueError, match=r"x\['attention_mask'\] has shape \(2, 10\)"):
        data({"input_ids": ids, "attention_mask": mask[:2]}, labels)
    with pytest.raises(ValueError, match=r"y must have as many rows as x\['input_ids'\] \(3\)"):
        data({"input_ids": ids}, labels[:2])
    with pytest.raises(ValueError, match="the model returned shape"):  # (B, V) logits for (B, T) labels
        mg.nn.expected_data_term(_NextTokenOnly(model), ids, labels, num_samples=1, likelihood=TOKEN, seed=0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor .* or a mapping"):
        data([ids], labels)
    with pytest.raises(ValueError, match="likelihood must be 'categorical' or 'token_categorical'"):
        mg.nn.predict(model, ids, 2, likelihood="gaussian")
    with pytest.raises(ValueError, match=r"x\['attention_mask'\]: row 1 attends to no position"):
        mg.nn.predict(model, {"input_ids": ids, "attention_mask": mask * torch.tensor([[1], [0], [1]])}, 2,
                      likelihood=TOKEN)
    with pytest.raises(ValueError, match=r"x: next-token prediction needs token ids of shape \(B, T\)"):
        mg.nn.predict(model, ids[:, 0], 2, likelihood=TOKEN)
    with pytest.raises(TypeError, match="model: must return a tensor or an output with a .logits"):
        mg.nn.predict(_Tuple(model), ids, 2, likelihood=TOKEN)


class _NextTokenOnly(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids).logits[:, -1]


class _Tuple(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return (self.lm(input_ids=ids).logits,)
