"""TensorFlow's nesting order of a thread's tapes and forward accumulators,
kept when another thread pushes them (``_threads``: a replica's tapes and
accumulators, in ``merge_call``).

TensorFlow numbers each tape and accumulator as it enters a thread's set (a
``nesting_id`` from one process-wide counter) and decides by those numbers
who records what: an op a ``ForwardAccumulator`` differentiates is recorded
only on the tapes numbered before it (entered outside it), so that the tapes
inside it do not see its forward computations. Pushing a replica's tape onto
the main thread's set, as acting for the replica in ``merge_call`` does,
numbers it again, after the replica's accumulators: from then on, in the
replica's own thread too, the tape counted as inside them, and the ops they
differentiated (an all-reduce's) went unrecorded on it, a silently wrong
reverse gradient. So each number is read before such a push and written back
after it (the number is a field of TensorFlow's C object, at an offset
checked once against TensorFlow's own numbering before it is ever written).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, List, Optional, Sequence, Tuple

from assigntape._tf import pywrap_tfe

__all__ = ["restore", "saved"]

# ``TFE_Py_Tape`` and ``TFE_Py_ForwardAccumulator`` (pywrap_tfe_src.cc): the
# object header, the pointer to the C++ tape or accumulator, then the int64
# ``nesting_id``.
_OFFSET = 24
_SIZE = 32

_lock = threading.Lock()
_usable: Optional[bool] = None

Saved = List[Tuple[Any, int]]


def _read(obj: Any) -> int:
    return int(ctypes.c_int64.from_address(id(obj) + _OFFSET).value)


def _check() -> bool:
    """Whether the field is where it is expected: objects of the expected
    size, and numbers read there that follow TensorFlow's counter as it
    numbers a tape, an accumulator and a tape again (tried a few times, as
    another thread may take numbers meanwhile)."""
    for _ in range(3):
        made: List[Any] = []
        try:
            first = pywrap_tfe.TFE_Py_TapeSetNew(False, False)
            pywrap_tfe.TFE_Py_TapeSetRemove(first)
            made.append(first)
            accumulator = pywrap_tfe.TFE_Py_ForwardAccumulatorNew(False)
            pywrap_tfe.TFE_Py_ForwardAccumulatorSetAdd(accumulator)
            pywrap_tfe.TFE_Py_ForwardAccumulatorSetRemove(accumulator)
            made.append(accumulator)
            last = pywrap_tfe.TFE_Py_TapeSetNew(False, False)
            pywrap_tfe.TFE_Py_TapeSetRemove(last)
            made.append(last)
        except Exception:  # noqa: BLE001 - another TensorFlow: keep its numbering as it is
            return False
        if any(type(obj).__basicsize__ != _SIZE for obj in made):
            return False
        numbers = [_read(obj) for obj in made]
        if numbers[1] == numbers[0] + 1 and numbers[2] == numbers[1] + 1:
            return True
    return False


def usable() -> bool:
    global _usable
    if _usable is None:
        with _lock:
            if _usable is None:
                _usable = _check()
    return _usable


def saved(objects: Sequence[Any]) -> Saved:
    """The nesting numbers of TensorFlow's tape and accumulator objects
    (``TFE_Py_Tape``, ``TFE_Py_ForwardAccumulator``), to ``restore``."""
    if not objects or not usable():
        return []
    return [(obj, _read(obj)) for obj in objects if type(obj).__basicsize__ == _SIZE]


def restore(numbers: Saved) -> None:
    """Gives each object its saved nesting number again."""
    for obj, number in numbers:
        ctypes.c_int64.from_address(id(obj) + _OFFSET).value = number
