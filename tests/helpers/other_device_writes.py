"""Writes, inside a compiled tape, to a variable placed on another device than
the function's (``tf.device("/cpu:1")`` and ``OneDeviceStrategy``), run as a
fresh process over two logical CPUs. Each program runs eagerly and compiled;
prints one JSON line of their gradients."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

W0, LR = [2.0, 1.0], 0.1


def programs(w: Any, lr: Any) -> Dict[str, Callable[[], List[Any]]]:
    """Each returns ``[d out / d lr, d out / d w]`` after writing ``w``, a
    vector; ``out`` sums its elements."""
    from assigntape import AssignAwareTape

    def top_level() -> List[Any]:
        with AssignAwareTape() as tape:
            w.assign_sub(lr * 2.0 * w)
            out = tf.reduce_sum(w * 3.0)
        return tape.gradient(out, [lr, w])

    def in_cond() -> List[Any]:
        with AssignAwareTape() as tape:
            r = tf.cond(lr > 0.0, lambda: w.assign_sub(lr * w).read_value() * 1.0, lambda: w * 1.0)
            out = tf.reduce_sum(w * 3.0 + r)
        return tape.gradient(out, [lr, w])

    def in_loop() -> List[Any]:
        with AssignAwareTape() as tape:
            for _ in tf.range(2):
                w.assign_sub(lr * 2.0 * w)
            out = tf.reduce_sum(w * 3.0)
        return tape.gradient(out, [lr, w])

    def fused_kernel() -> List[Any]:
        with AssignAwareTape() as tape:
            tf.raw_ops.ResourceApplyGradientDescent(var=w.handle, alpha=lr, delta=2.0 * w)
            out = tf.reduce_sum(w * 3.0)
        return tape.gradient(out, [lr, w])

    def scatter() -> List[Any]:
        with AssignAwareTape() as tape:
            w.scatter_update(tf.IndexedSlices(w[:1] * lr, tf.constant([1])))
            out = tf.reduce_sum(w * w)
        return tape.gradient(out, [lr, w])

    def two_writes() -> List[Any]:
        with AssignAwareTape() as tape:
            w.assign_sub(lr * w)
            w[0].assign(w[1] * lr)
            out = tf.reduce_sum(w * w)
        return tape.gradient(out, [lr, w])

    return {f.__name__: f for f in (top_level, in_cond, in_loop, fused_kernel, scatter, two_writes)}


def _run(
    make: Callable[[], Dict[str, Callable[[], List[Any]]]], reset: Callable[[], None], wrap: Callable[..., Any]
) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name, program in make().items():
        for mode in ("eager", "compiled"):
            reset()
            try:
                grads = wrap(tf.function(program) if mode == "compiled" else program)
                out[f"{name}/{mode}"] = [g.numpy().tolist() for g in grads]
            except Exception as error:  # noqa: BLE001 - reported to the test
                out[f"{name}/{mode}"] = f"{type(error).__name__}: {str(error)[:300]}"
    return out


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    with tf.device("/cpu:1"):
        w = tf.Variable(W0)
    lr = tf.Variable(LR)
    result = {"device": _run(lambda: programs(w, lr), lambda: w.assign(W0), lambda f: f())}
    strategy = tf.distribute.OneDeviceStrategy("/cpu:1")
    with strategy.scope():
        w2, lr2 = tf.Variable(W0), tf.Variable(LR)
    result["one_device"] = _run(lambda: programs(w2, lr2), lambda: w2.assign(W0), lambda f: strategy.run(f))
    result["placed"] = [w.device, w2.device]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
