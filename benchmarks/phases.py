"""``python -m benchmarks.phases``: the eager meta step, phase by phase.

The meta step of ``benchmarks.workloads.meta_step`` (an inner ``assign_sub``
step inside the tape, then the outer gradient) is run three ways in one
process, each phase timed with ``time.perf_counter``:

* ``written``: the written program under an ``AssignAwareTape`` (the candidate);
* ``functional``: the rewrite, under ``tf.GradientTape`` (the baseline);
* ``written, plain tape``: the written program under a ``tf.GradientTape``. Its
  gradient is wrong (TensorFlow's tape does not follow the writes) and cheaper,
  but up to the outer gradient it runs the same TensorFlow ops and layers as
  the candidate. Against it, each phase before the gradient shows what
  assigntape itself costs; against the rewrite, what the written form costs
  in TensorFlow as well.

Each round runs the three in an order that alternates, ``--steps`` times
each; a phase's figure is the median over ``--rounds`` rounds of the per-step
difference. One thread for TensorFlow's ops, as in ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable, Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

PHASES = [
    "reset",
    "enter",
    "inner forward",
    "inner gradient",
    "writes (rewrite: p - lr*g)",
    "outer forward",
    "exit",
    "outer gradient",
]


def programs() -> Dict[str, Callable[[List[float]], None]]:
    """name -> a step that adds each phase's seconds to the list it is given."""
    from assigntape import AssignAwareTape
    from benchmarks import workloads as w

    params = w.net()
    start = [tf.Variable(p) for p in params]
    lr = tf.Variable(0.01)
    x, y = w.data(seed=2)
    clock = time.perf_counter

    def program(tape_cls: type, update: Callable[[List[Any]], List[Any]]) -> Callable[[List[float]], None]:
        def step(acc: List[float]) -> None:
            t = [clock()]
            for p, s in zip(params, start):
                p.assign(s)
            t.append(clock())
            with tape_cls() as outer:
                t.append(clock())
                with tf.GradientTape() as inner:
                    inner_loss = tf.reduce_mean((w.forward(params, x) - y) ** 2)
                t.append(clock())
                grads = inner.gradient(inner_loss, params)
                t.append(clock())
                weights = update(grads)
                t.append(clock())
                outer_loss = tf.reduce_mean((w.forward(weights, x) - 2.0 * y) ** 2)
                t.append(clock())
            t.append(clock())
            outer.gradient(outer_loss, [lr] + params)
            t.append(clock())
            for i in range(len(PHASES)):
                acc[i] += t[i + 1] - t[i]

        return step

    def write(grads: List[Any]) -> List[Any]:
        for p, g in zip(params, grads):
            p.assign_sub(lr * g)
        return params

    def rebind(grads: List[Any]) -> List[Any]:
        return [p - lr * g for p, g in zip(params, grads)]

    return {
        "written": program(AssignAwareTape, write),
        "functional": program(tf.GradientTape, rebind),
        "written, plain tape": program(tf.GradientTape, write),
    }


def measure(rounds: int, steps: int) -> Dict[str, List[float]]:
    """Phase -> [candidate - rewrite, candidate - written under a plain tape],
    microseconds a step (medians of the per-round differences)."""
    runs = programs()
    names = list(runs)
    for _ in range(3):
        for name in names:
            runs[name]([0.0] * len(PHASES))
    diffs: Dict[str, List[List[float]]] = {p: [[], []] for p in PHASES}
    for r in range(rounds):
        acc = {name: [0.0] * len(PHASES) for name in names}
        for k in range(steps):
            for name in names if (r + k) % 2 == 0 else reversed(names):
                runs[name](acc[name])
        for i, phase in enumerate(PHASES):
            for j, other in enumerate(("functional", "written, plain tape")):
                diffs[phase][j].append((acc["written"][i] - acc[other][i]) / steps * 1e6)
    return {p: [statistics.median(d) for d in pair] for p, pair in diffs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10, help="steps of each program a round")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    found = measure(args.rounds, args.steps)
    print(
        f"{'phase':28s} {'- rewrite':>12s} {'- written, plain tape':>22s}   (us a step, medians of {args.rounds} rounds)"
    )
    for phase, (vs_rewrite, vs_plain) in found.items():
        plain = "(gradient differs)" if phase == "outer gradient" else f"{vs_plain:+.1f}"
        print(f"{phase:28s} {vs_rewrite:>+12.1f} {plain:>22s}")


if __name__ == "__main__":
    main()
