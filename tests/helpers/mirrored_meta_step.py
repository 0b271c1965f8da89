"""Run in a fresh process (logical devices must be set before TensorFlow starts):
a Meta-SGD-style step under MirroredStrategy on two logical CPUs, each replica on
its own task. Prints one JSON line: see ``run_step``, which the multi-worker
helper runs too."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from assigntape import AssignAwareTape  # noqa: E402

W0 = [1.0, 2.0]
TASKS = [[0.5, 1.5], [-1.0, 0.25]]  # one per replica


def run_step(strategy: tf.distribute.Strategy, **w_kwargs) -> dict:
    """The step, eager and compiled, under ``strategy``: per mode, per replica
    [d/d lr, d/d w0], and each local replica's component of w after the step.
    ``w_kwargs`` (synchronization, aggregation) go to w's constructor."""
    with strategy.scope():
        w = tf.Variable(W0, **w_kwargs)
        lr = tf.Variable(0.1)

    def step(x):
        with AssignAwareTape() as outer:
            outer.watch(w)  # an ON_READ variable is not trainable, so not watched on read
            with tf.GradientTape() as inner:
                inner.watch(w)
                inner_loss = tf.reduce_sum((w * x) ** 2)
            w.assign_sub(lr * inner.gradient(inner_loss, w))
            outer_loss = tf.reduce_sum((w * x - 1.0) ** 2)
        return outer.gradient(outer_loss, [lr, w])

    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(TASKS[ctx.replica_id_in_sync_group])
    )
    out = {}
    for mode, fn in [("eager", step), ("function", tf.function(step))]:
        for component in strategy.experimental_local_results(w):
            component.assign(W0)  # every replica starts from the same weights
        d_lr, d_w = strategy.run(fn, args=(xs,))
        out[mode] = {
            "grads": [
                [float(r_lr), [float(v) for v in r_w]]
                for r_lr, r_w in zip(
                    strategy.experimental_local_results(d_lr), strategy.experimental_local_results(d_w)
                )
            ],
            # Across all replicas, on every worker: the mean meta-gradient.
            "mean_d_lr": float(strategy.reduce(tf.distribute.ReduceOp.MEAN, d_lr, axis=None)),
            "components": [[float(v) for v in c.numpy()] for c in strategy.experimental_local_results(w)],
        }
    return out


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    print(json.dumps(run_step(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))))


if __name__ == "__main__":
    sys.exit(main())
