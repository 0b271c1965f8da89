"""Hypothesis strategies for testing ``AssignAwareTape`` and code built on it.

Needs hypothesis (``pip install "assigntape[testing]"``); ``assigntape.testing``
itself does not import it.

Example::

    from hypothesis import given
    from assigntape.testing.strategies import programs

    @given(programs())
    def test_writes(program):
        program.check()            # eager; check(compiled=True) in a tf.function

A failing example prints as ``Program(...)``: paste it after
``from assigntape.testing.strategies import Program`` to run it again.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

from hypothesis import strategies as st

from assigntape.testing._generator import generate
from assigntape.testing._program import Program
from assigntape.testing._vocabulary import DTYPES, WRITE_KINDS

__all__ = ["Program", "programs"]

_MAX_VARIABLES = 8
_MAX_STEPS = 32


def programs(
    *,
    max_variables: int = 4,
    max_steps: int = 8,
    dtypes: Sequence[Any] = DTYPES,
    writes: Sequence[str] = WRITE_KINDS,
    compiled: Union[bool, str] = False,
    events: bool = False,
    function_writes: bool = False,
    keras_variables: bool = True,
    stopped_writes: bool = True,
) -> "st.SearchStrategy[Program]":
    """A strategy of random programs with variable writes, each with ``.check()``.

    A program has 1 to ``max_variables`` variables of shapes ``()``, ``(3,)``
    and ``(2, 3)``, some of them Keras 3 variables, and 1 to ``max_steps``
    statements: reads by six paths (the C++ fast path, ``read_value``, an
    operator, ``tf.gather``, ``tf.function``s one and two calls deep),
    elementwise and matmul ops on variables, earlier results and watched
    parameters, and writes of every kind in ``writes`` (some with constants,
    some under ``stop_recording``, scatters with broadcast values). The loss is
    a real scalar over every result and every variable's final value.

    Args:
      max_variables: at most this many variables (1 to 8).
      max_steps: at most this many statements (1 to 32).
      dtypes: the variables' dtypes, among ``float32``, ``float64``,
        ``complex128`` (names or ``tf.DType``s).
      writes: the write kinds to use: ``assign``, ``assign_add``,
        ``assign_sub``, ``scatter_{update,add,sub,mul,div,min,max}``,
        ``scatter_nd_{update,add,sub,min,max}``, ``slice`` (all by default).
      compiled: the mode the programs must run in: ``False`` (eager),
        ``True`` (``tf.function``) or ``"xla"``, which leaves out what XLA
        cannot compile (``scatter_nd_min`` / ``_max``, broadcast slice writes).
      events: also tape events: an inner tape opened (plain or ours), the tape
        exited and entered again, ``reset()``. Eager only.
      function_writes: also writes inside ``tf.function``s (and, eagerly,
        ``tf.data`` functions). Eagerly, the tape cuts them
        (``untracked_writes="cut"``); with ``events``, a program may have
        both: its tapes, an inner one of ours too, cut them. With
        ``compiled``, the ``tf.function``s are called in the tape's function,
        which follows their writes.
      keras_variables: make about a quarter of the real variables Keras 3 ones.
      stopped_writes: also writes under ``stop_recording``.

    Returns:
      A strategy of ``Program``.

    Raises:
      ValueError: an option is out of range or unknown.
    """
    if not 1 <= max_variables <= _MAX_VARIABLES:
        raise ValueError(f"max_variables must be in 1..{_MAX_VARIABLES}, got {max_variables}")
    if not 1 <= max_steps <= _MAX_STEPS:
        raise ValueError(f"max_steps must be in 1..{_MAX_STEPS}, got {max_steps}")
    import tensorflow as tf

    names = tuple(tf.as_dtype(d).name for d in dtypes)
    bad = [d for d in names if d not in DTYPES]
    if bad or not names:
        raise ValueError(f"dtypes must be a non-empty selection of {DTYPES}, got {tuple(dtypes)}")
    unknown = [w for w in writes if w not in WRITE_KINDS]
    if unknown or not writes:
        raise ValueError(f"writes must be a non-empty selection of {WRITE_KINDS}, got {tuple(writes)}")
    if compiled not in (False, True, "xla"):
        raise ValueError(f"compiled must be False, True or 'xla', got {compiled!r}")
    if compiled and events:
        raise ValueError("events run eagerly only: not with compiled")
    return generate(
        max_variables,
        max_steps,
        names,
        tuple(writes),
        compiled,
        events,
        function_writes,
        keras_variables,
        stopped_writes,
    )
