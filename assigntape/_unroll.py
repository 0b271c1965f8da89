"""``unroll``: K calls of a step in checkpointed segments, the early ones cut."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable, Optional

import numpy as np

from assigntape import _registry
from assigntape._checkpoint import run_segment
from assigntape._errors import RecomputeError
from assigntape._segment_checks import resume
from assigntape._tf import tensor_lib

__all__ = ["unroll"]


def unroll(
    fn: Callable[[], Any], steps: int, checkpoint_every: Optional[int] = None, truncate: Optional[int] = None
) -> Any:
    """Calls ``fn`` ``steps`` times, in segments of ``checkpoint_every``
    steps that the tape keeps only at their boundaries.

    The carried state is found from the writes: the variables the steps
    write (weights, optimizer slots, counters, moving statistics), so ``fn``
    is the plain step, as it would be called in a loop. Each segment is one
    ``checkpointed`` call; the backward pass runs one segment at a time
    again, so the tape's memory grows like ``steps / checkpoint_every``
    checkpoints plus one segment's steps (about ``2 sqrt(steps)`` steps with
    the default). The result equals the loop without ``unroll``.

    Args:
      fn: a zero-argument step (see ``checkpointed`` for what it may do).
      steps: a Python int.
      checkpoint_every: steps per segment; default ``ceil(sqrt(steps))``
        (of the differentiated steps, with ``truncate``).
      truncate: differentiate only the last ``truncate`` steps: the steps
        before them run as under the tape's ``stop_recording()`` (their
        writes are new versions with no gradient path).

    Returns:
      What the last call of ``fn`` returned (None for zero steps).

    Raises:
      TypeError: ``steps``, ``checkpoint_every`` or ``truncate`` is a bool.
      RecomputeError: ``steps`` is a tensor (the number of segments must be
        known when the tape records), or what ``checkpointed`` refuses.

    Example:

    >>> w, lr = tf.Variable(2.0), tf.Variable(0.1)
    >>> with AssignAwareTape() as tape:
    ...     _ = unroll(lambda: w.assign_sub(lr * 2.0 * w), steps=3, checkpoint_every=2)
    ...     loss = w * 1.0
    >>> round(float(tape.gradient(loss, lr)), 4)
    -7.68
    """
    given = {"steps": steps, "checkpoint_every": checkpoint_every, "truncate": truncate}
    flags = [name for name, value in given.items() if isinstance(value, (bool, np.bool_))]
    if flags:
        # (a bool is an int to Python: unroll(fn, True) would run one step)
        raise TypeError(
            f"unroll was given {flags[0]}={given[flags[0]]!r}: it takes a number of steps, not a "
            f"bool. Pass an int (unroll(fn, steps, checkpoint_every, truncate))."
        )
    if isinstance(steps, tensor_lib.Tensor) or not isinstance(steps, numbers.Integral):
        raise RecomputeError(
            f"unroll was given steps={steps!r}: it takes a Python int (the tape records one op per "
            "segment, so their number must be known while it records). Pass int(steps), or loop "
            "over checkpointed(fn) calls yourself."
        )
    if steps < 0 or (checkpoint_every is not None and checkpoint_every < 1) or (truncate is not None and truncate < 0):
        raise ValueError(f"unroll: steps ({steps}) and truncate must be >= 0, checkpoint_every >= 1")
    steps = int(steps)
    kept = steps if truncate is None else min(truncate, steps)
    result = None
    if steps > kept:
        result = _cut_steps(fn, steps - kept)
    every = checkpoint_every or max(1, math.ceil(math.sqrt(kept)))
    name = f"unroll({getattr(fn, '__name__', 'fn')})"
    done = 0
    while done < kept:
        n = min(every, kept - done)
        done += n
        result = run_segment(name, functools.partial(_steps, fn, n), (), returns=done == kept)
    return result


def _steps(fn: Callable[[], Any], n: int) -> Any:
    result = None
    for _ in range(n):
        result = fn()
    return result


def _cut_steps(fn: Callable[[], Any], n: int) -> Any:
    """``n`` steps as under the tapes' ``stop_recording()``: every
    ``AssignAwareTape`` of the scope paused (a plain tape ``fn`` opens
    records, as it would there: ``record.stop_recording()`` would stop it)."""
    scopes = getattr(_registry._tls, "scopes", None)
    scope = _registry._enclosing_scope(scopes) if scopes else None
    paused = [r for r in scope.records if r.recording()] if scope is not None else []
    try:
        for r in paused:  # (in the try: an interrupt among them resumes those paused)
            r.pause()
        return _steps(fn, n)
    finally:
        resume(paused)
