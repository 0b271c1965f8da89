"""Run in a fresh process (logical devices must be set before TensorFlow
starts): a meta-step through Keras 3's ``LossScaleOptimizer`` in replica
context under MirroredStrategy on two logical CPUs. Its update runs in a
``merge_call`` that calls ``call_for_each_replica`` again (a second set of
replica threads). Eager: SGD one step against the rewrite, Adam two steps in
one tape against one device; compiled: what is raised. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from helpers.mirrored_optimizers import TASKS, W0, _outcome  # noqa: E402

LR0 = 0.1


def _optimizer(name: str, lr: Any) -> Any:
    import keras

    inner = {
        "SGD": lambda: keras.optimizers.SGD(learning_rate=lambda: lr * 1.0),
        "Adam": lambda: keras.optimizers.Adam(learning_rate=lambda: lr * 1.0),
    }[name]()
    return keras.optimizers.LossScaleOptimizer(inner)


STEPS = {"SGD": 1, "Adam": 2}


def _loop(optimizer: Any, w: Any, xs: List[Any], steps: int) -> Any:
    for _ in range(steps):
        with tf.GradientTape() as inner:
            loss = optimizer.scale_loss(sum(tf.reduce_sum((w * x) ** 2) for x in xs))
        optimizer.apply_gradients([(inner.gradient(loss, w), w)])
    return sum(tf.reduce_sum((w * x - 1.0) ** 2) for x in xs)


def sgd_rewrite() -> List[Any]:
    """One SGD step on the summed objective, without variables: w1 = w0 - lr g
    (the loss scale multiplies the loss and divides the gradient)."""
    lr, w = tf.constant(LR0), tf.constant(W0)
    with tf.GradientTape() as outer:
        outer.watch([lr, w])
        with tf.GradientTape() as inner:
            inner.watch(w)
            loss = sum(tf.reduce_sum((w * tf.constant(x)) ** 2) for x in TASKS)
        w1 = w - lr * inner.gradient(loss, w)
        val = sum(tf.reduce_sum((w1 * tf.constant(x) - 1.0) ** 2) for x in TASKS)
    d_lr, d_w = outer.gradient(val, [lr, w])
    return [float(d_lr), d_w.numpy().tolist()]


def single_device(name: str) -> List[Any]:
    from assigntape import AssignAwareTape

    w, lr = tf.Variable(W0), tf.Variable(LR0)
    optimizer = _optimizer(name, lr)
    optimizer.build([w])
    with AssignAwareTape() as outer:
        val = _loop(optimizer, w, [tf.constant(x) for x in TASKS], STEPS[name])
    d_lr, d_w = outer.gradient(val, [lr, w])
    return [float(d_lr), d_w.numpy().tolist()]


def mirrored(strategy: Any, name: str, compiled: bool) -> List[Any]:
    """[sum over replicas of d/d lr, of d/d w]."""
    from assigntape import AssignAwareTape

    with strategy.scope():
        w, lr = tf.Variable(W0), tf.Variable(LR0)
        optimizer = _optimizer(name, lr)
        optimizer.build([w])
    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(TASKS[ctx.replica_id_in_sync_group])
    )

    def step(x: Any) -> Any:
        with AssignAwareTape() as outer:
            val = _loop(optimizer, w, [x], STEPS[name])
        return outer.gradient(val, [lr, w])

    d_lr, d_w = strategy.run(tf.function(step) if compiled else step, args=(xs,))
    lrs, ws = strategy.experimental_local_results(d_lr), strategy.experimental_local_results(d_w)
    if len(lrs) != 2 or any(g is None for g in lrs + ws):
        raise AssertionError(f"a replica's meta-gradient is None: {lrs}, {ws}")
    return [sum(float(g) for g in lrs), tf.add_n(list(ws)).numpy().tolist()]


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out: Dict[str, Any] = {"rewrite_SGD": sgd_rewrite()}
    for name in STEPS:
        out[name] = {"single": single_device(name)}
        for mode in ("eager", "compiled"):
            out[name][mode] = _outcome(lambda: mirrored(strategy, name, mode == "compiled"))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
