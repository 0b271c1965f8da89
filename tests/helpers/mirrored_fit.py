"""Run in a fresh process (logical devices must be set before TensorFlow
starts): ``fit`` of a model whose ``train_step`` steps an inner Keras optimizer
inside an AssignAwareTape and a learned learning rate after it, on one device
and under MirroredStrategy on two logical CPUs (compiled and eager). Prints
one JSON line: the learning rate and the kernel after an epoch."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH = 8


def model_class() -> Any:
    import keras

    from assigntape import AssignAwareTape

    class LearnedRate(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(1, kernel_initializer="ones")
            self.lr = tf.Variable(0.05, trainable=False)
            self.inner = keras.optimizers.SGD(learning_rate=lambda: self.lr * 1.0)

        def call(self, x: Any) -> Any:
            return self.dense(x)

        def train_step(self, data: Any) -> Any:
            x, y = data
            with AssignAwareTape() as outer:
                outer.watch(self.lr)
                with tf.GradientTape() as tape:
                    # Per replica, a share of the global batch's mean: the
                    # all-reduced (summed) gradients are the global batch's.
                    loss = tf.reduce_sum((self(x) - y) ** 2) / GLOBAL_BATCH
                grads = tape.gradient(loss, self.dense.trainable_variables)
                self.inner.apply_gradients(zip(grads, self.dense.trainable_variables))
                val = tf.reduce_sum((self(x) - 2.0 * y) ** 2) / GLOBAL_BATCH
            d_lr = tf.distribute.get_replica_context().all_reduce("SUM", outer.gradient(val, self.lr))
            self.lr.assign_sub(0.01 * d_lr)
            return {"loss": loss}

    return LearnedRate


def train(strategy: Any, run_eagerly: bool) -> Dict[str, Any]:
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = model_class()()
        model.build((None, 3))
        model.compile(run_eagerly=run_eagerly, jit_compile=False)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    return {"lr": float(model.lr.numpy()), "kernel": model.dense.kernel.numpy().ravel().tolist()}


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    out = {"single": train(tf.distribute.get_strategy(), True)}
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for mode, eager in (("eager", True), ("compiled", False)):
        try:
            out[mode] = train(mirrored, eager)
        except Exception as e:  # noqa: BLE001 - the test looks at what was raised
            out[mode] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
