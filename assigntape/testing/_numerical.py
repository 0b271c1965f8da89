"""``numerical_gradient``: central finite differences of a function that may
write variables, with every variable it writes put back between runs."""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import numpy as np
import tensorflow as tf

from assigntape._record import Record
from assigntape._tape import AssignAwareTape
from assigntape.testing._sources import Source, resolve_sources
from assigntape.testing._state import SavedState, probe

__all__ = [
    "Estimate",
    "default_step",
    "estimates",
    "numerical_gradient",
    "require_callable",
    "scalar_value",
    "check_versions_exist",
]


def require_callable(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(
            f"fn must be a callable taking no arguments and returning a scalar tensor, got {type(fn).__name__}"
        )


def scalar_value(result: Any) -> float:
    """``fn``'s result as a Python float, or a clear error."""
    try:
        tensor = tf.convert_to_tensor(result)
    except (TypeError, ValueError) as e:
        raise TypeError(f"fn must return a scalar tensor, got {type(result).__name__}") from e
    if tensor.shape.rank != 0:
        raise ValueError(
            f"fn must return a scalar (shape []), got shape {tensor.shape}: reduce it, e.g. with tf.reduce_sum"
        )
    if not (tensor.dtype.is_floating or tensor.dtype.is_integer):
        raise ValueError(f"fn must return a real scalar, got dtype {tensor.dtype.name}")
    return float(np.array(tensor))


def check_versions_exist(sources: List[Source], tape: AssignAwareTape) -> None:
    """Every version source names a write that ``fn`` made (on ``tape``)."""
    for source in sources:
        made = len(tape.versions(source.variable)) - 1
        if source.version > made:
            raise ValueError(
                f"source {source.name!r}: fn wrote {source.variable.name!r} {made} time(s), so it "
                f"has no version {source.version}"
            )


class _NotingRecord(Record):
    """A ``_PerturbingTape``'s record: tells the tape of each write it notes."""

    def note_write(self, var: Any, old: Any, new: Any, write: Any) -> None:
        super().note_write(var, old, new, write)
        tape = self.tape
        if tape is not None:
            tape._after_write(self, var)


class _PerturbingTape(AssignAwareTape):
    """An ``AssignAwareTape`` that adds ``offset`` to one variable right after
    its ``index``-th write: the value of that version, perturbed."""

    def __init__(self, var: Any, index: int, offset: np.ndarray) -> None:
        super().__init__(untracked_writes="cut")
        self._target = var
        self._index = index
        self._offset = offset
        self._seen = 0
        self._perturbing = False
        self._record = _NotingRecord(self, "cut")

    def _after_write(self, record: Any, var: Any) -> None:
        """``record`` (this tape's) noted a write of ``var``."""
        if self._perturbing or var._unique_id != self._target._unique_id:
            return
        self._seen += 1
        if self._seen != self._index:
            return
        # The write is noted on every open AssignAwareTape, outermost (this
        # one) first. Perturbing now would make the perturbation a version
        # before the inner tapes noted the write itself: wait for the last.
        records = self._scope.records if self._scope is not None else []
        last = records[-1] if records else record
        if last is record:
            self._perturb()
            return
        noted = last.note_write

        def then_perturb(*args: Any) -> None:
            del last.note_write  # the class's method again
            noted(*args)
            self._perturb()

        last.note_write = then_perturb  # type: ignore[method-assign]  # (on this record only, once)

    def _perturb(self) -> None:
        # Recorded like any write, so that tapes opened inside fn (whose
        # gradients fn may use) keep their chains of versions.
        self._perturbing = True
        try:
            self._target.assign_add(self._offset)
        finally:
            self._perturbing = False

    @property
    def seen(self) -> int:
        return self._seen


def _evaluate(fn: Callable[[], Any], state: SavedState, source: Source, offset: np.ndarray) -> float:
    """``fn()`` from the saved state, with ``source`` moved by ``offset``."""
    state.restore()
    var = source.variable
    if source.version == 0:
        var.assign(state.value(var) + offset)
        return scalar_value(fn())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # writes in tf.functions, cut
        with _PerturbingTape(var, source.version, offset) as tape:
            result = fn()
    if tape.seen < source.version:
        raise ValueError(f"source {source.name!r}: this run of fn wrote {var.name!r} only {tape.seen} time(s)")
    return scalar_value(result)


class Estimate(NamedTuple):
    """A source's derivative by finite differences, and how far off it may be."""

    value: np.ndarray  # in the variable's shape and dtype
    error: np.ndarray  # a bound on |value - true derivative|, element by element (float64)
    # The part of ``error`` that rounding alone explains (``_ROUNDING_ULPS``
    # of the values, over the step): an error far above it is the function's.
    rounding: np.ndarray


# The noise of one evaluation of fn is taken as at least this many units in
# the last place of its value (rounding in a few dozen ops), besides what the
# fourth difference of the evaluations measures.
_ROUNDING_ULPS = 32


def _estimate(fn: Callable[[], Any], state: SavedState, source: Source, delta: float, extrapolate: bool) -> Estimate:
    """Central differences of ``fn`` by each element of ``source``.

    Without ``extrapolate``: the central differences with step ``delta``, and
    no error bound (zeros). With it: Richardson's extrapolation of the steps
    ``delta`` and ``delta / 2``, ``D(h/2) + (D(h/2) - D(h)) / 3``, whose
    truncation error is O(h^4), with an error bound of

    * twice ``|D(h) - D(h/2)|``, about 3/2 of the O(h^2) truncation error of
      ``D(h)`` itself and far more than the extrapolation's;
    * plus the rounding noise of the evaluations divided by the step: the
      larger of their fourth difference ``f(h) - 4 f(h/2) + 6 f(0) - 4 f(-h/2)
      + f(-h)`` (about 8 times the noise of one evaluation, its O(h^4) term
      negligible) and ``_ROUNDING_ULPS`` units in the last place of the
      largest value, in the variable's precision."""
    var = source.variable
    dtype = var.dtype.as_numpy_dtype
    eps = float(np.finfo(dtype).eps)
    shape = tuple(var.shape.as_list())
    base = np.broadcast_to(state.value(var), shape) if source.version == 0 else np.zeros(shape, dtype)
    directions = [1.0, 1j] if var.dtype.is_complex else [1.0]
    grad = np.zeros(shape, dtype)
    error = np.zeros(shape, np.float64)
    rounding = np.zeros(shape, np.float64)
    centre = _evaluate(fn, state, source, np.zeros(shape, dtype)) if extrapolate else 0.0
    for idx in np.ndindex(*shape):
        for direction in directions:

            def difference(
                size: float, idx: Tuple[int, ...] = idx, direction: Any = direction
            ) -> Tuple[float, float, float]:
                """(f(x + step), f(x - step), the derivative by them)."""
                step = np.zeros(shape, dtype)
                step[idx] = dtype(size * direction)
                # In the variable's dtype, x + step - (x - step) need not be
                # 2 * step exactly: divide by the step actually taken.
                taken = abs(complex((base + step)[idx] - (base - step)[idx]))
                plus = _evaluate(fn, state, source, step)
                minus = _evaluate(fn, state, source, -step)
                return plus, minus, (plus - minus) / taken

            plus, minus, coarse = difference(delta)
            # TensorFlow's gradient by a complex z is dL/dRe z + i dL/dIm z.
            if not extrapolate:
                grad[idx] += direction * coarse
                continue
            half_plus, half_minus, fine = difference(delta / 2)
            grad[idx] += direction * (fine + (fine - coarse) / 3.0)
            fourth = abs(plus - 4.0 * half_plus + 6.0 * centre - 4.0 * half_minus + minus)
            largest = max(abs(plus), abs(minus), abs(half_plus), abs(half_minus), abs(centre))
            noise = max(fourth, _ROUNDING_ULPS * eps * largest) / delta
            error[idx] += 2.0 * abs(fine - coarse) + noise
            rounding[idx] += _ROUNDING_ULPS * eps * largest / delta
    return Estimate(grad, error, rounding)


def estimates(
    fn: Callable[[], Any], sources: List[Source], state: SavedState, delta: Optional[float]
) -> List[Estimate]:
    """``check_gradients``' differences: each source's extrapolated
    derivative and its error bound, from the saved state (restored after).
    ``delta`` None: ``default_step`` of each source's dtype.

    ``fn`` runs from the saved state once before the differences and once
    after: if the two values differ by more than rounding, ``fn`` depends on
    something not put back between runs (Python state, a variable written
    out of sight, randomness) and the differences mean nothing: raises
    ``AssertionError`` rather than compare with them."""
    try:
        before = _base_value(fn, state)
        found = [
            _estimate(fn, state, source, default_step(source.variable.dtype) if delta is None else delta, True)
            for source in sources
        ]
        after = _base_value(fn, state)
    finally:
        state.restore()
    value, eps = before
    if abs(after[0] - value) > _ROUNDING_ULPS * eps * max(abs(value), abs(after[0])):
        raise AssertionError(
            f"finite differences are unreliable here: fn() run twice from the same saved state gave {value!r} "
            f"then {after[0]!r}. Its value depends on state that is not put back between runs (Python "
            "state, a variable written where no AssignAwareTape sees it, random ops): make fn a function of "
            "its variables alone (seed random ops; keep counters in tf.Variables that fn writes)."
        )
    return found


def _base_value(fn: Callable[[], Any], state: SavedState) -> Tuple[float, float]:
    """``fn()`` from the saved state, and the machine epsilon of its dtype."""
    state.restore()
    result = fn()
    value = scalar_value(result)
    dtype = tf.as_dtype(tf.convert_to_tensor(result).dtype)
    return value, float(np.finfo(dtype.as_numpy_dtype).eps) if dtype.is_floating else 0.0


def default_step(dtype: Any) -> float:
    """``check_gradients``' step: 1e-3 in double precision; 1e-2 in single or
    half, where the rounding noise, divided by the step, would otherwise
    swamp the derivative (the extrapolation keeps the truncation error small)."""
    return 1e-3 if float(np.finfo(dtype.as_numpy_dtype).eps) < 1e-10 else 1e-2


def numerical_gradient(fn: Callable[[], Any], sources: Any, *, delta: float = 1e-3) -> List[np.ndarray]:
    """Central finite differences of ``fn()`` with respect to each source.

    ``fn`` may write variables. It runs once first under an ``AssignAwareTape``
    to find which variables it writes (the tape's ``history()``); every one of
    them, and every source, is then written back to its value from before that
    run before each evaluation, and after the last one, also when ``fn`` or
    the check raises.

    The differences are taken in each variable's own dtype. In float32 they are
    good to about two or three digits at best; check in float64.

    Args:
      fn: A callable with no arguments that returns a real scalar tensor.
      sources: A variable (``tf.Variable`` or Keras 3 variable), a version
        handle from ``AssignAwareTape.versions(v)``, or a list or tuple of them.
        A variable means its value before ``fn`` runs. A handle means the value
        right after the write that made it (version ``k`` of ``v``: after
        ``fn``'s ``k``-th write to ``v``); the tape that gave it must still be
        alive, and should have run ``fn`` alone.
      delta: The step of the central differences.

    Returns:
      One NumPy array per source, in the variable's shape and dtype. For a
      complex variable, ``dL/dRe + i dL/dIm``, as TensorFlow's gradients are.

    Raises:
      TypeError: ``fn`` is not callable, returns something other than a
        tensor, or a source is not a variable or version handle.
      ValueError: ``fn`` returns a non-scalar or complex value, or a version
        source names a write that ``fn`` does not make.
      Exception: whatever ``fn`` raises, after every variable is restored.

    Example:

    >>> w = tf.Variable([1.0, 2.0], dtype=tf.float64)
    >>> def fn():
    ...     _ = w.assign(w * 3.0)
    ...     return tf.reduce_sum(w ** 2)
    >>> [g.round(4).tolist() for g in numerical_gradient(fn, [w])]
    [[18.0, 36.0]]
    >>> w.numpy().tolist()                   # put back
    [1.0, 2.0]
    """
    resolved, state = probed(fn, sources)
    try:
        return [_estimate(fn, state, source, delta, False).value for source in resolved]
    finally:
        state.restore()


def probed(fn: Any, sources: Any) -> Tuple[List[Source], SavedState]:
    """Checks ``fn`` and ``sources``, runs ``fn`` once under a tape to save
    every variable it writes, and puts them back. Raises (everything restored)
    on bad input or if ``fn`` raises."""
    require_callable(fn)
    resolved = resolve_sources(sources)
    state = SavedState()
    for source in resolved:
        state.save(source.variable)
    try:
        result, tape = probe(fn, state)
        scalar_value(result)
        check_versions_exist(resolved, tape)
        # A closed tape that is still alive keeps every patch awake: let it go.
        del tape
    finally:
        state.restore()
    return resolved, state
