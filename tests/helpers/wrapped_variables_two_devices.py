"""The wrapped-variable program, and, run as a fresh process (logical devices
must be set before TensorFlow starts), that program on the
``AggregatingVariable``s a CentralStorageStrategy over two logical CPUs makes.
Prints one JSON line."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from assigntape import AssignAwareTape  # noqa: E402

W0, X0 = 1.25, 3.0
# y = 2 w0 + (w0 x)^2, w1 = w0 x: by hand.
EXPECTED: Dict[str, float] = {
    "in_source_w": 2 + 2 * W0 * X0 * X0,
    "in_source_x": 2 * W0 * W0 * X0,
    "in_target_x": W0,
    "in_target_w": X0,
}
EXPECTED.update({"after" + k[2:]: v for k, v in list(EXPECTED.items())})


def program(w: Any, x: Any) -> Dict[str, Any]:
    """Reads ``w``, writes it, reads it again; gradients with ``w`` as source
    and as target, asked inside the ``with`` and after it."""
    out: Dict[str, Any] = {}
    with AssignAwareTape(persistent=True) as tape:
        tape.watch(w)  # an ON_READ variable is not trainable
        y1 = w * 2.0
        w.assign(w * x)
        y = y1 + w * w
        out["in_source_w"], out["in_source_x"] = tape.gradient(y, [w, x])
        out["in_target_x"], out["in_target_w"] = tape.gradient(w, [x, w])
    out["after_source_w"], out["after_source_x"] = tape.gradient(y, [w, x])
    out["after_target_x"], out["after_target_w"] = tape.gradient(w, [x, w])
    return out


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    cases: Dict[str, Dict[str, float]] = {}
    kind = ""
    # Cross-replica context: in replica context, a write to an aggregated
    # variable is a cross-replica update (merge_call), which a replica's tape
    # refuses (README, "Known limits").
    runs = {
        "cross-replica-eager": lambda fn: fn(),
        "cross-replica-function": lambda fn: tf.function(fn)(),
    }
    for case, run in runs.items():
        with strategy.scope():
            w, x = tf.Variable(W0), tf.Variable(X0)
        kind = type(w).__name__
        got = run(lambda: program(w, x))
        cases[case] = {k: float(v) for k, v in got.items()}
    print(json.dumps({"type": kind, "cases": cases}))


if __name__ == "__main__":
    main()
