"""Run in a fresh process: an in-process cluster on loopback (2 workers, 2
parameter servers, ports picked free) and a ``ClusterCoordinator``; a
Meta-SGD step scheduled on a worker, with plain and sharded variables. Prints
one JSON line. The servers stop with the process."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")

import tensorflow as tf  # noqa: E402

from helpers import free_ports  # noqa: E402

W0 = [1.0, 2.0, 3.0, 4.0]
X = [0.5, 1.5, -1.0, 0.25]
LR = 0.1


def _cluster(workers: int = 2, ps: int = 2) -> Any:
    ports = free_ports(workers + ps)
    spec = tf.train.ClusterSpec(
        {
            "worker": [f"127.0.0.1:{p}" for p in ports[:workers]],
            "ps": [f"127.0.0.1:{p}" for p in ports[workers:]],
        }
    )
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = 4  # 1 deadlocks the worker's function
    for i in range(workers):
        tf.distribute.Server(spec, job_name="worker", task_index=i, config=config, protocol="grpc")
    for i in range(ps):
        tf.distribute.Server(spec, job_name="ps", task_index=i, protocol="grpc")
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")


def _outcome(fn: Any) -> Dict[str, Any]:
    try:
        return {"result": fn()}
    except Exception as e:  # noqa: BLE001 - the test looks at what was raised
        return {"error": type(e).__name__, "message": str(e)[:2000]}


def main() -> None:
    from assigntape import AssignAwareTape

    resolver = _cluster()
    out: Dict[str, Any] = {}
    x = tf.constant(X)
    for sharded in (False, True):
        partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(2) if sharded else None
        strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
        coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            w, lr = tf.Variable(W0), tf.Variable(LR)
        label = "sharded" if sharded else "plain"
        out[f"{label}/kind"] = type(w).__name__
        shards = list(w.variables) if sharded else [w]

        @tf.function
        def step() -> Any:
            with AssignAwareTape() as outer:
                with tf.GradientTape() as inner:
                    inner_loss = tf.reduce_sum((w * x) ** 2)
                grads = inner.gradient(inner_loss, shards)
                w.assign_sub(lr * tf.concat(grads, 0))  # split across the shards by TensorFlow
                outer_loss = tf.reduce_sum((w * x - 1.0) ** 2)
            d_lr, *d_w = outer.gradient(outer_loss, [lr] + shards)
            return d_lr, tf.concat(d_w, 0), tf.convert_to_tensor(w)

        def run() -> List[Any]:
            w.assign(W0)
            d_lr, d_w, after = coordinator.schedule(step).fetch()
            return [float(d_lr), d_w.tolist(), after.tolist(), tf.convert_to_tensor(w).numpy().tolist()]

        out[f"{label}/step"] = _outcome(run)
        if sharded:

            @tf.function
            def shard_write() -> Any:
                with AssignAwareTape() as tape:
                    first = w.variables[0]
                    first.assign(first * lr)  # one shard written directly
                    loss = tf.reduce_sum(w * x)
                return tape.gradient(loss, [lr] + shards)

            def run_shard_write() -> List[Any]:
                w.assign(W0)
                d_lr, *d_w = coordinator.schedule(shard_write).fetch()
                return [float(d_lr), tf.concat(d_w, 0).numpy().tolist()]

            out["sharded/shard_write"] = _outcome(run_shard_write)

            @tf.function
            def whole_as_source() -> Any:
                with AssignAwareTape() as tape:
                    loss = tf.reduce_sum(w * x)
                return tape.gradient(loss, w)

            out["sharded/whole_as_source"] = _outcome(lambda: coordinator.schedule(whole_as_source).fetch())
        coordinator.join()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
