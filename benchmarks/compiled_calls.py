"""Eager calls of ``tf.function``s once a tape's function was traced (issue #38).

``python -m benchmarks.compiled_calls [--rounds N] [--side-ms MS]``

Once any tape's function has been traced in the process, a call of every
function's graph asks whether it writes variables (``_compiled_tapes``: the
call of a function that writes is noted, against other threads' calls of a
tape's graph). The figures: what that adds to one eager call, paired and
interleaved (``benchmarks.paired``), the call timed with the tape's graph
noted (candidate) and with no graph noted (baseline, as in a process where no
tape was ever traced in a function), switched chunk by chunk in one process:

* ``reads``: a function that reads a variable and writes nothing (a Keras
  model's inference step, say);
* ``writes``: a function that writes a variable (``assign_add``).

Saves ``benchmarks/results/<date>-compiled-calls.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
from typing import Any, Callable, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _noted_side(step: Callable[[], Any], noted: Dict[Any, Any], on: bool) -> Any:
    """A side that times ``step`` with the tape's graph noted (``on``) or
    not, switched before its timer starts."""
    from assigntape import _registry
    from benchmarks import paired

    timed = paired.loop_side(step)

    def run(reps: int) -> Any:
        if on and not _registry.tape_graphs:
            _registry.tape_graphs.update(noted)
        elif not on and _registry.tape_graphs:
            _registry.tape_graphs.clear()
        return timed(reps)

    return run


def measure(rounds: int, target_s: float, chunk_s: float) -> Dict[str, Dict[str, Any]]:
    import tensorflow as tf

    from assigntape import AssignAwareTape, _registry
    from benchmarks import paired

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    # Scalars: the call's own cost (TensorFlow's) is the rest of the figure.
    v = tf.Variable(1.0)
    x = tf.constant(2.0)

    @tf.function
    def tape_step() -> Any:
        with AssignAwareTape() as tape:
            v.assign_sub(0.01 * v)
            loss = v * x
        return tape.gradient(loss, v)

    traced = tape_step.get_concrete_function()  # traced, kept: its graph is noted
    assert traced.graph in _registry.tape_graphs
    noted = dict(_registry.tape_graphs)
    w = tf.Variable(0.0)
    reads = tf.function(lambda: v * x)
    writes = tf.function(lambda: w.assign_add(x))
    out = {}
    for name, step in (("reads", reads), ("writes", writes)):
        for _ in range(3):
            step()
        res = paired.measure(
            _noted_side(step, noted, True),
            _noted_side(step, noted, False),
            rounds=rounds,
            target_s=target_s,
            chunk_s=chunk_s,
            kind="diff_us",
            before_round=gc.collect,
        )
        for key in ("candidate_s", "baseline_s"):
            res.pop(key)
        res["label"] = f"eager call of a function that {name[:-1]}s, a tape's graph noted - none noted"
        out[name] = res
    _registry.tape_graphs.update(noted)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compiled_calls", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=51)
    parser.add_argument("--side-ms", type=float, default=50.0)
    args = parser.parse_args()
    figures = measure(args.rounds, args.side_ms / 1e3, 0.002)
    for res in figures.values():
        print(
            f"{res['label']}: {res['median']:+.2f} [{res['lo']:+.2f}, {res['hi']:+.2f}] us a call "
            f"({res['baseline_us_per_call']:.1f} us none noted, {res['candidate_us_per_call']:.1f} us noted)"
        )
    from benchmarks.__main__ import RESULTS, _git

    date = datetime.datetime.now(datetime.timezone.utc)
    summary = {
        "date": date.isoformat(timespec="seconds"),
        "git": _git(),
        "load_avg": os.getloadavg(),
        "figures": figures,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{date.strftime('%Y-%m-%dT%H%M%S')}-compiled-calls.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
