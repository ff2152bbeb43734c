"""A GPT-2 small enough for unit tests, built from a config (never downloaded), and the next-token
classifier head the LoRA tests put on it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

#: 2 layers of width 32, 2 heads, a 50-token vocabulary, 16 positions, dropout off.
CONFIG = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def transformers():
    """The transformers module, or the test skipped when it is not installed."""
    return pytest.importorskip("transformers", reason="transformers is not installed (make interop installs it)")


def gpt2_config(**overrides):
    """``transformers.GPT2Config`` of :data:`CONFIG` with ``overrides``."""
    return transformers().GPT2Config(**{**CONFIG, **overrides})


def tiny_gpt2(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> nn.Module:
    """``GPT2LMHeadModel`` of :func:`gpt2_config`, initialised after ``torch.manual_seed(seed)``, in ``dtype``."""
    config = gpt2_config(**overrides)
    torch.manual_seed(seed)
    return transformers().GPT2LMHeadModel(config).to(dtype)


class NextToken(nn.Module):
    """A causal LM as a classifier of the next token: ``(B, T)`` ids → ``(B, V)`` logits at the last position."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids).logits[:, -1]
