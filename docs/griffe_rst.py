"""A griffe extension for the API pages: mcgraph's docstrings are Google style with a few
reStructuredText habits (Sphinx/Napoleon). Before griffe parses them:

* ``Example:`` becomes ``Examples:``, so ``>>>`` lines render as code (griffe reads the singular
  as an admonition of Markdown text);
* an ``Args:`` entry that names several parameters over two lines (``a, b, c,`` / ``d: ...``) is
  joined into one line, so griffe finds its ``name: description`` pair;
* ``:func:`x```, ``:class:`x``` … become inline code, and a ``.. math::`` block a ``$$`` block.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc|py:\w+):`~?([^`]+)`")


def _math(text: str) -> str:
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(\s*)\.\. math::\s*(.*)$", line)
        if not m:
            out.append(line)
            i += 1
            continue
        indent, body, i = m.group(1), [m.group(2)] if m.group(2) else [], i + 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            body.append(lines[i].strip())
            i += 1
        out += [indent + "$$", *[indent + b for b in body if b], indent + "$$", ""]
    return "\n".join(out)


def _join_grouped_args(text: str) -> str:
    lines, out, in_args = text.split("\n"), [], False
    for line in lines:
        stripped = line.strip()
        if re.match(r"^(Args|Arguments|Parameters|Attributes|Keyword Args):\s*$", stripped):
            in_args = True
        elif stripped.endswith(":") and not line.startswith(" "):
            in_args = False
        if in_args and out and out[-1].rstrip().endswith(",") and ":" not in out[-1] \
                and re.match(r"^[\w, ]+,$", out[-1].strip()):
            out[-1] = out[-1].rstrip() + " " + stripped
            continue
        out.append(line)
    return "\n".join(out)


def rewrite(text: str) -> str:
    text = re.sub(r"^(\s*)Example(\s*\(.*\))?:\s*$", r"\1Examples:", text, flags=re.M)
    text = _ROLE.sub(r"`\1`", text)
    return _join_grouped_args(_math(text))


class RstDocstrings(griffe.Extension):
    """Rewrites each docstring as described in the module docstring."""

    def on_instance(self, *, node, obj, agent, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
