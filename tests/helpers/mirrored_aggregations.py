"""Run in a fresh process: the MirroredStrategy step of ``mirrored_meta_step``
for each synchronization and aggregation of the written variable, and a Keras
optimizer step in replica context. Prints one JSON line: per case, the step's
results or the error it raised (type and message)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from assigntape import AssignAwareTape  # noqa: E402
from helpers.mirrored_meta_step import TASKS, run_step  # noqa: E402


def _outcome(fn):
    try:
        return {"result": fn()}
    except Exception as e:  # noqa: BLE001 - the test looks at what was raised
        return {"error": type(e).__name__, "message": str(e)}


def _keras_step(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)

    def step(x):
        with AssignAwareTape() as tape:
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(model(x[None]) ** 2)
            optimizer.apply_gradients(zip(inner.gradient(loss, model.trainable_variables), model.trainable_variables))
            outer = tf.reduce_sum(model(x[None]) ** 2)
        return tape.gradient(outer, model.trainable_variables[0])

    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(TASKS[ctx.replica_id_in_sync_group])
    )
    strategy.run(step, args=(xs,))
    return "ran"


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = {}
    for sync in ("ON_WRITE", "ON_READ"):
        for aggregation in ("NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"):
            kwargs = dict(
                synchronization=getattr(tf.VariableSynchronization, sync),
                aggregation=getattr(tf.VariableAggregation, aggregation),
            )
            out[f"{sync}/{aggregation}"] = _outcome(lambda: run_step(strategy, **kwargs))
    out["keras_optimizer_in_replica_context"] = _outcome(lambda: _keras_step(strategy))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
