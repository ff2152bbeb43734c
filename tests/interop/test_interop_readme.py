"""The "From other libraries" pages (docs/interop/<library>.md) run and produce what they show.

Each page's python blocks ("before" with the library's own loop, "after" with mcgraph) run in order
in one namespace, where the library is installed; the namespace they leave must hold what the page
claims (the converted model shares the library's Parameters, gradients landed, values are finite).
tests/apps/test_docs_pages.py runs the same blocks in a fresh process per page; this test checks their
results. The README's conversion example is checked here too.
"""


import pytest
import torch

from support.interop_models import load_torch_uncertainty
from support.doc_blocks import python_blocks, section
from support.paths import ROOT

DOCS = ROOT / "docs" / "interop"
#: page title -> (page file, the module its examples need).
LIBRARY = {"bayesian-torch": ("bayesian-torch.md", "bayesian_torch"), "blitz": ("blitz.md", "blitz"),
           "torchbnn": ("torchbnn.md", "torchbnn"), "torch-uncertainty": ("torch-uncertainty.md", "torch_uncertainty"),
           "Pyro": ("pyro.md", "pyro"), "TyXe": ("tyxe.md", "tyxe")}


def examples() -> dict:
    """Page title -> the page's python blocks joined in order."""
    found = {}
    for title, (page, _) in LIBRARY.items():
        blocks = python_blocks((DOCS / page).read_text())
        assert blocks, f"docs/interop/{page}: no python block"
        found[title] = "\n".join(blocks)
    return found


def _finite(t) -> bool:
    return bool(torch.isfinite(torch.as_tensor(t)).all())


def _shares_parameters(ns) -> bool:
    return {id(p) for p in ns["bnn"].parameters()} == {id(p) for p in ns["net"].parameters()}


def _pyro_params_finite() -> bool:
    import pyro

    store = pyro.get_param_store()
    return len(store.keys()) > 0 and all(_finite(store[k].detach()) for k in store.keys())


#: What each page's examples must have produced (its namespace after they ran).
CHECKS = {
    "bayesian-torch": lambda ns: _finite(ns["loss"]) and _shares_parameters(ns)
    and ns["net"][0].rho_weight.grad is not None,
    "blitz": lambda ns: _finite(ns["loss"]) and _finite(ns["net"][0].weight_sampler.rho.grad)
    and ns["loss"].requires_grad is False,
    "torchbnn": lambda ns: ns["probs"].shape == (5, 3)
    and bool(torch.allclose(ns["probs"].sum(-1), torch.ones(5), atol=1e-5)) and _shares_parameters(ns),
    "torch-uncertainty": lambda ns: ns["kl"].shape == () and _finite(ns["kl"]) and _shares_parameters(ns)
    and _finite(ns["one_sample"]),
    "Pyro": lambda ns: len(ns["losses"]) == 3 and _finite(ns["losses"]) and _pyro_params_finite(),
    "TyXe": lambda ns: _pyro_params_finite(),
}


def test_every_library_has_a_page():
    assert set(examples()) == set(LIBRARY) == set(CHECKS)
    index = (DOCS / "index.md").read_text()
    for page, _ in LIBRARY.values():
        assert f"]({page})" in index, f"docs/interop/index.md does not link {page}"


@pytest.mark.parametrize("title", sorted(LIBRARY))
def test_library_page_examples_run(title):
    code = examples()[title]
    restore = None
    if title == "torch-uncertainty":  # its package __init__ needs lightning and torchvision: the layers alone
        _, _, restore = load_torch_uncertainty()
    else:
        pytest.importorskip(LIBRARY[title][1], reason=f"{LIBRARY[title][1]} is not installed (`make interop`)")
    namespace = {"__name__": "docs_example"}
    try:
        exec(compile(code, f"docs/interop/{LIBRARY[title][0]}", "exec"), namespace)
        assert CHECKS[title](namespace), f"the {title} page's examples ran but did not produce what they show"
    finally:
        if restore is not None:
            restore()


def test_readme_conversion_example():
    """The README's one-call conversion of a bayesian-torch model trains the model's own Parameters."""
    pytest.importorskip("bayesian_torch", reason="bayesian_torch is not installed (`make interop`)")
    text = (ROOT / "README.md").read_text()
    (code,) = python_blocks(section(text, "## Already have a bayesian-torch or blitz model?"))
    namespace = {"__name__": "readme_example"}
    exec(compile(code, "README.md (conversion)", "exec"), namespace)
    assert _finite(namespace["loss"]) and _shares_parameters(namespace)
    assert namespace["net"][0].rho_weight.grad is not None
