"""``python -m benchmarks.distributed``: issue #17's figure.

The distributed meta-step through a Keras optimizer against the same step
written per replica by hand, under ``MirroredStrategy`` on two logical CPUs,
paired and interleaved as the drop-in figures are (``benchmarks.paired``):

* candidate: in each replica, an ``AssignAwareTape`` around an inner step
  with Keras 3 ``SGD`` (``apply_gradients`` all-reduces the gradients and
  updates every replica's component in a cross-replica update, which the tape
  differentiates), then the outer loss and its gradient with respect to the
  learning rate and the starting weights;
* baseline: the same step with the all-reduce written by hand
  (``ctx.all_reduce``) and each replica's ``assign_sub`` on its own component
  (``aggregation=NONE`` variables), which needs no cross-replica update.

Both reset the weights first, compiled (``tf.function`` around
``strategy.run``) and eagerly. Target: within 5%. For reference, the same
pair under a plain ``tf.GradientTape`` (no gradient through the writes, no
assigntape): what Keras's step costs over the hand-written one by itself. Saves
``benchmarks/results/<date>-distributed.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
from typing import Any, Callable, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TARGET = 1.05


def _measure_pair(pair: Dict[str, Callable[[], object]], args: argparse.Namespace) -> Dict[str, Any]:
    """Times the pair's two steps paired and interleaved (the ratio assigntape / baseline)."""
    from benchmarks import paired  # after the environment is set (it imports TensorFlow)

    return paired.measure(
        paired.loop_side(pair["assigntape"]),
        paired.loop_side(pair["baseline"]),
        rounds=args.rounds,
        target_s=args.side_ms / 1e3,
        chunk_s=0.01,
        before_round=gc.collect,
    )


def _steps(strategy: Any, compiled: bool, plain: bool = False) -> Dict[str, Callable[[], Any]]:
    """The two sides; with ``plain``, both under a plain ``tf.GradientTape``
    (no gradient through the writes): what the Keras step costs over the
    hand-written one without assigntape."""
    import keras
    import tensorflow as tf

    from assigntape import AssignAwareTape
    from benchmarks.workloads import data, forward, net

    tape = tf.GradientTape if plain else AssignAwareTape

    with strategy.scope():
        params = net()
        start = [tf.Variable(p) for p in params]
        lr = tf.Variable(0.01)
        sgd = keras.optimizers.SGD(learning_rate=lambda: lr * 1.0)
        sgd.build(params)
    x, y = data(seed=2)
    x = tf.concat([x, x * 0.5], 0)
    y = tf.concat([y, y * 0.5], 0)  # a global batch of two different halves
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    batch = next(iter(strategy.experimental_distribute_dataset(dataset.unbatch().batch(x.shape[0]))))

    def replica_step(keras_optimizer: bool) -> Any:
        def step(xb: Any, yb: Any) -> Any:
            with tape() as outer:
                with tf.GradientTape() as inner:
                    inner_loss = tf.reduce_mean((forward(params, xb) - yb) ** 2)
                grads = inner.gradient(inner_loss, params)
                if keras_optimizer:
                    sgd.apply_gradients(zip(grads, params))
                else:
                    ctx = tf.distribute.get_replica_context()
                    for p, g in zip(params, ctx.all_reduce("SUM", grads)):
                        p.assign_sub(lr * g)
                outer_loss = tf.reduce_mean((forward(params, xb) - 2.0 * yb) ** 2)
            return outer.gradient(outer_loss, [lr] + params)

        return step

    def make(keras_optimizer: bool) -> Callable[[], Any]:
        step = replica_step(keras_optimizer)

        def run() -> Any:
            for p, s in zip(params, start):
                p.assign(s)
            return strategy.run(step, batch)

        return tf.function(run) if compiled else run

    return {"assigntape": make(True), "baseline": make(False)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--side-ms", type=float, default=100.0)
    parser.add_argument("--modes", nargs="*", default=["compiled", "eager"])
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

    from benchmarks import paired
    from benchmarks.__main__ import RESULTS, _dumps, _git, _machine

    figures = {}
    for mode in args.modes:
        steps = _steps(strategy, mode == "compiled")
        for _ in range(3):
            got, want = steps["assigntape"](), steps["baseline"]()
        # The two sides compute the same meta-gradients, replica by replica.
        for g, w in zip(
            tf.nest.flatten(strategy.experimental_local_results(got)),
            tf.nest.flatten(strategy.experimental_local_results(want)),
        ):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-6)
        print(f"timing the distributed meta-step [{mode}] ...", file=sys.stderr, flush=True)
        res = _measure_pair(steps, args)
        res.update(target=TARGET)
        figures[mode] = res
        median, lo, hi = res["median"], res["lo"], res["hi"]
        verdict = paired.verdict(lo, hi, TARGET)
        print(
            f"Keras SGD step vs per-replica step by hand [{mode}]: {median:.3f} [{lo:.3f}, {hi:.3f}] "
            f"(target <= {TARGET}): {verdict}"
        )
        # The same pair under a plain tf.GradientTape: Keras's own cost.
        plain = _steps(strategy, mode == "compiled", plain=True)
        for _ in range(3):
            plain["assigntape"](), plain["baseline"]()
        ref = _measure_pair(plain, args)
        figures[f"{mode}_plain_tape"] = ref
        print(
            f"  the same pair under a plain tf.GradientTape (no assigntape) [{mode}]: "
            f"{ref['median']:.3f} [{ref['lo']:.3f}, {ref['hi']:.3f}]"
        )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H%M%S")
    summary = {
        "date": stamp,
        "machine": _machine(),
        "git": _git(),
        "tensorflow": tf.__version__,
        "load_avg": os.getloadavg(),
        "figures": {m: {k: f.get(k) for k in ("median", "lo", "hi", "target")} for m, f in figures.items()},
    }
    (RESULTS / f"{stamp}-distributed.json").write_text(_dumps(summary))


if __name__ == "__main__":
    main()
