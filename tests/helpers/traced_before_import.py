"""Run in a fresh process (assigntape must not be imported yet): tf.functions
that pull from a dataset they captured, traced (and run) before
``import assigntape``, then called from an AssignAwareTape. Their traces
noted nothing, so the call scans the datasets (and the iterators) they
captured. Prints one JSON line: for each writing case, the error raised (or
"none") and whether ``v`` kept its value; for the quiet cases, the gradients
and the oracle's."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

V0 = np.array([1.5, -0.5, 2.0])
X0 = 0.7
E = 1.25


def _made(writes: bool) -> Tuple[tf.Variable, tf.Variable, Dict[str, Callable[[], Any]]]:
    v = tf.Variable(V0, dtype=tf.float64, name="v_written" if writes else "v_read")
    x = tf.Variable(X0, dtype=tf.float64, name="x_read")
    base = tf.data.Dataset.from_tensors(tf.constant(E, tf.float64)).repeat()
    if writes:
        ds = base.map(lambda e: (v.assign(v * x * e), e)[1])
    else:
        ds = base.map(lambda e: e * 1.0)
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_optimization.inject_prefetch = False
    ds = ds.with_options(options)

    @tf.function
    def reduce() -> Any:
        return ds.take(1).reduce(tf.constant(0.0, tf.float64), lambda s, e: s + e)

    @tf.function
    def next_of_new_iterator() -> Any:
        return next(iter(ds))

    @tf.function
    def loop() -> Any:
        total = tf.constant(0.0, tf.float64)
        for e in ds.take(1):
            total += e
        return total

    # An iterator made before the import too: a resource the function captured.
    iterator = iter(ds)

    @tf.function
    def next_of_captured_iterator() -> Any:
        return next(iterator)

    pulls = {
        "reduce": reduce,
        "next_of_new_iterator": next_of_new_iterator,
        "loop": loop,
        "next_of_captured_iterator": next_of_captured_iterator,
    }
    for pull in pulls.values():
        pull()  # traced and run before import assigntape
    v.assign(V0)
    return v, x, pulls


def main() -> None:
    writing = {case: _made(True) for case in ("reduce", "next_of_new_iterator", "loop", "next_of_captured_iterator")}
    v_read, x_read, quiet = _made(False)

    import assigntape  # noqa: F401  (after the traces)
    from assigntape import AssignAwareTape

    out: Dict[str, Any] = {}
    for case, (v, x, pulls) in writing.items():
        error = "none"
        with AssignAwareTape() as tape:
            before = tf.reduce_sum(v)
            try:
                pulls[case]()
            except Exception as caught:  # noqa: BLE001 - reported by name
                error = type(caught).__name__
        out[case] = [error, bool(np.array_equal(v.numpy(), V0))]
        del tape, before, x
    # A dataset that only reads: y = sum(v) * e * x, by hand dy/dx = sum(v) * e,
    # dy/dv = e * x.
    got: List[float] = []
    expected: List[float] = []
    for case in ("reduce", "next_of_captured_iterator"):
        with AssignAwareTape() as tape:
            e = quiet[case]()
            y = tf.reduce_sum(v_read) * e * x_read
        gx, gv = tape.gradient(y, [x_read, v_read])
        got += [float(gx)] + [float(g) for g in gv.numpy()]
        expected += [float(V0.sum() * E)] + [E * X0] * 3
    out["quiet"] = [got, expected]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
