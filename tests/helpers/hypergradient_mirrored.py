"""Run in a fresh process (logical devices must be set before TensorFlow
starts): the ``hypergradient_lr`` example's ``--strategy mirrored`` run (SGD-HD
trained with ``fit`` on one device and under MirroredStrategy on two logical
CPUs), compiled and eagerly, and the example's plain single-device run on the
same batches. Prints one JSON line: the learning rates after each step."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from assigntape.examples import hypergradient_lr  # noqa: E402

STEPS = 25


def main() -> None:
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(hypergradient_lr._two_cpus())
    out = {}
    for mode, compiled in (("eager", False), ("compiled", True)):
        config = hypergradient_lr.Config(steps=STEPS, plot=None, progress=False, compiled=compiled)
        out[mode] = hypergradient_lr.run_distributed(config, strategy)["rates"]
    plain = hypergradient_lr.run(hypergradient_lr.Config(steps=STEPS, plot=None, progress=False))
    out["run"] = plain["runs"]["SGD-HD, lr0 10x too small (0.1)"]["lr"]
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
