"""Run in a fresh process (logical devices must be set before TensorFlow
starts): a Meta-SGD-style step under CentralStorageStrategy over two logical
CPUs, whose variables are ``AggregatingVariable``s kept on one device. Prints
one JSON line: per mode (eager, compiled), [d/d lr, d/d w0, w after], and what
a write in replica context raised."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

W0 = [1.0, 2.0]
X = [0.5, 1.5]
LR = 0.1


def step(w: Any, lr: Any, x: Any) -> Any:
    from assigntape import AssignAwareTape

    with AssignAwareTape() as outer:
        with tf.GradientTape() as inner:
            inner_loss = tf.reduce_sum((w * x) ** 2)
        w.assign_sub(lr * inner.gradient(inner_loss, w))
        outer_loss = tf.reduce_sum((w * x - 1.0) ** 2)
    return outer.gradient(outer_loss, [lr, w])


def keras_step(v: Any, optimizer: Any, lr: Any, x: Any) -> Any:
    """``step`` with the optimizer's update in place of the assign_sub."""
    from assigntape import AssignAwareTape
    from helpers.mirrored_inner_loop import _loop

    with AssignAwareTape() as outer:
        val = _loop(optimizer, v, [x], 1)
    return outer.gradient(val, [lr, v])


def _call(f: Any) -> Any:
    return f()


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w, lr = tf.Variable(W0), tf.Variable(LR)
        # Written in replica context, an aggregated variable is a cross-replica update.
        w_mean = tf.Variable(W0, aggregation=tf.VariableAggregation.MEAN)
    x = tf.constant(X)
    out: Dict[str, Any] = {"type": type(w).__name__}
    for mode, fn in (("eager", step), ("function", tf.function(step))):
        w.assign(W0)
        d_lr, d_w = fn(w, lr, x)
        out[mode] = [float(d_lr), d_w.numpy().tolist(), w.numpy().tolist()]
    try:
        strategy.run(tf.function(lambda: step(w_mean, lr, x)))
        out["replica"] = {"error": None}
    except Exception as error:  # noqa: BLE001 - reported to the test
        out["replica"] = {"error": type(error).__name__, "message": str(error)[:1500]}
    # A Keras optimizer step (Keras 3, tf_keras legacy) in a replica's tape,
    # and, what the refusal says works, in cross-replica context.
    import keras
    import tf_keras

    out["keras_step"] = {}
    for name, make in (("SGD", keras.optimizers.SGD), ("legacy_SGD", tf_keras.optimizers.legacy.SGD)):
        for mode, run in (("replica", strategy.run), ("eager", _call), ("function", lambda f: tf.function(f)())):
            with strategy.scope():
                v = tf.Variable(W0)
                optimizer = make(learning_rate=lambda: lr * 1.0)
            try:
                d_lr, d_w = run(functools.partial(keras_step, v, optimizer, lr, x))
                got: Any = [float(d_lr), d_w.numpy().tolist(), v.numpy().tolist()]
            except Exception as error:  # noqa: BLE001 - reported to the test
                got = {"error": type(error).__name__, "message": str(error)[:1500], "w": v.numpy().tolist()}
            out["keras_step"].setdefault(name, {})[mode] = got
    print(json.dumps(out))


if __name__ == "__main__":
    main()
