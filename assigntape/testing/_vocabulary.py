"""What random programs are made of: shapes, dtypes, ops and write kinds.

A program is a tuple of statements, each a tuple of plain Python values (so
that ``repr`` of a program is Python source):

* ``("read", operand, unary)``: a new temporary, ``UNARY[unary](operand)``.
* ``(what, i, kind, a, b, op, unary)`` with ``what`` one of ``"write"``,
  ``"write_stopped"`` (under ``stop_recording``), ``"fn_write"`` (inside a
  ``tf.function`` or a ``tf.data`` function called from the eager tape, cut)
  or ``"fn_write_inline"`` (inside a ``tf.function``, one or two calls deep,
  called in the compiled tape's function, followed): variable ``i`` written by
  ``kind`` (a ``FULL_WRITES`` method) with ``UNARY[unary](BINARY op of a and b)``.
* ``("write_const", i, kind)``: variable ``i`` written with a constant.
* ``("partial", i, kind, rows, a, b, op, unary, broadcast)``: a ``PARTIAL_WRITES``
  write of ``rows`` of variable ``i``; ``broadcast`` is ``""``, ``"scalar"`` or
  ``"row"`` (the shape of the written value).
* ``("event", event, flag)``: a tape event, ``"inner"`` (an inner tape opened:
  ``AssignAwareTape`` if ``flag``, else a plain one), ``"pause"`` / ``"resume"``
  (the tape exited and entered again) or ``"reset"``.

An operand is ``(kind, index, path)``: a variable (``"var"``, read by path
``path`` of ``READ_PATHS``), a temporary (``"temp"``) or a watched float64
parameter tensor (``"param"``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import tensorflow as tf

SHAPES: Tuple[Tuple[int, ...], ...] = ((), (3,), (2, 3))
DTYPES: Tuple[str, ...] = ("float32", "float64", "complex128")
REAL: Tuple[str, ...] = ("float32", "float64")
UNARY: Dict[str, Callable[[Any], Any]] = {
    "tanh": tf.tanh,
    "sin": tf.sin,
    "half": lambda x: x * 0.5,
    "square": lambda x: 0.3 * x * x,
}
BINARY: Tuple[str, ...] = ("add", "mul", "sub", "matvec")
FULL_WRITES: Tuple[str, ...] = ("assign", "assign_add", "assign_sub")
PARTIAL_WRITES: Tuple[str, ...] = (
    "scatter_update",
    "scatter_add",
    "scatter_sub",
    "scatter_mul",
    "scatter_div",
    "scatter_min",
    "scatter_max",
    "scatter_nd_update",
    "scatter_nd_add",
    "scatter_nd_sub",
    "scatter_nd_min",
    "scatter_nd_max",
    "slice",
)
WRITE_KINDS: Tuple[str, ...] = FULL_WRITES + PARTIAL_WRITES
ORDERED: Tuple[str, ...] = ("scatter_min", "scatter_max", "scatter_nd_min", "scatter_nd_max")  # not complex
BROADCASTING: Tuple[str, ...] = (
    "scatter_update",
    "scatter_add",
    "scatter_sub",
    "scatter_mul",
    "scatter_div",
    "scatter_min",
    "scatter_max",
    "slice",
)
XLA_MISSING: Tuple[str, ...] = ("scatter_nd_min", "scatter_nd_max")  # XLA has no kernel for these
# identity (the C++ fast path), read_value, a Python operator, tf.gather, a
# tf.function, a tf.function calling a tf.function
READ_PATHS = 6
# Graph control flow around every write (ControlFlowStore): each runs it once.
# "cond" / "loop": a tf.cond with tensor outputs, a loop over tf.range; the
# structured forms carry a namedtuple-and-dict loop state ("struct_loop") or
# return a dict holding a tuple ("struct_cond"), which the tape's own outputs
# must be threaded through.
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("cond",),
    ("cond", "cond"),
    ("loop",),
    ("loop", "cond"),
    ("cond", "loop"),
    ("struct_loop",),
    ("struct_cond", "struct_loop"),
    ("struct_loop", "cond"),
)
