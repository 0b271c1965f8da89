"""Run in a fresh process (logical devices must be set before TensorFlow
starts): a meta-step through Keras 3's ``LossScaleOptimizer`` in replica
context under MirroredStrategy on two logical CPUs. Its update runs in a
``merge_call`` that calls ``call_for_each_replica`` again (a second set of
replica threads). Eager: SGD one step against the rewrite, Adam two steps in
one tape against one device; compiled: what is raised. Prints one JSON line."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from helpers.mirrored_inner_loop import LR0, report  # noqa: E402
from helpers.mirrored_optimizers import TASKS, W0  # noqa: E402


def loss_scale_optimizers(lr: Any) -> Dict[str, Tuple[Callable[[], Any], int]]:
    """name -> (Keras 3 LossScaleOptimizer around it, how many steps in the tape)."""
    import keras

    rate = lambda: lr * 1.0  # noqa: E731
    return {
        "SGD": (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=rate)), 1),
        "Adam": (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(learning_rate=rate)), 2),
    }


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


def main() -> None:
    report(loss_scale_optimizers, lambda: {"rewrite_SGD": sgd_rewrite()})


if __name__ == "__main__":
    sys.exit(main())
