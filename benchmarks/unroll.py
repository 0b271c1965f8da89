"""Long unrolls (issue #39): peak memory and time of K inner SGD steps.

``python -m benchmarks.unroll [--ks 10,100,1000] [--roles plain,checkpointed,unroll] [--compiled [--warm]] [--tensors]``

The workload: a 64 -> 256 -> 256 -> 1 tanh MLP (Keras 3), batch 256, K inner
Keras ``SGD`` steps inside an ``AssignAwareTape``, then the gradient of a
validation loss with respect to the initial weights and the learning rate (a
``tf.Variable`` behind a callable). Roles: ``plain`` (the loop), ``checkpointed``
(each step ``checkpointed``) and ``unroll`` (``unroll(step, K)``, segments of
ceil(sqrt(K)) steps). Each (role, K) runs in a fresh process
(``python -m benchmarks.unroll --one ROLE K``): the peak resident set during the
meta step above the resident set before it (``benchmarks.memory``), and its time.
Compiled, the meta step is a ``tf.function`` traced (not run) before the
measured call; with ``--warm``, called once before it (the steady state: the
graph instantiated and optimized, its memory the step's own).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def build(role: str, k: int, compiled: bool, warm: bool = False) -> Callable[[], Any]:
    import keras
    import numpy as np
    import tensorflow as tf

    if os.environ.get("UNROLL_NO_GRAPPLER"):
        # Graph optimization at a compiled step's first call (the measured
        # one) holds memory that grows with the graph: off, to see the step's own.
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

    from assigntape import AssignAwareTape, checkpointed, unroll

    rng = np.random.default_rng(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="tanh"),
            keras.layers.Dense(256, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    lr = tf.Variable(1e-3)
    opt = keras.optimizers.SGD(learning_rate=lambda: lr)
    weights = model.trainable_variables
    opt.build(weights)
    x, y = (tf.constant(rng.normal(size=s), tf.float32) for s in ((256, 64), (256, 1)))
    xv, yv = (tf.constant(rng.normal(size=s), tf.float32) for s in ((256, 64), (256, 1)))
    start = [w.numpy() for w in weights]

    def step() -> Any:
        with tf.GradientTape() as inner:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(zip(inner.gradient(loss, weights), weights))
        return loss

    wrapped = checkpointed(step)

    def meta() -> Any:
        initial = [w.value for w in weights]
        with AssignAwareTape() as tape:
            if role == "unroll":
                unroll(step, k)
            else:
                for _ in range(k):
                    (wrapped if role == "checkpointed" else step)()
            val = tf.reduce_mean((model(xv) - yv) ** 2)
        return tape.gradient(val, [lr, *initial])

    run = tf.function(meta) if compiled else meta

    def measured() -> Any:
        for w, s in zip(weights, start):
            w.assign(s)
        return run()

    if compiled and warm:
        measured()  # the second call is measured
    elif compiled:
        run.get_concrete_function()  # traced, not run: no memory reused from a run before
    return measured


def one(role: str, k: int, compiled: bool, warm: bool = False) -> Dict[str, float]:
    from benchmarks.memory import _peak_and_retained

    step = build(role, k, compiled, warm)
    allocator = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "true"
    if allocator:
        import tensorflow as tf

        tf.config.experimental.reset_memory_stats("CPU:0")
        held = tf.config.experimental.get_memory_info("CPU:0")["current"]
    t0 = time.perf_counter()
    got = _peak_and_retained(step)
    got["seconds"] = time.perf_counter() - t0
    if allocator:
        # The tensors' own peak, as TensorFlow's allocator counts it: unlike
        # the resident set, not hidden by memory an earlier call left for reuse.
        got["tensor_peak_mib"] = (tf.config.experimental.get_memory_info("CPU:0")["peak"] - held) / 2**20
    return got


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ks", default="10,100,1000")
    parser.add_argument("--roles", default="plain,checkpointed,unroll")
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--warm", action="store_true", help="compiled: measure the second call")
    parser.add_argument(
        "--tensors", action="store_true", help="also TensorFlow's allocator peak (TF_CPU_ALLOCATOR_USE_BFC=true)"
    )
    parser.add_argument("--one", nargs=2, metavar=("ROLE", "K"))
    args = parser.parse_args()
    if args.tensors:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # (before TensorFlow is imported; the children inherit it)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.compiled, args.warm)))
        return
    for k in map(int, args.ks.split(",")):
        for role in args.roles.split(","):
            cmd = [sys.executable, "-m", "benchmarks.unroll", "--one", role, str(k)]
            cmd += (["--compiled"] if args.compiled else []) + (["--warm"] if args.warm else [])
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                print(f"K={k:5d} {role:13s} failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            m = json.loads(out.stdout.strip().splitlines()[-1])
            tensors = f"  tensors {m['tensor_peak_mib']:9.1f} MiB" if "tensor_peak_mib" in m else ""
            print(f"K={k:5d} {role:13s} peak {m['peak_mib']:9.1f} MiB{tensors}  time {m['seconds']:8.2f} s", flush=True)


if __name__ == "__main__":
    main()
