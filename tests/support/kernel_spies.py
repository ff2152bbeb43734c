"""Counting the calls of :mod:`mcgraph.optim.cpu_kernels`' entry points in a test (the real kernels run)."""

from __future__ import annotations

from mcgraph.optim import cpu_kernels


def count_kernel_calls(monkeypatch, names) -> dict:
    """Wrap ``cpu_kernels.<name>`` for each of ``names`` so that every call is counted, then passed on to
    the kernel; returns the live ``{name: calls}`` dict."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(cpu_kernels, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(cpu_kernels, name, counted)
    return calls
