"""Run in a fresh process (logical devices must be set before TensorFlow
starts): a ForwardAccumulator in a replica, around an all_reduce, with an
AssignAwareTape open inside or around it, under MirroredStrategy on two
logical CPUs, eager and compiled; and the same with a plain tf.GradientTape
in its place (no writes: the results must be TensorFlow's). Prints one JSON
line: per tape kind, nesting and mode, each replica's [jvp, gradient]."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from helpers.mirrored_optimizers import _outcome  # noqa: E402


def step(tape_class: Any, accumulator_outside: bool) -> Any:
    def run() -> Any:
        x = tf.constant(2.0)
        if accumulator_outside:
            with tf.autodiff.ForwardAccumulator(x, tf.constant(1.0)) as acc:
                with tape_class() as tape:
                    tape.watch(x)
                    y = tf.distribute.get_replica_context().all_reduce("SUM", x * x)
        else:
            with tape_class() as tape:
                tape.watch(x)
                with tf.autodiff.ForwardAccumulator(x, tf.constant(1.0)) as acc:
                    y = tf.distribute.get_replica_context().all_reduce("SUM", x * x)
        return acc.jvp(y), tape.gradient(y, x)

    return run


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    from assigntape import AssignAwareTape

    out: Dict[str, Any] = {}
    for kind, tape_class in (("aware", AssignAwareTape), ("plain", tf.GradientTape)):
        for outside in (False, True):
            for mode in ("eager", "compiled"):
                fn = step(tape_class, outside)

                def run() -> Any:
                    jvp, grad = strategy.run(tf.function(fn) if mode == "compiled" else fn)
                    return [
                        [float(j), float(g)]
                        for j, g in zip(
                            strategy.experimental_local_results(jvp), strategy.experimental_local_results(grad)
                        )
                    ]

                out[f"{kind} {'outside' if outside else 'inside'} {mode}"] = _outcome(run)
    out["keras_step"] = {
        mode: _outcome(lambda: keras_step(strategy, mode == "compiled")) for mode in ("eager", "compiled")
    }
    out["keras_step_data_tangent"] = {
        mode: _outcome(lambda: keras_step(strategy, mode == "compiled", along_data=True))
        for mode in ("eager", "compiled")
    }
    from helpers.mirrored_loss_scale import sgd_rewrite

    out["rewrite_d_lr"] = sgd_rewrite()[0]
    print(json.dumps(out))


def keras_step(strategy: Any, compiled: bool, along_data: bool = False) -> Any:
    """A Keras SGD meta-step in each replica with a ForwardAccumulator (lr,
    tangent 1) around the AssignAwareTape: each replica's [jvp, d/d lr].
    ``along_data``: the tangent is the replica's data ``x``'s (ones), which
    the all-reduced gradient depends on: [jvp, d/d lr] too."""
    import keras

    from assigntape import AssignAwareTape
    from helpers.mirrored_optimizers import TASKS, W0

    with strategy.scope():
        w, lr = tf.Variable(W0), tf.Variable(0.1)
        optimizer = keras.optimizers.SGD(learning_rate=lambda: lr * 1.0)
        optimizer.build([w])
    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(TASKS[ctx.replica_id_in_sync_group])
    )

    def step(x: Any) -> Any:
        primal, tangent = (x, tf.ones_like(x)) if along_data else (lr, tf.constant(1.0))
        with tf.autodiff.ForwardAccumulator(primal, tangent) as acc:
            with AssignAwareTape() as outer:
                with tf.GradientTape() as inner:
                    loss = tf.reduce_sum((w * x) ** 2)
                optimizer.apply_gradients([(inner.gradient(loss, w), w)])
                val = tf.reduce_sum((w * x - 1.0) ** 2)
        return acc.jvp(val), outer.gradient(val, lr)

    jvp, grad = strategy.run(tf.function(step) if compiled else step, args=(xs,))
    return [
        [None if j is None else float(j), float(g)]
        for j, g in zip(strategy.experimental_local_results(jvp), strategy.experimental_local_results(grad))
    ]


if __name__ == "__main__":
    sys.exit(main())
