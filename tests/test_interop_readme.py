"""The README's "From other libraries" examples run, each where its library is installed."""

import pathlib
import re

import pytest

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


def test_every_library_has_an_example():
    assert set(examples()) == set(LIBRARY)


@pytest.mark.parametrize("title", sorted(LIBRARY))
def test_readme_example_runs(title):
    code = examples()[title]
    restore = None
    if title == "torch-uncertainty":  # its package __init__ needs lightning and torchvision: the layers alone
        _, _, restore = load_torch_uncertainty()
    else:
        pytest.importorskip(LIBRARY[title], reason=f"{LIBRARY[title]} is not installed (`make interop`)")
    try:
        exec(compile(code, f"README.md ({title})", "exec"), {"__name__": "readme_example"})
    finally:
        if restore is not None:
            restore()
