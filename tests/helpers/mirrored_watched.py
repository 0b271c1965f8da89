"""Run in a fresh process (logical devices must be set before TensorFlow
starts): ``watched_variables()`` of the tapes in each replica of a
MirroredStrategy on two logical CPUs, after an optimizer step inside them (its
update runs in ``merge_call``, as each replica), eager and compiled: which
objects they list, in which order, and the AssignAwareTape's gradients with
respect to its list; the same program under a plain ``tf.GradientTape`` alone
(TensorFlow's list); and the assignment-free rewrite's gradients. Prints one
JSON line."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

LR = 0.1
XS = [1.0, 2.0]  # one per replica
START = {"c": 1.0, "a": 2.0, "b": 3.0}  # made in this order


# Keras 3's LossScaleOptimizer's initial loss scale, which it divides the
# gradients by (the loss here is not scaled).
LOSS_SCALE = 2.0**15


def optimizers() -> Dict[str, Tuple[Callable[[], Any], float, bool]]:
    """name -> (an optimizer whose first step is a - lr * g / s, with g the
    replicas' summed gradient; s; whether to run it compiled too). Keras 3's
    LossScaleOptimizer steps inside a tf.cond built in merge_call when
    compiled, which is refused: eager only."""
    import keras
    import tf_keras

    return {
        "keras_SGD_momentum": (lambda: keras.optimizers.SGD(LR, momentum=0.9), 1.0, True),
        "keras_LossScale_SGD": (
            lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR, momentum=0.9)),
            LOSS_SCALE,
            False,
        ),
        "legacy_SGD_momentum": (lambda: tf_keras.optimizers.legacy.SGD(LR, momentum=0.9), 1.0, True),
        "v1_Momentum": (lambda: tf.compat.v1.train.MomentumOptimizer(LR, 0.9), 1.0, True),
    }


def rewrite(scale: float) -> List[float]:
    """The summed objective's gradient w.r.t. (c, a, b), without variables:
    in replica r (x = XS[r]) y = b c x + a, then a and b step on the
    all-reduced (summed) gradient of a b x, divided by ``scale`` (momentum's
    first step is plain SGD), then y += a c x."""
    c, a, b = (tf.constant(START[n]) for n in "cab")
    with tf.GradientTape() as outer:
        outer.watch([c, a, b])
        ys = [b * c * x + a for x in XS]
        g_a = sum(b * x for x in XS)  # d(a b x)/da, summed over the replicas
        g_b = sum(a * x for x in XS)
        a1, b1 = a - LR * g_a / scale, b - LR * g_b / scale
        total = sum(y + a1 * c * x for y, x in zip(ys, XS))
    del b1  # (b's new value is not read again)
    return [float(g) for g in outer.gradient(total, [c, a, b])]


def _positions(listed: Any, variables: List[Any]) -> List[Any]:
    """Where each listed object is among ``variables`` (by identity), else its name."""
    return [next((i for i, v in enumerate(variables) if v is w), w.name) for w in listed]


def run(strategy: Any, name: str, make: Callable[[], Any], kind: str, compiled: bool) -> Dict[str, Any]:
    """One step in each replica under ``kind``'s tapes: "plain" (a plain
    tf.GradientTape alone) or "ours" (a plain tape around an AssignAwareTape,
    which follows it). Per replica, each tape's list (positions among
    c, a, b), and, for "ours", the summed gradients w.r.t. the list."""
    from assigntape import AssignAwareTape

    with strategy.scope():
        c, a, b = (tf.Variable(START[n], name=n) for n in "cab")
        optimizer = make()
        if hasattr(optimizer, "build"):
            optimizer.build([a, b])
        elif hasattr(optimizer, "_create_all_weights"):  # tf_keras legacy
            optimizer._create_all_weights([a, b])
    variables = [c, a, b]
    listed: Dict[str, List[Any]] = {}

    def replica_fn() -> Any:
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        x = tf.gather(tf.constant(XS), rid)
        with tf.GradientTape() as plain:
            with AssignAwareTape() if kind == "ours" else tf.GradientTape() as tape:
                y = b * c * x + a
                with tf.GradientTape() as inner:
                    loss = a * b * x
                optimizer.apply_gradients(zip(inner.gradient(loss, [a, b]), [a, b]))
                y += a * c * x
        key = int(tf.get_static_value(rid))  # (a constant, eager and compiled)
        watched = tape.watched_variables()
        listed.setdefault("tape", []).append((key, _positions(watched, variables)))
        listed.setdefault("plain", []).append((key, _positions(plain.watched_variables(), variables)))
        if kind != "ours":
            return tf.zeros([len(watched)])
        grads = tape.gradient(y, watched)
        return tf.stack([tf.zeros([]) if g is None else g for g in grads])

    fn = tf.function(lambda: strategy.run(replica_fn)) if compiled else (lambda: strategy.run(replica_fn))
    grads = fn()
    out: Dict[str, Any] = {k: [p for _, p in sorted(v)] for k, v in listed.items()}
    if kind == "ours":
        out["grads"] = [g.numpy().tolist() for g in strategy.experimental_local_results(grads)]
    return out


def order(strategy: Any, kind: str, compiled: bool) -> List[List[Any]]:
    """Per replica, the list (positions among a, b) of ``kind``'s tape when
    ``a``, made first, is written unrecorded before anything is read: it is
    first watched through a version made after ``b``'s handle."""
    from assigntape import AssignAwareTape

    with strategy.scope():
        a, b = tf.Variable(2.0, name="a"), tf.Variable(3.0, name="b")
    listed: List[Tuple[int, List[Any]]] = []

    def replica_fn() -> Any:
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        with AssignAwareTape() if kind == "ours" else tf.GradientTape() as tape:
            with tape.stop_recording():
                a.assign(5.0)
            y = b * a
        listed.append((int(tf.get_static_value(rid)), _positions(tape.watched_variables(), [a, b])))
        return y

    (tf.function(lambda: strategy.run(replica_fn)) if compiled else lambda: strategy.run(replica_fn))()
    return [p for _, p in sorted(listed)]


def main() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out: Dict[str, Any] = {}
    for name, (make, scale, compiles) in optimizers().items():
        out[f"{name}/rewrite"] = rewrite(scale)
        for mode in ("eager", "compiled") if compiles else ("eager",):
            for kind in ("plain", "ours"):
                out[f"{name}/{mode}/{kind}"] = run(strategy, name, make, kind, mode == "compiled")
    for mode in ("eager", "compiled"):
        for kind in ("plain", "ours"):
            out[f"order/{mode}/{kind}"] = order(strategy, kind, mode == "compiled")
    # The resolver patch is in place only while a thread acts for a replica.
    from tensorflow.python.distribute import distribute_lib
    from tensorflow.python.eager import tape as eager_tape

    out["resolver_is_tensorflows"] = (
        eager_tape._variables_override is distribute_lib.get_local_results_or_value_container
    )
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
