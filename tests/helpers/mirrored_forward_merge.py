"""Run in a fresh process (logical devices must be set before TensorFlow
starts): under MirroredStrategy on two logical CPUs, an AssignAwareTape and a
ForwardAccumulator (ours or TensorFlow's) in each replica, around a
``merge_call`` of the user's own that sums a value the tape recorded
(``batch_reduce_to``), eager and compiled; and two ``tf.compat.v1.train``
optimizer steps, whose merge_call sums the gradients so, eagerly. Prints one JSON line: per
accumulator and mode, the outcome, the variable's components after it, and
a fresh tape's gradient after it."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from helpers.mirrored_optimizers import _outcome  # noqa: E402


def merge_call_sum(strategy: Any, accumulator: Any, compiled: bool, v1_steps: bool = False) -> Any:
    from assigntape import AssignAwareTape

    with strategy.scope():
        lr, w = tf.Variable(0.1), tf.Variable(1.0)
    xs = strategy.experimental_distribute_values_from_function(
        lambda c: tf.constant([1.0, 2.0][c.replica_id_in_sync_group])
    )

    optimizer = tf.compat.v1.train.GradientDescentOptimizer(learning_rate=lambda: lr)

    def replica(x: Any) -> Any:
        ctx = tf.distribute.get_replica_context()
        with AssignAwareTape() as tape:
            with accumulator(lr, tf.constant(1.0)) as acc:
                if v1_steps:
                    # Its merge_call sums the gradients with batch_reduce_to;
                    # the second step's have a tangent along lr.
                    for _ in range(2):
                        with tf.GradientTape() as inner:
                            loss = (x * w - 3.0) ** 2
                        optimizer.apply_gradients(zip(inner.gradient(loss, [w]), [w]))
                    y = w * w * x
                else:
                    w.assign(w * (1.0 + lr * x))
                    v = w * x
                    y = ctx.merge_call(
                        lambda s, val: s.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(val, val)])[0],
                        args=(v,),
                    )
            jvp = acc.jvp(y)
        return jvp, tape.gradient(y, lr)

    def run() -> Any:
        jvp, grad = strategy.run(tf.function(replica) if compiled else replica, args=(xs,))
        return [
            [None if j is None else float(j), float(g)]
            for j, g in zip(strategy.experimental_local_results(jvp), strategy.experimental_local_results(grad))
        ]

    outcome = _outcome(run)
    outcome["components"] = [float(c.numpy()) for c in w.values]
    with AssignAwareTape() as tape:
        z = lr * 2.0
    outcome["fresh"] = float(tape.gradient(z, lr))
    return outcome


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    import assigntape

    out: Dict[str, Any] = {}
    for name, accumulator in (("ours", assigntape.ForwardAccumulator), ("tf", tf.autodiff.ForwardAccumulator)):
        for mode in ("eager", "compiled"):
            out[f"{name} {mode}"] = merge_call_sum(strategy, accumulator, mode == "compiled")
    out["ours v1 optimizer eager"] = merge_call_sum(strategy, assigntape.ForwardAccumulator, False, v1_steps=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
