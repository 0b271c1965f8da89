"""Run in a fresh process (logical devices must be set before TensorFlow
starts): a meta-step through a Keras optimizer's ``apply_gradients`` in
replica context under MirroredStrategy on two logical CPUs, two steps in a
row, eager and compiled; and the same two steps on one device with the
replicas' objectives summed. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

W0 = [1.0, 2.0]
TASKS = [[0.5, 1.5], [-1.0, 0.25]]  # one per replica
STEPS = 2


def optimizers(lr: Any) -> Dict[str, Callable[[], Any]]:
    import keras
    import tf_keras

    rate = lambda: lr * 1.0  # noqa: E731 - Keras 3 takes a callable for a variable rate
    return {
        "SGD": lambda: keras.optimizers.SGD(learning_rate=rate),
        "SGD_momentum": lambda: keras.optimizers.SGD(learning_rate=rate, momentum=0.9, nesterov=True),
        "Adam": lambda: keras.optimizers.Adam(learning_rate=rate),
        "RMSprop": lambda: keras.optimizers.RMSprop(learning_rate=rate),
        # tf_keras legacy optimizers: fused kernels, coefficients per replica.
        "legacy_SGD": lambda: tf_keras.optimizers.legacy.SGD(learning_rate=rate),
        "legacy_SGD_momentum": lambda: tf_keras.optimizers.legacy.SGD(learning_rate=rate, momentum=0.9, nesterov=True),
        "legacy_Adam": lambda: tf_keras.optimizers.legacy.Adam(learning_rate=rate, amsgrad=True),
        "legacy_Adamax": lambda: tf_keras.optimizers.legacy.Adamax(learning_rate=rate),
        "legacy_Adagrad": lambda: tf_keras.optimizers.legacy.Adagrad(learning_rate=rate),
        "legacy_RMSprop": lambda: tf_keras.optimizers.legacy.RMSprop(learning_rate=rate, centered=True, momentum=0.5),
        "legacy_Ftrl": lambda: tf_keras.optimizers.legacy.Ftrl(learning_rate=rate, l2_regularization_strength=0.1),
        # tf.compat.v1.train: fused kernels, coefficients and beta powers per replica.
        "v1_SGD": lambda: tf.compat.v1.train.GradientDescentOptimizer(rate),
        "v1_Momentum": lambda: tf.compat.v1.train.MomentumOptimizer(rate, 0.9, use_nesterov=True),
        "v1_Adam": lambda: tf.compat.v1.train.AdamOptimizer(rate),
        "v1_RMSProp": lambda: tf.compat.v1.train.RMSPropOptimizer(rate, momentum=0.5, centered=True),
        "v1_Adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(rate),
    }


def _build(optimizer: Any, variables: List[Any]) -> None:
    if hasattr(optimizer, "build"):
        optimizer.build(variables)
    elif hasattr(optimizer, "_create_all_weights"):  # tf_keras legacy
        optimizer._create_all_weights(variables)
    # tf.compat.v1.train optimizers make their slots in apply_gradients.


def single_device(name: str) -> List[List[Any]]:
    """Each step's [d/d lr, d/d w] of the replicas' summed objective, one device."""
    from assigntape import AssignAwareTape

    w, lr = tf.Variable(W0), tf.Variable(0.1)
    optimizer = optimizers(lr)[name]()
    _build(optimizer, [w])
    out = []
    for _ in range(STEPS):
        with AssignAwareTape() as outer:
            with tf.GradientTape() as inner:
                loss = sum(tf.reduce_sum((w * tf.constant(x)) ** 2) for x in TASKS)
            optimizer.apply_gradients([(inner.gradient(loss, w), w)])
            val = sum(tf.reduce_sum((w * tf.constant(x) - 1.0) ** 2) for x in TASKS)
        d_lr, d_w = outer.gradient(val, [lr, w])
        out.append([float(d_lr), d_w.numpy().tolist(), w.numpy().tolist()])
    return out


# Trainable SyncOnReadVariables stepped by Keras SGD, by aggregation.
ON_READ = {"SGD_on_read_" + a.lower(): a for a in ("NONE", "SUM", "MEAN")}


def mirrored(strategy: Any, name: str, compiled: bool, made: Any = None) -> List[List[Any]]:
    """Each step's [sum over replicas of d/d lr, of d/d w, each component].
    ``made``, a dict, gets the variable ``w``."""
    from assigntape import AssignAwareTape

    with strategy.scope():
        if name in ON_READ:
            w = tf.Variable(
                W0,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=getattr(tf.VariableAggregation, ON_READ[name]),
                trainable=True,
            )
            name = "SGD"
        else:
            w = tf.Variable(W0)
        lr = tf.Variable(0.1)
    if made is not None:
        made["w"] = w
    with strategy.scope():
        optimizer = optimizers(lr)[name]()
        _build(optimizer, [w])
    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(TASKS[ctx.replica_id_in_sync_group])
    )

    def step(x: Any) -> Any:
        with AssignAwareTape() as outer:
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum((w * x) ** 2)
            optimizer.apply_gradients([(inner.gradient(loss, w), w)])
            val = tf.reduce_sum((w * x - 1.0) ** 2)
        return outer.gradient(val, [lr, w])

    fn = tf.function(step) if compiled else step
    out = []
    for _ in range(STEPS):
        d_lr, d_w = strategy.run(fn, args=(xs,))
        lrs = strategy.experimental_local_results(d_lr)
        ws = strategy.experimental_local_results(d_w)
        if any(g is None for g in lrs + ws):
            raise AssertionError(f"a replica's meta-gradient is None: {lrs}, {ws}")
        out.append(
            [
                sum(float(g) for g in lrs),
                tf.add_n(list(ws)).numpy().tolist(),
                [c.numpy().tolist() for c in strategy.experimental_local_results(w)],
            ]
        )
    return out


SPARSE_TABLE = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
SPARSE_IDS = [[0, 2], [2, 1]]  # one per replica: row 2 on both


def sparse_optimizers(lr: Any) -> Dict[str, Callable[[], Any]]:
    import keras
    import tf_keras

    rate = lambda: lr * 1.0  # noqa: E731
    return {
        "SGD": lambda: keras.optimizers.SGD(learning_rate=rate, momentum=0.5),
        "legacy_Adagrad": lambda: tf_keras.optimizers.legacy.Adagrad(learning_rate=rate),
        "v1_Adam": lambda: tf.compat.v1.train.AdamOptimizer(rate),
    }


def _sparse_step(optimizer: Any, table: Any, ids: List[Any], scale: float) -> Any:
    """A step on the embedding rows ``ids`` (sparse gradients), then a
    validation loss: the outer tape and the loss."""
    from assigntape import AssignAwareTape

    with AssignAwareTape() as outer:
        with tf.GradientTape() as inner:
            loss = sum(tf.reduce_sum(tf.gather(table, i) ** 3) for i in ids)
        optimizer.apply_gradients([(inner.gradient(loss, table), table)])
        val = scale * tf.reduce_sum(table**2)
    return outer, val


def _distributed(strategy: Any, w0: Any, lr0: float, made: Callable[[Any], Any], name: str, data: List[Any]) -> Any:
    """Under ``strategy``: the variable, the learning rate, the optimizer
    ``made(lr)[name]`` built for it, and one item of ``data`` per replica."""
    with strategy.scope():
        w, lr = tf.Variable(w0), tf.Variable(lr0)
        optimizer = made(lr)[name]()
        _build(optimizer, [w])
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(data[ctx.replica_id_in_sync_group])
    )
    return w, lr, optimizer, per_replica


def sparse_steps(strategy: Any) -> Dict[str, Any]:
    """Steps on an embedding table with sparse (IndexedSlices) gradients, two
    in a row: one device with the replicas' objectives summed, and
    MirroredStrategy in replica context, eager and compiled. Each step's
    [d/d lr, d/d table] (summed over replicas)."""
    out: Dict[str, Any] = {}
    for name in sparse_optimizers(None):
        table, lr = tf.Variable(SPARSE_TABLE), tf.Variable(0.01)
        optimizer = sparse_optimizers(lr)[name]()
        _build(optimizer, [table])
        single = []
        for _ in range(STEPS):
            outer, val = _sparse_step(optimizer, table, [tf.constant(i) for i in SPARSE_IDS], float(len(SPARSE_IDS)))
            d_lr, d_table = outer.gradient(val, [lr, table])
            single.append([float(d_lr), tf.convert_to_tensor(d_table).numpy().tolist()])
        out[name] = {"single": single}
        for mode in ("eager", "compiled"):
            table, lr, optimizer, ids = _distributed(strategy, SPARSE_TABLE, 0.01, sparse_optimizers, name, SPARSE_IDS)

            def step(i: Any) -> Any:
                outer, val = _sparse_step(optimizer, table, [i], 1.0)
                return outer.gradient(val, [lr, table])

            fn = tf.function(step) if mode == "compiled" else step

            def run() -> List[Any]:
                got = []
                for _ in range(STEPS):
                    d_lr, d_table = strategy.run(fn, args=(ids,))
                    got.append(
                        [
                            sum(float(g) for g in strategy.experimental_local_results(d_lr)),
                            tf.add_n([tf.convert_to_tensor(g) for g in strategy.experimental_local_results(d_table)])
                            .numpy()
                            .tolist(),
                        ]
                    )
                return got

            out[name][mode] = _outcome(run)
    return out


def plain_tape_around(strategy: Any, name: str, compiled: bool) -> List[float]:
    """The meta-step of ``mirrored`` (one step) with a plain tf.GradientTape
    open around the AssignAwareTape: the plain tape's d/d lr, summed over
    replicas."""
    from assigntape import AssignAwareTape

    w, lr, optimizer, xs = _distributed(strategy, W0, 0.1, optimizers, name, TASKS)

    def step(x: Any) -> Any:
        with tf.GradientTape() as plain:
            with AssignAwareTape():
                with tf.GradientTape() as inner:
                    loss = tf.reduce_sum((w * x) ** 2)
                optimizer.apply_gradients([(inner.gradient(loss, w), w)])
            val = tf.reduce_sum((w * x - 1.0) ** 2)
        return plain.gradient(val, lr)

    d_lr = strategy.run(tf.function(step) if compiled else step, args=(xs,))
    return sum(float(g) for g in strategy.experimental_local_results(d_lr))


def sparse_unaggregated(strategy: Any) -> List[float]:
    """tf_keras legacy SGD on an embedding's sparse gradient with
    ``experimental_aggregate_gradients=False`` (each replica its own step):
    each replica's d/d lr of sum(table) after the step."""
    import tf_keras

    from assigntape import AssignAwareTape

    with strategy.scope():
        table, lr = tf.Variable(SPARSE_TABLE), tf.Variable(0.1)
        optimizer = tf_keras.optimizers.legacy.SGD(lambda: lr * 1.0)
        _build(optimizer, [table])

    def step() -> Any:
        with AssignAwareTape() as outer:
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(tf.gather(table, [0, 2]) ** 2)
            optimizer.apply_gradients([(inner.gradient(loss, table), table)], experimental_aggregate_gradients=False)
            val = tf.reduce_sum(table)
        return outer.gradient(val, lr)

    return [float(g) for g in strategy.experimental_local_results(strategy.run(step))]


def _outcome(fn: Callable[[], Any]) -> Dict[str, Any]:
    try:
        return {"result": fn()}
    except Exception as e:  # noqa: BLE001 - the test looks at what was raised
        return {"error": type(e).__name__, "message": str(e)}


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out: Dict[str, Any] = {}
    for name in [*optimizers(tf.Variable(0.1)), *ON_READ]:
        out[name] = {"single": single_device("SGD" if name in ON_READ else name)}
        for mode in ("eager", "compiled"):
            made: Dict[str, Any] = {}
            out[name][mode] = _outcome(lambda: mirrored(strategy, name, mode == "compiled", made))
            if "error" in out[name][mode] and "w" in made:
                # What a refused step left in the components.
                out[name][mode]["components"] = [
                    c.numpy().tolist() for c in strategy.experimental_local_results(made["w"])
                ]
    out["sparse"] = sparse_steps(strategy)
    out["sparse_unaggregated"] = _outcome(lambda: sparse_unaggregated(strategy))
    out["plain_around"] = {
        name: {
            mode: _outcome(lambda: plain_tape_around(strategy, name, mode == "compiled"))
            for mode in ("eager", "compiled")
        }
        for name in ("SGD", "legacy_SGD", "v1_SGD")
    }
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
