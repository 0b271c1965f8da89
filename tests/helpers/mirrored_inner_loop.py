"""Run in a fresh process (logical devices must be set before TensorFlow
starts): an inner loop of two optimizer steps in ONE tape, in replica context
under MirroredStrategy on two logical CPUs, eager and compiled, for
optimizers with slots (Keras 3, tf_keras legacy, ``tf.compat.v1.train``) and
a single Keras AdamW step; the same on one device with the replicas'
objectives summed; and, for Keras SGD with Nesterov momentum, the rewrite
(tensors, no variables, a plain tape). Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from helpers.mirrored_optimizers import TASKS, W0, _build, _outcome, optimizers  # noqa: E402

LR0 = 0.1
MOMENTUM = 0.9


def inner_loop_optimizers(lr: Any) -> Dict[str, Tuple[Callable[[], Any], int]]:
    """name -> (the optimizer, how many steps in the tape)."""
    import keras

    made = optimizers(lr)
    chosen = {
        name: (made[name], 2)
        for name in (
            "SGD_momentum",
            "Adam",
            "RMSprop",
            "legacy_SGD_momentum",
            "legacy_Adam",
            "legacy_RMSprop",
            "v1_Momentum",
            "v1_Adam",
        )
    }
    # One step: AdamW failed at its first (its weight decay writes before the update).
    chosen["AdamW"] = (lambda: keras.optimizers.AdamW(learning_rate=lambda: lr * 1.0, weight_decay=0.05), 1)
    return chosen


def _loop(optimizer: Any, w: Any, xs: List[Any], steps: int) -> Any:
    """The inner loop and the validation loss after it, in the caller's tape.
    A loss-scaling optimizer scales the loss (Keras 3's ``scale_loss``)."""
    scale = getattr(optimizer, "scale_loss", lambda loss: loss)
    for _ in range(steps):
        with tf.GradientTape() as inner:
            loss = scale(sum(tf.reduce_sum((w * x) ** 2) for x in xs))
        optimizer.apply_gradients([(inner.gradient(loss, w), w)])
    return sum(tf.reduce_sum((w * x - 1.0) ** 2) for x in xs)


def single_device(make: Callable[[Any], Any], steps: int) -> List[Any]:
    """[d/d lr, d/d w, w after] of the replicas' summed objective, one device;
    ``make(lr)`` the optimizer."""
    from assigntape import AssignAwareTape

    w, lr = tf.Variable(W0), tf.Variable(LR0)
    optimizer = make(lr)
    _build(optimizer, [w])
    with AssignAwareTape() as outer:
        val = _loop(optimizer, w, [tf.constant(x) for x in TASKS], steps)
    d_lr, d_w = outer.gradient(val, [lr, w])
    return [float(d_lr), d_w.numpy().tolist(), w.numpy().tolist()]


def sgd_momentum_rewrite() -> List[Any]:
    """The rewrite of Keras 3 SGD(momentum=0.9, nesterov=True), two steps on
    the summed objective: each write rebinds a tensor (keras/optimizers/sgd.py:
    m = m * momentum - g * lr; w = w + (m * momentum - g * lr))."""
    lr, w = tf.constant(LR0), tf.constant(W0)
    with tf.GradientTape() as outer:
        outer.watch([lr, w])
        v, m = w, tf.zeros_like(w)
        for _ in range(2):
            with tf.GradientTape() as inner:
                inner.watch(v)
                loss = sum(tf.reduce_sum((v * tf.constant(x)) ** 2) for x in TASKS)
            g = inner.gradient(loss, v)
            m = m * MOMENTUM - g * lr
            v = v + (m * MOMENTUM - g * lr)
        val = sum(tf.reduce_sum((v * tf.constant(x) - 1.0) ** 2) for x in TASKS)
    d_lr, d_w = outer.gradient(val, [lr, w])
    return [float(d_lr), d_w.numpy().tolist(), v.numpy().tolist()]


def mirrored(strategy: Any, make: Callable[[Any], Any], steps: int, compiled: bool) -> List[Any]:
    """[sum over replicas of d/d lr, of d/d w, each component after]."""
    from assigntape import AssignAwareTape

    with strategy.scope():
        w, lr = tf.Variable(W0), tf.Variable(LR0)
        optimizer = make(lr)
        _build(optimizer, [w])
    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(TASKS[ctx.replica_id_in_sync_group])
    )

    def step(x: Any) -> Any:
        with AssignAwareTape() as outer:
            val = _loop(optimizer, w, [x], steps)
        return outer.gradient(val, [lr, w])

    d_lr, d_w = strategy.run(tf.function(step) if compiled else step, args=(xs,))
    lrs, ws = strategy.experimental_local_results(d_lr), strategy.experimental_local_results(d_w)
    if any(g is None for g in lrs + ws):
        raise AssertionError(f"a replica's meta-gradient is None: {lrs}, {ws}")
    return [
        sum(float(g) for g in lrs),
        tf.add_n(list(ws)).numpy().tolist(),
        [c.numpy().tolist() for c in strategy.experimental_local_results(w)],
    ]


def report(
    cases: Callable[[Any], Dict[str, Tuple[Callable[[], Any], int]]], rewrites: Callable[[], Dict[str, Any]]
) -> None:
    """Prints ``rewrites()`` with, for each case of ``cases(lr)``, one device's
    results and MirroredStrategy's on two logical CPUs, eager and compiled."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = rewrites()
    for name, (_, steps) in cases(None).items():
        make = lambda lr: cases(lr)[name][0]()  # noqa: E731
        out[name] = {"single": single_device(make, steps)}
        for mode in ("eager", "compiled"):
            out[name][mode] = _outcome(lambda: mirrored(strategy, make, steps, mode == "compiled"))
    print(json.dumps(out))


def main() -> None:
    report(inner_loop_optimizers, lambda: {"rewrite_SGD_momentum": sgd_momentum_rewrite()})


if __name__ == "__main__":
    sys.exit(main())
