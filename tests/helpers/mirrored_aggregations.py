"""Run in a fresh process: the MirroredStrategy step of ``mirrored_meta_step``
for each synchronization and aggregation of the written variable, and a write
in a tf.cond branch in replica context. Prints one JSON line: per case, the step's
results or the error it raised (type and message)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from assigntape import AssignAwareTape  # noqa: E402
from helpers.mirrored_meta_step import TASKS, W0, run_step  # noqa: E402


def _outcome(fn):
    try:
        return {"result": fn()}
    except Exception as e:  # noqa: BLE001 - the test looks at what was raised
        return {"error": type(e).__name__, "message": str(e)}


def _unread_write(strategy):
    """``assign_add`` of a MEAN-aggregated variable that the replica's tape has
    not read yet, then a read of it."""
    with strategy.scope():
        v = tf.Variable(1.0, aggregation=tf.VariableAggregation.MEAN)
        x = tf.Variable(2.0)

    def step():
        with AssignAwareTape() as tape:
            v.assign_add(x * 3.0)
            loss = v * 1.0
        return loss, tape.gradient(loss, x)

    loss, grad = strategy.run(step)
    return {
        "loss": [float(t) for t in strategy.experimental_local_results(loss)],
        "grad": [float(t) for t in strategy.experimental_local_results(grad)],
    }


def _cut_write(strategy, compiled, cut=True):
    """A ``merge_call`` of the user's own that updates a MEAN-aggregated
    variable (by 6), under ``untracked_writes="cut"``: a new version with no
    gradient path, then a read of it. Per replica: the loss, d loss / d x,
    and how many warnings."""
    import warnings

    with strategy.scope():
        v = tf.Variable(1.0, aggregation=tf.VariableAggregation.MEAN)
        x = tf.Variable(2.0)

    def update(strategy):
        return strategy.extended.update(v, lambda c, d: c.assign_add(d), args=(tf.constant(6.0),))

    def step():
        with AssignAwareTape(untracked_writes="cut" if cut else "raise") as tape:
            tf.distribute.get_replica_context().merge_call(update)
            loss = v * x
        return loss, tape.gradient(loss, x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grad = strategy.run(tf.function(step) if compiled else step)
    return {
        "loss": [float(t) for t in strategy.experimental_local_results(loss)],
        "grad": [float(t) for t in strategy.experimental_local_results(grad)],
        "v": float(v.numpy()),
        "warned": sum("no gradient flows through that write" in str(w.message) for w in caught),
    }


def _reduction(strategy, compiled, how):
    """A value the replica's tape recorded (x * c, c = 1 on replica 0 and 3 on
    replica 1), summed over the replicas ``how``: ``"all_reduce"`` (in replica
    context, TensorFlow's own gradient), ``"merge_call"`` (a merge_call of the
    user's own, with ``batch_reduce_to`` to the replicas' devices) or
    ``"one_device"`` (``reduce_to`` one device). Per replica: the loss
    (the sum squared) and d loss / d x."""
    with strategy.scope():
        x = tf.Variable(2.0)
    sum_ = tf.distribute.ReduceOp.SUM

    def merge(strategy, value):
        if how == "one_device":
            return strategy.extended.reduce_to(sum_, value, "/cpu:0")
        return strategy.extended.batch_reduce_to(sum_, [(value, x)])[0]

    def step(c):
        with AssignAwareTape() as tape:
            y = x * c
            ctx = tf.distribute.get_replica_context()
            s = ctx.all_reduce(sum_, y) if how == "all_reduce" else ctx.merge_call(merge, args=(y,))
            loss = s * s
        return loss, tape.gradient(loss, x)

    cs = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([1.0, 3.0][ctx.replica_id_in_sync_group])
    )
    loss, grad = strategy.run(tf.function(step) if compiled else step, args=(cs,))
    return {
        "loss": [float(t) for t in strategy.experimental_local_results(loss)],
        "grad": [float(t) for t in strategy.experimental_local_results(grad)],
    }


def _cond_step(strategy):
    """The step with its write inside an autograph ``if`` on a tensor, compiled."""
    with strategy.scope():
        w = tf.Variable(W0)
        lr = tf.Variable(0.1)

    @tf.function
    def step(x, flag):
        with AssignAwareTape() as outer:
            with tf.GradientTape() as inner:
                inner_loss = tf.reduce_sum((w * x) ** 2)
            grads = inner.gradient(inner_loss, w)
            if flag:
                w.assign_sub(lr * grads)
            outer_loss = tf.reduce_sum((w * x - 1.0) ** 2)
        return outer.gradient(outer_loss, [lr, w])

    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(TASKS[ctx.replica_id_in_sync_group])
    )
    d_lr, d_w = strategy.run(step, args=(xs, tf.constant(True)))
    return [
        [float(r_lr), [float(v) for v in r_w]]
        for r_lr, r_w in zip(strategy.experimental_local_results(d_lr), strategy.experimental_local_results(d_w))
    ]


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
    out["unread_aggregated_write"] = _outcome(lambda: _unread_write(strategy))
    out["cond_write_in_replica_context"] = _outcome(lambda: _cond_step(strategy))
    for compiled in (False, True):
        out[f"cut_aggregated_write_{'function' if compiled else 'eager'}"] = _outcome(
            lambda: _cut_write(strategy, compiled)
        )
    out["merge_call_aggregated_write"] = _outcome(lambda: _cut_write(strategy, False, cut=False))
    for how in ("all_reduce", "merge_call", "one_device"):
        for compiled in (False, True):
            out[f"reduction_{how}_{'function' if compiled else 'eager'}"] = _outcome(
                lambda: _reduction(strategy, compiled, how)
            )
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
