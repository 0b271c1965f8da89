"""``check_gradients``: the tape's gradients against finite differences."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from assigntape._tape import AssignAwareTape
from assigntape.testing._numerical import Estimate, estimates, probed, scalar_value
from assigntape.testing._sources import Source

__all__ = ["check_gradients", "mismatch_table"]

# The tape's own rounding, in units in the last place of the largest entry of
# a source's gradient: what an exact gradient computed in the variable's
# precision may still differ by.
_TAPE_ULPS = 64
# In single or half precision, a value rounded at the scale of an
# intermediate far larger than the loss (a small version plus a constant,
# then minus it) puts noise into the differences that neither their fourth
# difference nor the loss's own rounding need show: they are trusted only to
# this fraction of the gradient's largest entry (a wrong factor is caught;
# a small dropped term needs float64).
_LOW_PRECISION_FLOOR = 0.05


# An estimate whose error bound is more than this fraction of the gradient's
# scale, and more than ``_NOT_ROUNDING`` times what rounding explains, says
# nothing: fn is not smooth at the point, or changes between runs. A
# gradient that agrees with it only within that bound is not passed.
_UNRELIABLE = 0.5
_NOT_ROUNDING = 1000.0


def _as_array(g: Any) -> Optional[np.ndarray]:
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        g = tf.convert_to_tensor(g)
    return np.array(g)


def _analytic(fn: Callable[[], Any], sources: List[Source], compiled: bool) -> List[Optional[np.ndarray]]:
    """The ``AssignAwareTape`` gradients of ``fn()`` (from the present state)."""

    def body() -> Tuple[Any, Any]:
        with AssignAwareTape() as tape:
            loss = fn()
        targets = [s.variable if s.version == 0 else tape.versions(s.variable)[s.version] for s in sources]
        return loss, tape.gradient(loss, targets)

    loss, grads = tf.function(body)() if compiled else body()
    scalar_value(loss)
    return [_as_array(g) for g in grads]


def allowed(source: Source, estimate: Estimate, analytic: Optional[np.ndarray], rtol: float, atol: float) -> np.ndarray:
    """How far the tape's gradient may be from the differences, element by
    element: their error bound, the tape's own rounding relative to the
    gradient's scale (the largest entry of either answer), in single or half precision
    ``_LOW_PRECISION_FLOOR`` of that scale, and the caller's ``atol`` and
    ``rtol``."""
    numeric = np.abs(estimate.value)
    eps = float(np.finfo(source.variable.dtype.as_numpy_dtype).eps)
    scale = _scale(numeric, analytic)
    floor = _TAPE_ULPS * eps + (_LOW_PRECISION_FLOOR if eps > 1e-10 else 0.0)
    bound: np.ndarray = estimate.error + floor * scale + atol + rtol * numeric
    return bound


def _scale(numeric: np.ndarray, analytic: Optional[np.ndarray]) -> float:
    """The gradient's scale: the larger of the two answers' largest finite
    entries (an infinite one would allow every entry an infinite error)."""
    entries = [np.abs(numeric)] if analytic is None else [np.abs(numeric), np.abs(analytic)]
    return max((float(np.max(e[np.isfinite(e)], initial=0.0)) for e in entries), default=0.0)


def _unlike_non_finite(analytic: np.ndarray, numeric: np.ndarray) -> np.ndarray:
    """Where either answer is not finite and they are not the same value
    (the same infinity, or both NaN): a mismatch whatever the tolerance."""
    same = (analytic == numeric) | (np.isnan(analytic) & np.isnan(numeric))
    unlike: np.ndarray = (~np.isfinite(analytic) | ~np.isfinite(numeric)) & ~same
    return unlike


def _row(
    source: Source, analytic: Optional[np.ndarray], estimate: Estimate, tolerance: np.ndarray
) -> Optional[List[str]]:
    """The table row of a mismatching source, else None."""
    numeric = estimate.value
    if analytic is None:
        measured = np.where(np.isfinite(numeric), np.abs(numeric), np.inf)
        if not np.any(measured > tolerance):
            return None  # no path, and none measured
        where = np.unravel_index(int(np.argmax(measured)), numeric.shape) if numeric.ndim else ()
        return [
            source.name,
            "inf",
            "inf",
            str(tuple(int(i) for i in where)),
            "None",
            _num(numeric[where]),
            f"{float(tolerance[where]):.3g}",
        ]
    analytic = np.broadcast_to(analytic, numeric.shape)
    unlike = _unlike_non_finite(analytic, numeric)
    with np.errstate(invalid="ignore"):
        error = np.where(unlike, np.inf, np.abs(analytic - numeric))
    error = np.where(np.isnan(error), 0.0, error)  # (both NaN: alike)
    if not np.any(error > tolerance):
        return None
    relative = error / np.maximum(np.abs(numeric), np.finfo(np.float64).tiny)
    flat = int(np.argmax(error))
    where = np.unravel_index(flat, numeric.shape) if numeric.ndim else ()
    return [
        source.name,
        f"{float(np.nanmax(error)):.3g}",
        f"{float(np.nanmax(relative)):.3g}",
        str(tuple(int(i) for i in where)),
        _num(analytic[where]),
        _num(numeric[where]),
        f"{float(tolerance[where]):.3g}",
    ]


def _unreliable(
    source: Source, analytic: Optional[np.ndarray], estimate: Estimate, tolerance: np.ndarray
) -> Optional[str]:
    """Why the differences cannot check ``source``'s gradient, if an entry
    agrees with them only within an error bound that says nothing."""
    numeric = estimate.value
    tape = np.zeros(numeric.shape) if analytic is None else np.broadcast_to(analytic, numeric.shape)
    with np.errstate(invalid="ignore"):
        gap = np.abs(tape - numeric)
    scale = _scale(numeric, analytic)
    rescued = (gap > tolerance - estimate.error) & (gap <= tolerance)
    large = (estimate.error > _UNRELIABLE * scale) & (estimate.error > _NOT_ROUNDING * estimate.rounding)
    hits = np.argwhere(rescued & large)
    if not len(hits):
        return None
    where = tuple(int(i) for i in hits[0])
    return (
        f"source {source.name!r} at index {where}: the tape gives {_num(tape[where])}, the differences "
        f"{_num(numeric[where])} with an error bound of {float(estimate.error[where]):.3g} (the gradient's "
        f"scale is {scale:.3g})"
    )


def _num(x: Any) -> str:
    return f"{complex(x):.6g}" if np.iscomplexobj(x) else f"{float(x):.6g}"


def mismatch_table(rows: Sequence[Sequence[str]]) -> str:
    header = ["source", "max abs error", "max rel error", "at index", "tape", "numerical", "allowed"]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def check_gradients(
    fn: Callable[[], Any],
    sources: Any,
    *,
    delta: Optional[float] = None,
    rtol: float = 0.0,
    atol: float = 0.0,
    compiled: bool = False,
) -> Tuple[List[Optional[np.ndarray]], List[np.ndarray]]:
    """Checks the ``AssignAwareTape`` gradients of ``fn()`` against finite differences.

    ``fn`` runs under an ``AssignAwareTape`` and the tape's gradients with
    respect to ``sources`` are compared with finite differences, element by
    element. The differences are Richardson's extrapolation of central
    differences with steps ``delta`` and ``delta / 2`` (truncation error
    O(delta^4)), and the tolerance comes from their own error estimate:
    twice the gap between the two steps' central differences, plus the
    rounding noise of ``fn``'s values (measured by their fourth difference,
    and at least a few units in the last place) divided by the step, plus the
    tape's rounding relative to the gradient's scale (its largest entry),
    plus the caller's ``atol + rtol * |numerical|``. So a gradient that is
    off by a small term (a dropped second-order path, 1e-4 relative) fails
    in float64, and a gradient off by a factor fails whatever its scale (a
    loss of 1e-6). A ``None`` gradient passes only where the differences are
    zero within that tolerance. Every variable ``fn`` writes (also in a
    ``tf.function`` it calls, whatever its dtype), and every source, is
    written back to its value from before the call, also on failure.

    Check in float64: in float32 (or half precision), the rounding noise
    divided by the step leaves two or three digits at best, so the tolerance
    there is at least 5% of the gradient's largest entry: enough to catch a
    wrong factor, not a small dropped term.

    Args:
      fn: A callable with no arguments that returns a real scalar tensor. It
        may write variables; it is called under the tape (do not open the tape
        in it). A ``tf.function`` it calls must not write floating-point
        variables: an eager tape refuses that (``UntrackedWriteError``).
      sources: As for ``numerical_gradient``: variables (their values before
        ``fn`` runs) and version handles from ``AssignAwareTape.versions``.
      delta: The larger step of the differences; None: 1e-3 for 64-bit
        variables, 1e-2 for 32- and 16-bit ones.
      rtol: Extra relative tolerance, on top of the estimated one.
      atol: Extra absolute tolerance, on top of the estimated one.
      compiled: Run the tape and ``fn`` inside one ``tf.function`` (traced
        afresh), instead of eagerly. The differences are always eager.

    Returns:
      ``(analytic, numeric)``: lists with one NumPy array per source (``None``
      where the tape has no gradient) and one per source (the extrapolated
      differences).

    Raises:
      AssertionError: a gradient differs; the message is a table with each
        failing source's name, its largest absolute and relative errors, the
        index where the largest absolute error is, and the error allowed there.
        Also when the differences cannot be trusted ("finite differences are
        unreliable here: ..."): ``fn`` gives another value when run again
        from the same state, or an entry agrees only within an error bound
        larger than half the gradient's scale. A non-finite entry fails
        unless both answers hold the same value there.
      TypeError, ValueError: as ``numerical_gradient``.

    Example:

    >>> a, c = tf.Variable(2.0, dtype=tf.float64), tf.Variable(0.0, dtype=tf.float64)
    >>> def fn():
    ...     _ = c.assign(a * a)
    ...     return c * 3.0
    >>> analytic, numeric = check_gradients(fn, [a])
    >>> float(analytic[0]), round(float(numeric[0]), 4)
    (12.0, 12.0)
    """
    resolved, state = probed(fn, sources)
    try:
        analytic = _analytic(fn, resolved, compiled)
    finally:
        state.restore()
    found = estimates(fn, resolved, state, delta)
    tolerances = [allowed(s, e, a, rtol, atol) for s, e, a in zip(resolved, found, analytic)]
    unreliable = [u for u in map(_unreliable, resolved, analytic, found, tolerances) if u is not None]
    if unreliable:
        raise AssertionError(
            "finite differences are unreliable here: "
            + "; ".join(unreliable)
            + ". fn is not smooth at this point, or its value depends on state that is not put back between "
            "runs; the check cannot pass on them. Check at another point, with a smaller delta, or in float64."
        )
    rows = [r for r in map(_row, resolved, analytic, found, tolerances) if r is not None]
    if rows:
        raise AssertionError(
            "AssignAwareTape gradients differ from finite differences by more than their estimated "
            f"error (extra rtol={rtol}, atol={atol}, delta={delta}):\n" + mismatch_table(rows)
        )
    return analytic, [e.value for e in found]
