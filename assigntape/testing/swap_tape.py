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
earlier) keeps the original. Every alias of the swapped class made during the
session (a TensorFlow API module loaded lazily, such as ``tf.compat.v1``, or
a module imported meanwhile that took the class by name, as tf_keras does) is
put back to the original too: after the session no module holds it.

Options (command line, or the ini file's ``[pytest]`` section):

* ``--assigntape-untracked-writes=cut`` / ``assigntape_untracked_writes = cut``:
  the swapped tapes are ``AssignAwareTape(untracked_writes="cut")``: a
  ``tf.function`` called from an eager tape that writes a variable the tape
  tracks (a compiled Keras model with BatchNorm, say) makes a new version with
  no gradient path, with a warning, instead of raising
  ``UntrackedWriteError``. The default is ``raise``.

``AssignAwareTape`` subclasses the original ``GradientTape``, and assigntape
patches that original class (so that plain tapes beside an ``AssignAwareTape``
follow versions); its patch table keeps the class it found at import, so the
patches go on the real ``GradientTape`` and never on the swapped-in subclass.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, List, Optional, Tuple

from assigntape._tape import AssignAwareTape
from assigntape._tf import backprop

__all__ = ["SwappedGradientTape", "install", "uninstall", "swapped_count"]

_ORIGINAL = backprop.GradientTape
_lock = threading.Lock()
_count = 0
# (module, attribute) pairs swapped, to put back.
_swapped: List[Tuple[Any, str]] = []
_UNTRACKED_CHOICES = ("raise", "cut")
# The swapped tapes' ``untracked_writes`` (``install``'s argument).
_untracked_writes = "raise"
_OPTION = "--assigntape-untracked-writes"
_INI = "assigntape_untracked_writes"


class SwappedGradientTape(AssignAwareTape):
    """``AssignAwareTape``, as ``tf.GradientTape`` while the plugin is active:
    counts the tapes made through the swapped names. Its ``untracked_writes``
    is the plugin's option unless the caller gives one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        global _count
        kwargs.setdefault("untracked_writes", _untracked_writes)
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


def _aliases() -> List[Tuple[Any, str]]:
    """Every (module, attribute) that holds ``SwappedGradientTape``, but this
    module's own name for it: the places ``install`` swapped, and the aliases
    made from them since (a TensorFlow API module loaded lazily after
    ``install`` copies the swapped class from ``backprop``; a module imported
    meanwhile may have taken it by name)."""
    found: List[Tuple[Any, str]] = []
    for module in list(sys.modules.values()):
        if module is None or module is sys.modules[__name__]:
            continue
        try:
            attributes = list(vars(module).items())
        except TypeError:  # an object without a __dict__ put in sys.modules
            continue
        found.extend((module, name) for name, value in attributes if value is SwappedGradientTape)
    return found


def install(untracked_writes: str = "raise") -> None:
    """Swaps ``SwappedGradientTape`` in (idempotent). ``untracked_writes`` is
    the swapped tapes' (``"raise"`` or ``"cut"``, as for ``AssignAwareTape``)."""
    global _untracked_writes
    if untracked_writes not in _UNTRACKED_CHOICES:
        raise ValueError(f"untracked_writes must be 'raise' or 'cut', got {untracked_writes!r}")
    _untracked_writes = untracked_writes
    if _swapped:
        return
    for module in _places():
        module.GradientTape = SwappedGradientTape
        _swapped.append((module, "GradientTape"))


def uninstall() -> None:
    """Puts the original ``GradientTape`` back everywhere: where ``install``
    swapped it, and in every alias of the swapped class made since."""
    global _untracked_writes
    while _swapped:
        module, name = _swapped.pop()
        setattr(module, name, _ORIGINAL)
    for module, name in _aliases():
        setattr(module, name, _ORIGINAL)
    _untracked_writes = "raise"


def swapped_count() -> int:
    """How many tapes were made through the swapped names."""
    return _count


# -- pytest hooks ------------------------------------------------------------------


def pytest_addoption(parser: Any) -> None:
    help_text = (
        "assigntape.testing.swap_tape: the swapped tapes' untracked_writes: 'raise' (the "
        "default) refuses a tf.function called from an eager tape that writes a variable the "
        "tape tracks; 'cut' makes that write a new version with no gradient path, with a warning"
    )
    parser.addoption(_OPTION, choices=_UNTRACKED_CHOICES, default=None, help=help_text)
    parser.addini(_INI, help_text, default="raise")


def _untracked_option(config: Any) -> str:
    """The command line's choice, else the ini file's (checked: pytest checks
    only the command line's)."""
    given: Optional[str] = config.getoption(_OPTION)
    if given is not None:
        return given
    value = str(config.getini(_INI)).strip()
    if value not in _UNTRACKED_CHOICES:
        import pytest

        raise pytest.UsageError(f"{_INI} must be 'raise' or 'cut', got {value!r}")
    return value


def pytest_configure(config: Any) -> None:
    install(_untracked_option(config))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: Any, config: Any) -> None:
    terminalreporter.write_line(
        f"assigntape.testing.swap_tape: {swapped_count()} AssignAwareTape(s) swapped in for tf.GradientTape"
    )


def pytest_unconfigure(config: Any) -> None:
    uninstall()
