"""Run in a fresh process (logical devices must be set before TensorFlow
starts): MirroredStrategy's distributed datasets whose ``map`` writes ``v``,
iterated from an eager AssignAwareTape and in the tape's ``tf.function``
(made there, captured, or given as an argument), and a step given a
distributed iterator whose dataset writes nothing. Prints one JSON line:
for each writing case, the error raised (or "none") and whether ``v`` kept
its value; for the step, each replica's gradient and the plain tape's."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

V0 = np.array([1.5, -0.5, 2.0])
X0 = 0.7
E = 1.25


def _writing(strategy: Any, kind: str) -> Tuple[tf.Variable, tf.Variable, Any]:
    v = tf.Variable(V0, dtype=tf.float64, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64, name="x_read")

    def make(_: Any = None) -> tf.data.Dataset:
        ds = tf.data.Dataset.from_tensors(tf.constant([E, E], tf.float64))
        return ds.map(lambda e: (v.assign(v * x * e[0]), e)[1])

    if kind == "from_function":
        return v, x, strategy.distribute_datasets_from_function(make)
    return v, x, strategy.experimental_distribute_dataset(make())


def _eager_cases(strategy: Any) -> Dict[str, Callable[[Any, Any, Any], Any]]:
    def loop(v: Any, x: Any, dist: Any) -> Any:
        for _ in dist:
            pass

    def iterator_argument(v: Any, x: Any, dist: Any) -> Any:
        return tf.function(lambda it: strategy.experimental_local_results(next(it))[0])(iter(dist))

    def dataset_argument(v: Any, x: Any, dist: Any) -> Any:
        return tf.function(lambda d: strategy.experimental_local_results(next(iter(d)))[0])(dist)

    return {"loop": loop, "iterator_argument": iterator_argument, "dataset_argument": dataset_argument}


def _run_eager(strategy: Any, kind: str, case: Callable[[Any, Any, Any], Any]) -> Tuple[str, bool]:
    from assigntape import AssignAwareTape

    v, x, dist = _writing(strategy, kind)
    error = "none"
    with AssignAwareTape():
        tf.reduce_sum(v)  # the tape tracks v
        try:
            case(v, x, dist)
        except Exception as e:  # noqa: BLE001 (reported, and checked by the test)
            error = type(e).__name__
    return error, bool(np.array_equal(v.numpy(), V0))


def _run_compiled(strategy: Any, how: str) -> Tuple[str, bool]:
    from assigntape import AssignAwareTape

    v, x, dist = _writing(strategy, "dataset")
    made_outside = iter(dist)

    @tf.function
    def step(argument: Any) -> Any:
        with AssignAwareTape() as tape:
            before = tf.reduce_sum(v)
            if how == "made_inside":
                element = next(iter(dist))
            elif how == "captured_iterator":
                element = next(made_outside)
            elif how == "iterator_argument":
                element = next(argument)
            else:
                element = next(iter(argument))
            with tf.control_dependencies([strategy.experimental_local_results(element)[0]]):
                y = tf.reduce_sum(v * v) * x + 0.0 * before
        return y, tape.gradient(y, [x, v])

    argument = {"iterator_argument": iter(dist), "dataset_argument": dist}.get(how, tf.constant(0.0))
    error = "none"
    try:
        step(argument)
    except Exception as e:  # noqa: BLE001
        error = type(e).__name__
    return error, bool(np.array_equal(v.numpy(), V0))


def _quiet_step(strategy: Any) -> Tuple[List[List[float]], List[List[float]]]:
    """A Keras-style step given a distributed iterator whose dataset writes
    nothing: each replica's gradient of sum((w * b - 1)^2), and the plain
    tape's on tensors (the oracle)."""
    from assigntape import AssignAwareTape

    batches = np.array([[1.0, 2.0, 0.5], [0.5, -1.0, 2.0]])
    with strategy.scope():
        w = tf.Variable(V0, dtype=tf.float64, name="w")
    iterator = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(batches).batch(2)))

    def replica_step(b: Any) -> Any:
        with AssignAwareTape() as tape:
            loss = tf.reduce_sum((w * b[0] - 1.0) ** 2)
        return tape.gradient(loss, w)

    @tf.function
    def step(it: Any) -> Any:
        return strategy.run(replica_step, args=(next(it),))

    got = [g.numpy().tolist() for g in strategy.experimental_local_results(step(iterator))]
    expected = []
    for b in batches:
        wc = tf.constant(V0, tf.float64)
        with tf.GradientTape() as tape:
            tape.watch(wc)
            loss = tf.reduce_sum((wc * b - 1.0) ** 2)
        expected.append(tape.gradient(loss, wc).numpy().tolist())
    return got, expected


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out: Dict[str, Any] = {}
    for kind in ("dataset", "from_function"):
        for name, case in _eager_cases(strategy).items():
            out[f"eager/{kind}/{name}"] = _run_eager(strategy, kind, case)
    for how in ("made_inside", "captured_iterator", "iterator_argument", "dataset_argument"):
        out[f"compiled/{how}"] = _run_compiled(strategy, how)
    out["quiet_step"] = _quiet_step(strategy)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
