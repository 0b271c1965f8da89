"""Run in a fresh process (logical devices must be set before TensorFlow
starts): ``unroll`` of steps whose update goes through ``merge_call`` under
MirroredStrategy on two logical CPUs, a tape in each replica, eager and
compiled; and the same loop without ``unroll``. Steps: a Keras 3
``SGD(momentum)`` step, and a ``merge_call`` of one's own updating a
MirroredVariable. Prints one JSON line: per step and mode, per replica
d val / d lr and w's components after, for "loop" and "unroll" (or the
error)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

W0 = [[0.5], [-0.3], [0.2]]


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    from assigntape import AssignAwareTape, unroll

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w, lr = tf.Variable(W0), tf.Variable(0.05)
        opt = keras.optimizers.SGD(learning_rate=lambda: lr, momentum=0.9)
        opt.build([w])
    x = tf.constant([[1.0, 2.0, 0.5], [0.3, -1.0, 2.0]])
    y = tf.constant([[1.0], [-1.0]])

    def keras_step() -> None:
        with tf.GradientTape() as inner:
            loss = tf.reduce_mean((x @ w - y) ** 2)
        opt.apply_gradients([(inner.gradient(loss, w), w)])

    def merge_step() -> None:
        g = 2.0 * w

        def update(strategy: Any, grad: Any) -> None:
            mean = strategy.extended.reduce_to(tf.distribute.ReduceOp.MEAN, grad, w)
            strategy.extended.update(w, lambda v, a: v.assign_sub(lr * a), args=(mean,))

        tf.distribute.get_replica_context().merge_call(update, args=(g,))

    def run(step: Any, wrap: bool, compiled: bool) -> Any:
        with strategy.scope():
            w.assign(W0)
            for v in opt.variables:
                v.assign(tf.zeros_like(v))

        def replica() -> Any:
            with AssignAwareTape() as tape:
                if wrap:
                    unroll(step, 3, checkpoint_every=2)
                else:
                    for _ in range(3):
                        step()
                val = tf.reduce_sum(w**2)
            return tape.gradient(val, lr)

        try:
            grads = strategy.run(tf.function(replica) if compiled else replica)
        except Exception as error:  # noqa: BLE001 - reported, the test shows it
            return f"{type(error).__name__}: {str(error)[-400:]}"
        return {
            "d_lr": [float(g) for g in strategy.experimental_local_results(grads)],
            "w": [c.numpy().ravel().tolist() for c in strategy.experimental_local_results(w)],
        }

    out: Dict[str, Any] = {}
    for step in (keras_step, merge_step):
        for compiled in (False, True):
            key = f"{step.__name__} {'compiled' if compiled else 'eager'}"
            out[key] = {"loop": run(step, False, compiled), "unroll": run(step, True, compiled)}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
