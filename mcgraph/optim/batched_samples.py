"""Per-example squared gradients at S weight samples, from one vmapped forward and backward.

:class:`~mcgraph.optim.SquaredGradients` records a layer's input ``a`` and output gradient ``b``
with module hooks and forms ``Σ_i p_i²`` from them (``p_i`` example ``i``'s gradient of the
loss; ``(b²)ᵀ a²`` for a linear layer). Under ``torch.func.vmap`` a backward hook cannot keep
``b``: the recorded tensor would leave the transform. Here the samples' weights are stacked along a
leading axis and every supported layer's output gets a zero *probe* ``z`` added by a forward hook;
``torch.func.grad`` with respect to the probes gives ``∂loss/∂z = b`` per sample, and the inputs
``a`` come back as the function's auxiliary output. Both leave the transform as ordinary
``(S, …)`` tensors, and the layer rules of :mod:`mcgraph.optim.per_example` turn them into the
same sums as the hooks.

The probes need the layers' output shapes before the batched pass: one forward at the first
sample's weights without gradients gives them (global RNG state and the model's buffers are put
back after it). A model vmap cannot batch (BatchNorm with batch statistics, in-place buffer updates),
or a layer called more than once per forward (its probes would be shared), raises
:class:`Unbatchable`; the caller then runs the samples one by one.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .per_example import common_batch_size, rule_for

__all__ = ["CHUNK_ELEMENTS", "CUDA_CHUNK_ELEMENTS", "Unbatchable", "check_batchable", "default_chunk_size", "sample_squared_gradients"]

#: Numbers of one chunk of stacked weight samples on the CPU (2²⁴, 64 MiB in float32): the optimizers'
#: ``step_samples`` stack as many samples per vmapped pass as fit in it, at least one. Eight samples of
#: the 784-1000-1000-10 MLP (1.8 M weights) fit in one pass: 1.4× faster than passes of two, with peak
#: RSS 1.33× the one-sample step (``bench/results/optim-samples.md``).
CHUNK_ELEMENTS = 1 << 24
#: The same on a CUDA device (2²⁶, 256 MiB in float32), where each pass costs kernel launches: on an
#: H100 the MLP's eight samples in one pass took 4.2 ms against 20.1 ms in passes of two.
CUDA_CHUNK_ELEMENTS = 1 << 26


def default_chunk_size(samples: int, numel: int, device: torch.device | str | None = None) -> int:
    """Samples per vmapped pass: all ``samples`` while ``samples · numel`` fits in the device's budget
    (:data:`CUDA_CHUNK_ELEMENTS` on CUDA, :data:`CHUNK_ELEMENTS` elsewhere), else as many as fit (at least
    one); ``numel`` is the number of parameters one sample stacks."""
    cuda = device is not None and torch.device(device).type == "cuda"
    budget = CUDA_CHUNK_ELEMENTS if cuda else CHUNK_ELEMENTS
    return max(1, min(samples, budget // max(1, numel)))


class Unbatchable(RuntimeError):
    """The model cannot be evaluated at stacked weight samples under vmap."""


def check_batchable(model: nn.Module) -> None:
    """Raise :class:`Unbatchable` for a model whose forward vmap cannot batch over weight samples."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats:
            raise Unbatchable(f"{name or type(m).__name__}: BatchNorm in training mode mixes the samples' batch "
                              "statistics and updates its running statistics in place")


def _output_shapes(model: nn.Module, modules: dict, loss_fn: Callable, params: dict) -> dict:
    """``{name: output shape}`` of every module in ``modules`` for one forward at ``params`` (no gradients)."""
    from torch.nn.utils.stateless import _reparametrize_module

    shapes: dict = {}

    def hook(module, inputs, output):
        name = modules[id(module)][0]
        if name in shapes:
            raise Unbatchable(f"{name}: the layer runs more than once per forward")
        if not isinstance(output, torch.Tensor):
            raise Unbatchable(f"{name}: the layer's output is not one tensor")
        shapes[name] = output.shape

    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    devices = sorted({p.device.index for p in params.values() if p.device.type == "cuda"})
    handles = [m.register_forward_hook(hook) for _, m in modules.values()]
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), _reparametrize_module(model, params):
            loss_fn()
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
    return shapes


def sample_squared_gradients(model: nn.Module, modules: list[nn.Module], loss_fn: Callable[[], torch.Tensor],
                             stacked: dict[str, torch.Tensor]):
    """Gradients, per-example squared gradients and losses of ``loss_fn`` at S stacked weight samples.

    Args:
        model: the network whose parameters ``stacked`` replaces (by qualified name).
        modules: the layers whose ``Σ_i p_i²`` is wanted (each with a per-example rule).
        loss_fn: the batch's loss through ``model``'s forward, without ``backward()``.
        stacked: ``{parameter name: (S, *shape)}``, sample ``k`` in row ``k``.

    Returns:
        ``(grads, squared, losses, batch_size)``: ``grads`` is ``{name: (S, *shape)}`` (the loss's
        gradient at each sample), ``squared`` ``{name: Σ_k Σ_i p_ki²}`` summed over the S samples (the
        names of the parameters of ``modules``), ``losses`` the ``(S,)`` losses, ``batch_size`` the
        layers' batch size (dim 1 of their stacked inputs).

    Raises:
        Unbatchable: the model cannot run under vmap this way (the caller falls back to a loop).
    """
    from torch.func import grad, vmap
    from torch.nn.utils.stateless import _reparametrize_module

    check_batchable(model)
    names = {id(m): n for n, m in model.named_modules()}
    chosen = {id(m): (names[id(m)], m) for m in modules}
    shapes = _output_shapes(model, chosen, loss_fn, {n: t[0] for n, t in stacked.items()})
    any_param = next(iter(stacked.values()))
    probes = {n: torch.zeros(s, dtype=any_param.dtype, device=any_param.device) for n, s in shapes.items()}

    def loss_at(params: dict, probes: dict):
        inputs: dict = {}

        def hook(module, args, output):
            name = chosen[id(module)][0]
            inputs[name] = rule_for(module).prepare(module, args[0])
            return output + probes[name].to(output.dtype)

        handles = [m.register_forward_hook(hook) for _, m in chosen.values()]
        try:
            with _reparametrize_module(model, params):
                loss = loss_fn()
        finally:
            for h in handles:
                h.remove()
        return loss, (loss.detach(), inputs)

    try:
        with torch.enable_grad():
            (grads, output_grads), (losses, inputs) = vmap(
                grad(loss_at, argnums=(0, 1), has_aux=True), in_dims=(0, None), randomness="different")(
                stacked, probes)
    except Unbatchable:
        raise
    except Exception as e:  # noqa: BLE001 -- an op or module vmap refuses
        raise Unbatchable(f"vmap refused the model: {e}") from e
    squared = {}
    for name, m in chosen.values():
        if name not in inputs:
            continue
        # the S samples' examples as one batch: Σ over samples and examples of p², one product per layer
        a, b = inputs[name], output_grads[name]
        a, b = a.reshape((-1,) + tuple(a.shape[2:])), b.reshape((-1,) + tuple(b.shape[2:]))
        prefix = f"{name}." if name else ""
        for key, value in rule_for(m).squared_sum(m, a, b).items():
            squared[prefix + key] = value
    return grads, squared, losses, common_batch_size(int(a.shape[1]) for a in inputs.values())  # (S, batch, …)
