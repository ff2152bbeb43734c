"""The README's "From other libraries" examples run, each where its library is installed."""

import pathlib
import re

import pytest
import torch

from interop_models import load_torch_uncertainty

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
#: README subsection title -> the module its example needs.
LIBRARY = {"bayesian-torch": "bayesian_torch", "blitz": "blitz", "torchbnn": "torchbnn",
           "torch-uncertainty": "torch_uncertainty", "Pyro": "pyro", "TyXe": "tyxe"}


def examples() -> dict:
    text = README.read_text()
    section = text.split("## From other libraries", 1)[1].split("\n## ", 1)[0]
    found = {}
    for title, body in re.findall(r"^### (.+?)\n(.*?)(?=^### |\Z)", section, flags=re.S | re.M):
        blocks = re.findall(r"```python\n(.*?)```", body, flags=re.S)
        assert len(blocks) == 1, f"README section {title!r}: expected one python block"
        found[title.strip()] = blocks[0]
    return found


def _finite(t) -> bool:
    return bool(torch.isfinite(torch.as_tensor(t)).all())


def _shares_parameters(ns) -> bool:
    return {id(p) for p in ns["bnn"].parameters()} == {id(p) for p in ns["net"].parameters()}


def _pyro_params_finite() -> bool:
    import pyro

    store = pyro.get_param_store()
    return len(store.keys()) > 0 and all(_finite(store[k].detach()) for k in store.keys())


#: What each example must have produced (its namespace after it ran).
CHECKS = {
    "bayesian-torch": lambda ns: _finite(ns["loss"]) and _shares_parameters(ns)
    and ns["net"][0].rho_weight.grad is not None,
    "blitz": lambda ns: _finite(ns["loss"]) and _finite(ns["net"][0].weight_sampler.rho.grad),
    "torchbnn": lambda ns: ns["probs"].shape == (5, 3)
    and bool(torch.allclose(ns["probs"].sum(-1), torch.ones(5), atol=1e-5)) and _shares_parameters(ns),
    "torch-uncertainty": lambda ns: ns["kl"].shape == () and _finite(ns["kl"]) and _shares_parameters(ns),
    "Pyro": lambda ns: len(ns["losses"]) == 3 and _finite(ns["losses"]) and _pyro_params_finite(),
    "TyXe": lambda ns: _pyro_params_finite(),
}


def test_every_library_has_an_example():
    assert set(examples()) == set(LIBRARY) == set(CHECKS)


@pytest.mark.parametrize("title", sorted(LIBRARY))
def test_readme_example_runs(title):
    code = examples()[title]
    restore = None
    if title == "torch-uncertainty":  # its package __init__ needs lightning and torchvision: the layers alone
        _, _, restore = load_torch_uncertainty()
    else:
        pytest.importorskip(LIBRARY[title], reason=f"{LIBRARY[title]} is not installed (`make interop`)")
    namespace = {"__name__": "readme_example"}
    try:
        exec(compile(code, f"README.md ({title})", "exec"), namespace)
        assert CHECKS[title](namespace), f"README example {title!r} ran but did not produce what it shows"
    finally:
        if restore is not None:
            restore()
