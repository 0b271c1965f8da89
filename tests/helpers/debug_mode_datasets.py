"""Run in a fresh process (tf.data's debug mode is for the whole process and
cannot be turned off): with ``enable_debug_mode()`` a dataset's functions run
as Python, in tf.data's threads. A map that writes ``v`` is refused whether
or not the tape read ``v`` first; one that only reads gives the plain tape's
gradient. Prints one JSON line: for each writing case, the error raised (or
"none"); for the quiet case, the gradient and the one by hand."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from assigntape import AssignAwareTape  # noqa: E402

V0 = np.array([1.5, -0.5, 2.0])
E = 1.25


def main() -> None:
    tf.data.experimental.enable_debug_mode()
    out: Dict[str, Any] = {}
    for case in ("unread", "read"):
        v = tf.Variable(V0, dtype=tf.float64, name="v_written")
        ds = tf.data.Dataset.from_tensors(tf.constant(E, tf.float64)).map(lambda e: (v.assign(v * e), e)[1])
        error = "none"
        with AssignAwareTape() as tape:
            before = tf.reduce_sum(v) if case == "read" else tf.constant(0.0, tf.float64)
            try:
                next(iter(ds))
            except Exception as caught:  # noqa: BLE001 - reported by name
                error = type(caught).__name__
        out[case] = error
        del tape, before
    # y = sum(v * e): dy/dv = e, by hand.
    v = tf.Variable(V0, dtype=tf.float64, name="v_read")
    quiet = tf.data.Dataset.from_tensors(tf.constant(E, tf.float64)).map(lambda e: e + 0.0 * v[0])
    with AssignAwareTape() as tape:
        e = next(iter(quiet))
        y = tf.reduce_sum(v * e)
    out["quiet"] = [[float(g) for g in tape.gradient(y, v).numpy()], [E] * 3]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
