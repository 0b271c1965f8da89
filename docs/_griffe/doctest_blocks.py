"""A griffe extension for the API reference: doctest examples as code blocks.

The library's docstrings show examples as bare ``>>>`` sessions after a line
such as ``Example:``. Rendered as Markdown, a session's output (``[[18.0,
36.0]]``) would read as a link reference, and its prompts as quoted text. This
wraps each run of a session (its ``>>>`` and ``...`` lines and the output up to
the next blank line) in a ``pycon`` fence, leaving every other line as it is.
"""

from __future__ import annotations

from typing import Any, List

import griffe


def fence_sessions(text: str) -> str:
    """``text`` with each doctest session fenced as ``pycon``."""
    out: List[str] = []
    in_session = False
    indent = ""
    for line in text.splitlines():
        stripped = line.lstrip()
        if not in_session and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            in_session = True
        elif in_session and not stripped:
            out.append(f"{indent}```")
            in_session = False
        out.append(line)
    if in_session:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fences the doctest sessions of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_sessions(obj.docstring.value)
