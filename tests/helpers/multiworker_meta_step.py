"""One worker of a two-worker MultiWorkerMirroredStrategy on loopback, running
the same Meta-SGD-style step as the MirroredStrategy helper, one task per worker,
and the meta-step through Keras optimizers of ``mirrored_optimizers`` (two steps
in a row, eager and compiled).

The test starts two of these with TF_CONFIG naming 127.0.0.1 ports. Each prints
one JSON line with its local replica's results and the cross-worker mean."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from helpers.mirrored_meta_step import run_step  # noqa: E402
from helpers.mirrored_optimizers import _outcome, mirrored  # noqa: E402

KERAS_OPTIMIZERS = ("SGD", "Adam")


def main() -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    result = run_step(strategy)
    result["task_index"] = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    result["keras"] = {
        name: {mode: _outcome(lambda: mirrored(strategy, name, mode == "compiled")) for mode in ("eager", "compiled")}
        for name in KERAS_OPTIMIZERS
    }
    # Keras 3's LossScaleOptimizer (SGD), one step: summed over the workers,
    # the rewrite's meta-gradient.
    from helpers.mirrored_inner_loop import mirrored as inner_loop
    from helpers.mirrored_loss_scale import loss_scale_optimizers, sgd_rewrite

    make = lambda lr: loss_scale_optimizers(lr)["SGD"][0]()  # noqa: E731
    result["loss_scale"] = {
        mode: _outcome(lambda: inner_loop(strategy, make, 1, mode == "compiled")) for mode in ("eager", "compiled")
    }
    result["rewrite_loss_scale"] = sgd_rewrite()
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
