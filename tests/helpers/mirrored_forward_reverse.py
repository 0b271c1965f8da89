"""Run in a fresh process (logical devices must be set before TensorFlow
starts): under MirroredStrategy on two logical CPUs, eagerly, two Keras 3
optimizer steps in each replica with an AssignAwareTape and a
ForwardAccumulator (ours or TensorFlow's; inside the tape or around it), the
steps written inline or in a nested function. Prints one JSON line: per
case, each replica's [jvp, reverse d/d lr]; per optimizer, the finite
differences of each replica's objective along lr (no tape)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from helpers.mirrored_optimizers import _outcome  # noqa: E402

OPTIMIZERS = ("sgd_momentum", "adam", "loss_scale")


def run(strategy: Any, optimizer: str, lr_value: float, mode: str, accumulator: Any = None, nested: bool = True) -> Any:
    import keras

    from assigntape import AssignAwareTape

    with strategy.scope():
        w, lr = tf.Variable(1.0), tf.Variable(lr_value)
        if optimizer == "adam":
            opt: Any = keras.optimizers.Adam(learning_rate=lambda: lr)
        else:
            opt = keras.optimizers.SGD(learning_rate=lambda: lr, momentum=0.9)
        if optimizer == "loss_scale":
            opt = keras.optimizers.LossScaleOptimizer(opt)
        opt.build([w])
    xs = strategy.experimental_distribute_values_from_function(
        lambda c: tf.constant([1.0, 2.0][c.replica_id_in_sync_group])
    )

    def replica(x: Any) -> Any:
        def one_step() -> Any:
            with tf.GradientTape() as inner:
                loss = (x * w - 3.0) ** 2
                if optimizer == "loss_scale":
                    loss = opt.scale_loss(loss)
            grads = inner.gradient(loss, [w])
            opt.apply_gradients(zip(grads, [w]))
            return grads

        def steps() -> Any:
            # The inner gradients die when each step returns, before the
            # tape's gradient: f15's shape.
            for _ in range(2):
                one_step()
            return w * w * x

        if mode == "plain":
            return steps(), tf.zeros([])
        if mode == "inside":
            with AssignAwareTape() as tape:
                with accumulator(lr, tf.constant(1.0)) as acc:
                    if nested:
                        y = steps()
                    else:
                        # As when written inline: the inner gradients live
                        # on, past the tape's gradient.
                        _kept = [one_step() for _ in range(2)]
                        y = w * w * x
                jvp = acc.jvp(y)
        else:  # the accumulator around the tape
            with accumulator(lr, tf.constant(1.0)) as acc:
                with AssignAwareTape() as tape:
                    y = steps()
                jvp = acc.jvp(y)
        return jvp, tape.gradient(y, lr)

    first, second = strategy.run(replica, args=(xs,))
    return [
        [float(a), float(b)]
        for a, b in zip(strategy.experimental_local_results(first), strategy.experimental_local_results(second))
    ]


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    import assigntape

    accumulators = {"ours": assigntape.ForwardAccumulator, "tf": tf.autodiff.ForwardAccumulator}
    out: Dict[str, Any] = {"fd": {}, "cases": {}}
    eps = 1e-3
    for optimizer in OPTIMIZERS:
        # Central differences in float64 of the float32 objectives.
        up = run(strategy, optimizer, 0.1 + eps, "plain")
        down = run(strategy, optimizer, 0.1 - eps, "plain")
        out["fd"][optimizer] = [(u[0] - d[0]) / (2 * eps) for u, d in zip(up, down)]
        for name, accumulator in accumulators.items():
            for mode, nested in (("inside", True), ("inside", False), ("outside", True)):
                label = f"{optimizer} {name} {mode} {'nested' if nested else 'inline'}"
                cases: List[Any] = out["cases"].setdefault(optimizer, [])
                cases.append([label, _outcome(lambda: run(strategy, optimizer, 0.1, mode, accumulator, nested))])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
