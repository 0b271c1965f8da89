"""A pytest plugin that runs a test suite with ``AssignAwareTape`` in place of
``tf.GradientTape``.

Opt in per run (it is not registered as an entry point)::

    python -m pytest -p assigntape.testing.swap_tape tests/

For the session, ``tf.GradientTape``, ``tf.compat.v1`` / ``tf.compat.v2`` /
``tf.autodiff``'s ``GradientTape`` and the class ``GradientTape`` in
``tensorflow.python.eager.backprop`` are a subclass of ``AssignAwareTape`` that
counts its instances; the originals are put back when the session ends, and
the terminal summary says how many tapes were made through the swapped names.
Code that imported the class by name before the session (``from
tensorflow.python.eager.backprop import GradientTape`` in a module loaded
earlier) keeps the original.

``AssignAwareTape`` subclasses the original ``GradientTape``, and assigntape
patches that original class (so that plain tapes beside an ``AssignAwareTape``
follow versions); its patch table keeps the class it found at import, so the
patches go on the real ``GradientTape`` and never on the swapped-in subclass.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, List, Tuple

from assigntape._tf import backprop

from assigntape._tape import AssignAwareTape

__all__ = ["SwappedGradientTape", "install", "uninstall", "swapped_count"]

_ORIGINAL = backprop.GradientTape
_lock = threading.Lock()
_count = 0
# (module, attribute) pairs swapped, to put back.
_swapped: List[Tuple[Any, str]] = []


class SwappedGradientTape(AssignAwareTape):
    """``AssignAwareTape``, as ``tf.GradientTape`` while the plugin is active:
    counts the tapes made through the swapped names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        global _count
        super().__init__(*args, **kwargs)
        with _lock:
            _count += 1


def _places() -> List[Any]:
    """The modules whose ``GradientTape`` is the public class: TensorFlow's
    API modules (``tf``, ``tf.compat.v1`` / ``v2``, ``tf.autodiff``, ...) and
    ``backprop`` itself."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None:
            continue
        public = name == "tensorflow" or name.startswith(("tensorflow._api.", "tensorflow.compat"))
        if (public or module is backprop) and vars(module).get("GradientTape") is _ORIGINAL:
            found.append(module)
    return found


def install() -> None:
    """Swaps ``SwappedGradientTape`` in (idempotent)."""
    if _swapped:
        return
    for module in _places():
        setattr(module, "GradientTape", SwappedGradientTape)
        _swapped.append((module, "GradientTape"))


def uninstall() -> None:
    """Puts the original ``GradientTape`` back everywhere."""
    while _swapped:
        module, name = _swapped.pop()
        setattr(module, name, _ORIGINAL)


def swapped_count() -> int:
    """How many tapes were made through the swapped names."""
    return _count


# -- pytest hooks ------------------------------------------------------------------


def pytest_configure(config: Any) -> None:
    install()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: Any, config: Any) -> None:
    terminalreporter.write_line(
        f"assigntape.testing.swap_tape: {swapped_count()} AssignAwareTape(s) swapped in for tf.GradientTape"
    )


def pytest_unconfigure(config: Any) -> None:
    uninstall()
