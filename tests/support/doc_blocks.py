"""The ```python blocks of the README and the docs pages, as the tests that run them read them."""

from __future__ import annotations

import re
import textwrap

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown text, dedented (a block may sit indented in a list), in order."""
    return [textwrap.dedent(m.group("body")) for m in _FENCE.finditer(text)]


def section(text: str, heading: str) -> str:
    """The text under the level-2 ``heading`` (e.g. ``"## The plan cache"``) up to the next level-2 heading."""
    if heading not in text:
        raise ValueError(f"heading: {heading!r} is not in the text")
    return text.split(heading, 1)[1].split("\n## ", 1)[0]
