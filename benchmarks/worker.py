"""A long-lived timing worker for the "plain TensorFlow outside any tape" figure.

``python -m benchmarks.worker --assigntape`` imports assigntape and uses one
``AssignAwareTape`` (a write and its gradient), so the patches are installed
and then dormant; ``python -m benchmarks.worker`` never imports assigntape (it
checks ``sys.modules`` after every request). Both then build the same plain
TensorFlow programs and answer, one JSON line per request on stdin:

* ``{"op": "time", "case": NAME, "reps": N}`` -> ``{"wall": s, "cpu": s}``: run
  the case N times, timed inside the worker (wall time, and the process's CPU
  time); the first request of a case builds and warms it;
* ``{"op": "gc"}``: ``gc.collect()`` (the parent asks at the start of a round);
* ``{"op": "info"}`` -> which process this is;
* ``{"op": "quit"}``.

The parent (``benchmarks.__main__``) asks the two workers in turn, alternating
which goes first, so each round is still a back-to-back pair; only one worker
runs at a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Callable, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CASES = {
    "no_write_eager": "no-write step, plain tf.GradientTape [eager]",
    "no_write_compiled": "no-write step, plain tf.GradientTape [compiled]",
    "keras_optimizer_loop": "Keras 3 eager train step (GradientTape + Adam)",
    "keras_fit_epoch": "Keras 3 model.fit, one epoch of 16 batches",
}


def _keras_model():
    import keras

    from benchmarks.workloads import DEPTH, WIDTH

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((WIDTH,))] + [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(DEPTH)]
    )


def build(case: str) -> Callable[[], object]:
    import tensorflow as tf

    from benchmarks import workloads

    if case in ("no_write_eager", "no_write_compiled"):
        params = workloads.net()
        x, y = workloads.data()
        step = workloads.no_write_step(tf.GradientTape, params, x, y)
        return workloads.maybe_compile(step, case.endswith("compiled"))
    if case == "keras_optimizer_loop":
        import keras

        model = _keras_model()
        opt = keras.optimizers.Adam(1e-3)
        x, y = workloads.data()

        def train_step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return train_step
    if case == "keras_fit_epoch":
        import numpy as np

        model = _keras_model()
        model.compile(optimizer="adam", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.standard_normal((16 * workloads.BATCH, workloads.WIDTH)).astype("float32")
        y = rng.standard_normal((16 * workloads.BATCH, workloads.WIDTH)).astype("float32")

        def epoch():
            return model.fit(x, y, batch_size=workloads.BATCH, epochs=1, verbose=0, shuffle=False)

        return epoch
    raise KeyError(case)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assigntape", action="store_true")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()

    # Replies go to the real stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import tensorflow as tf

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.assigntape:
        from assigntape import _patches
        from benchmarks import workloads

        steps = workloads.writes_per_tape(3)
        steps["assigntape"]()  # a tape with writes and a gradient, then closed
        del steps
        gc.collect()
        assert _patches.installed(), "the patches should stay installed, dormant"

    def check() -> None:
        if not args.assigntape and "assigntape" in sys.modules:
            raise RuntimeError("the plain worker imported assigntape")

    check()
    steps: Dict[str, Callable[[], object]] = {}
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        if req["op"] == "info":
            reply = {
                "pid": os.getpid(),
                "assigntape_imported": "assigntape" in sys.modules,
                "patches_installed": bool(
                    "assigntape" in sys.modules and sys.modules["assigntape._patches"].installed()
                ),
            }
        elif req["op"] == "gc":
            gc.collect()
            reply = {}
        elif req["op"] == "time":
            case = req["case"]
            if case not in steps:
                steps[case] = build(case)
                for _ in range(3):
                    steps[case]()
            step = steps[case]
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(req["reps"]):
                step()
            reply = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
            check()
        else:
            raise ValueError(req)
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
