"""``python -m benchmarks.profile``: where the time goes, by cProfile.

Profiles, after a warm-up (the first tape installs the patches; that one-time
cost is not profiled):

(a) 20,000 ``with AssignAwareTape(): pass``;
(b) the eager no-write step (8 tanh layers 64x64, batch 32, forward and
    ``gradient``) under AssignAwareTape;
(c) the eager meta step (inner ``assign_sub`` step inside the tape, outer
    gradient);

and prints the top functions of each by tottime (time in the function
itself), then the total tottime of assigntape's own functions and their top 5. ``--steps N`` sets the number of steps of (b) and (c), ``--top K``
the number of functions printed, ``--baseline`` also profiles each program's
baseline (``tf.GradientTape``, the functional rewrite) for comparison.

Run it as a module (``python -m benchmarks.profile``): run as a script, this
file's directory would come first on ``sys.path`` and this ``profile`` would
shadow the standard library's, which ``cProfile`` imports.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: do not shadow the stdlib's profile
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _profile(label: str, fn, calls: int, top: int) -> None:
    for _ in range(3):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream)
    total = stats.total_tt
    print(f"\n=== {label}: {calls} calls, {total:.3f} s profiled ({total / calls * 1e6:.1f} us per call) ===")
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    print(f"{'tottime s':>10} {'% of total':>10} {'us per call of it':>18} {'ncalls':>10}  function")
    for (path, line, name), (_cc, nc, tt, _ct, _callers) in rows:
        where = f"{_short(path)}:{line}({name})" if line else name
        print(f"{tt:>10.3f} {tt / total * 100:>9.1f}% {tt / calls * 1e6:>18.2f} {nc:>10}  {where}")
    ours = sorted(((k, v) for k, v in stats.stats.items() if _ours(k[0])), key=lambda kv: kv[1][2], reverse=True)
    own = sum(v[2] for _, v in ours)
    print(
        f"assigntape's own functions (tottime, under cProfile): {own:.3f} s, {own / total * 100:.1f}% of the total, "
        f"{own / calls * 1e6:.1f} us per call; the top {min(5, len(ours))}:"
    )
    for (path, line, name), (_cc, nc, tt, _ct, _callers) in ours[:5]:
        print(f"    {tt / calls * 1e6:8.2f} us per call  {nc:>8} calls  {_short(path)}:{line}({name})")


def _ours(path: str) -> bool:
    return f"{os.sep}assigntape{os.sep}" in path


def _short(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/", "/work/main/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile")
    parser.add_argument("--tapes", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--baseline", action="store_true")
    args = parser.parse_args()

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    from benchmarks import workloads

    programs = [
        ("(a) with AssignAwareTape(): pass", workloads.enter_exit(), args.tapes),
        ("(b) no-write step [eager]", workloads.no_writes(False), args.steps),
        ("(c) meta step [eager]", workloads.meta_step(False), max(1, args.steps // 4)),
    ]
    for label, steps, calls in programs:
        _profile(label + ", AssignAwareTape", steps["assigntape"], calls, args.top)
        if args.baseline:
            _profile(label + ", baseline", steps["baseline"], calls, args.top)


if __name__ == "__main__":
    main()
