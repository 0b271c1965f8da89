"""``check_gradients``: the tape's gradients against finite differences."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from assigntape._tape import AssignAwareTape
from assigntape.testing._numerical import numerical_gradient, probed, scalar_value
from assigntape.testing._sources import Source

__all__ = ["check_gradients", "mismatch_table"]


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


def _row(source: Source, analytic: Optional[np.ndarray], numeric: np.ndarray, rtol: float, atol: float) -> Optional[List[str]]:
    """The table row of a mismatching source, else None."""
    if analytic is None:
        if not np.any(np.abs(numeric) > atol):
            return None  # no path, and none measured
        where = np.unravel_index(int(np.argmax(np.abs(numeric))), numeric.shape) if numeric.ndim else ()
        return [source.name, "inf", "inf", str(tuple(int(i) for i in where)), "None", _num(numeric[where])]
    analytic = np.broadcast_to(analytic, numeric.shape)
    error = np.abs(analytic - numeric)
    bad = error > atol + rtol * np.abs(numeric)
    if not np.any(bad) and not np.any(np.isnan(analytic) != np.isnan(numeric)):
        return None
    relative = error / np.maximum(np.abs(numeric), np.finfo(np.float64).tiny)
    flat = int(np.nanargmax(np.where(np.isnan(error), np.inf, error)))
    where = np.unravel_index(flat, numeric.shape) if numeric.ndim else ()
    return [
        source.name,
        f"{float(np.nanmax(error)):.3g}",
        f"{float(np.nanmax(relative)):.3g}",
        str(tuple(int(i) for i in where)),
        _num(analytic[where]),
        _num(numeric[where]),
    ]


def _num(x: Any) -> str:
    return f"{complex(x):.6g}" if np.iscomplexobj(x) else f"{float(x):.6g}"


def mismatch_table(rows: Sequence[Sequence[str]]) -> str:
    header = ["source", "max abs error", "max rel error", "at index", "tape", "numerical"]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def check_gradients(
    fn: Callable[[], Any],
    sources: Any,
    *,
    delta: float = 1e-3,
    rtol: float = 1e-3,
    atol: float = 1e-5,
    compiled: bool = False,
) -> Tuple[List[Optional[np.ndarray]], List[np.ndarray]]:
    """Checks the ``AssignAwareTape`` gradients of ``fn()`` against finite differences.

    ``fn`` runs under an ``AssignAwareTape`` and the tape's gradients with
    respect to ``sources`` are compared with ``numerical_gradient(fn, sources,
    delta=delta)``, element by element: ``|tape - numerical| <= atol + rtol *
    |numerical|``. A ``None`` gradient passes only where the numerical one is
    zero (within ``atol``). Every variable ``fn`` writes, and every source, is
    written back to its value from before the call, also on failure.

    Use float64 variables: in float32 the differences are good to two or three
    digits at best.

    Args:
      fn: A callable with no arguments that returns a real scalar tensor. It
        may write variables; it is called under the tape (do not open the tape
        in it). A ``tf.function`` it calls must not write floating-point
        variables: an eager tape refuses that (``UntrackedWriteError``).
      sources: As for ``numerical_gradient``: variables (their values before
        ``fn`` runs) and version handles from ``AssignAwareTape.versions``.
      delta: The step of the central differences.
      rtol: Relative tolerance.
      atol: Absolute tolerance.
      compiled: Run the tape and ``fn`` inside one ``tf.function`` (traced
        afresh), instead of eagerly. The differences are always eager.

    Returns:
      ``(analytic, numeric)``: lists with one NumPy array per source (``None``
      where the tape has no gradient) and one per source.

    Raises:
      AssertionError: a gradient differs; the message is a table with each
        failing source's name, its largest absolute and relative errors, and
        the index where the largest absolute error is.
      TypeError, ValueError: as ``numerical_gradient``.

    Example:

    >>> a, c = tf.Variable(2.0, tf.float64), tf.Variable(0.0, tf.float64)
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
    numeric = numerical_gradient(fn, sources, delta=delta)
    rows = [r for r in (_row(s, a, n, rtol, atol) for s, a, n in zip(resolved, analytic, numeric)) if r is not None]
    if rows:
        raise AssertionError(
            f"AssignAwareTape gradients differ from finite differences (rtol={rtol}, atol={atol}, "
            f"delta={delta}):\n" + mismatch_table(rows)
        )
    return analytic, numeric
