"""``ForwardAccumulator``: forward mode through variable writes, with no
reverse history.

A ``tf.autodiff.ForwardAccumulator`` around an ``AssignAwareTape`` already
carries tangents across writes, but the tape keeps every version for its
reverse pass, and the accumulator keeps each version's tangent as long as the
version lives: memory grows with the number of writes. Forward-mode
hyperparameter gradients over long unrolls need neither. Here an internal
tape makes the versions (so reads see them and the writes carry tangents)
without watching anything, so that nothing is recorded for a reverse pass, and
without keeping any version but the current one, so that the accumulator drops
each earlier tangent.
"""

from __future__ import annotations

from typing import Any, Optional

from assigntape import _patches, _recorders, _resolve
from assigntape._tape import AssignAwareTape
from assigntape._tf import forwardprop, nest

__all__ = ["ForwardAccumulator"]


class _ForwardOnlyTape(AssignAwareTape):
    """Makes versions and watches nothing; keeps no history of them."""

    # Nothing asks this tape for gradients or versions: it keeps nothing, so
    # that every version but the current one can go.
    _keeps_history = False
    # What errors call it (``_forks``).
    _assigntape_kind = "assigntape.ForwardAccumulator"


def _unwrapped(primal: Any) -> Any:
    var = _resolve.resolve(primal)
    return primal if var is None else var


class ForwardAccumulator(forwardprop.ForwardAccumulator):
    """A ``tf.autodiff.ForwardAccumulator`` through which tangents flow across
    variable writes, keeping no reverse history.

    While it is open, every write to a floating-point variable makes a new
    version, as under ``AssignAwareTape``, and the version's tangent is the
    written value's in the functional rewrite (for ``assign_sub``, the old
    version's tangent minus the delta's). Nothing is recorded for a reverse
    pass and only each variable's current version is kept, so memory does not
    grow with the number of writes: the cheap way to differentiate a final
    loss with respect to a few hyperparameters through a long unroll of
    optimizer steps. A variable primal means its version when the
    accumulator was created: a write made while the accumulator is not open
    (before it is entered, or between two entries) is, for it, a new version
    with no tangent, as a closed ``AssignAwareTape`` sees it.

    Args:
      primals: As for ``tf.autodiff.ForwardAccumulator``: tensors or variables.
      tangents: Their tangents, in the same structure.

    Example:

    >>> w, lr = tf.Variable(2.0), tf.Variable(0.1)
    >>> with ForwardAccumulator(lr, tf.constant(1.0)) as acc:
    ...     for _ in range(3):
    ...         _ = w.assign_sub(lr * 2.0 * w)  # gradient descent on w**2
    ...     loss = w ** 2
    >>> round(float(acc.jvp(loss)), 3)  # 2 w3 * w0 * 3 (1 - 2 lr)^2 * (-2)
    -15.729
    """

    # What errors call it (``_forks``).
    _assigntape_kind = "assigntape.ForwardAccumulator"

    def __init__(self, primals: Any, tangents: Any) -> None:
        self._writes: Optional[_ForwardOnlyTape] = None
        # A wrapped variable (a Keras 3 one, ...) is the variable it wraps
        # (TensorFlow's accumulator reads a dtype Keras 3 gives as a string).
        primals = nest.map_structure(_unwrapped, primals)
        super().__init__(primals, tangents)  # enters and exits itself to watch
        # Entered once now and closed, the internal tape starts from the
        # versions current at creation and notes every write made while the
        # accumulator is not open; each entry is then an entry again, which
        # makes such a write a version with no tangent (as for a tape).
        writes = _ForwardOnlyTape(watch_accessed_variables=False)
        # Closed whatever lands between (a KeyboardInterrupt): no object of the
        # user's could close it. (Its entry is all or nothing, its exit always
        # finishes; one line, so that no line event falls between: see
        # _plain_tapes.enter_method.)
        try: writes.__enter__(); writes.__exit__(None, None, None)  # noqa: E701, E702  # fmt: skip
        except BaseException:
            if writes._recording:
                writes.__exit__(None, None, None)
            raise
        # Where the internal tape does not see a version made (a write made
        # while the accumulator was not open, at the variable's first read in
        # it), neither does the accumulator: set aside with it, in its
        # nesting order (``_recorders.AccumulatorRecord``), so that the
        # version has no tangent for it and an identity for those around it.
        writes._record.paired = _recorders.holding(self)
        self._writes = writes

    def __enter__(self) -> "ForwardAccumulator":
        # Installed before TensorFlow's __enter__ runs, so that its patch
        # notes this accumulator (it must hold the versions once the tape
        # inside closes, for jvp after the block; see _plain_tapes).
        _patches.acquire()
        # All or nothing: TensorFlow's (patched) entry and the internal tape's
        # are each all or nothing; an exception after them (a
        # KeyboardInterrupt) closes both, as an empty block would: the writes
        # cut so far were made while the accumulator was not open, so for it
        # they have no tangent either way. (One line: see _plain_tapes.)
        try: return self._enter()  # noqa: E701  # fmt: skip
        except BaseException:
            self._undo_enter()
            raise

    def _enter(self) -> "ForwardAccumulator":
        super().__enter__()
        if self._writes is not None:  # (not while __init__ watches)
            self._writes.__enter__()
        return self

    def _undo_enter(self) -> None:
        writes = self._writes
        if writes is not None and writes._scope is not None:
            writes.__exit__(None, None, None)
        if self._recording:
            super().__exit__(None, None, None)

    def __exit__(self, typ: Any, value: Any, traceback: Any) -> None:
        # Exiting always finishes: after an exception at any point of it (a
        # KeyboardInterrupt), each step runs once more (the internal tape's
        # exit and TensorFlow's, patched, each finish when run again), then
        # it goes on. (One line: see _plain_tapes.)
        try: self._exit(typ, value, traceback)  # noqa: E701  # fmt: skip
        except BaseException:
            self._exit(typ, value, traceback)
            raise

    def _exit(self, typ: Any, value: Any, traceback: Any) -> None:
        writes = self._writes
        try:
            if writes is not None and writes._scope is not None:
                writes.__exit__(typ, value, traceback)
        finally:
            if self._recording:
                super().__exit__(typ, value, traceback)
