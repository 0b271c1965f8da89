"""``python -m benchmarks [--quick]``: the figures of issue #11 ("Drop-in at zero
cost"), each paired and interleaved against its baseline (see
``benchmarks.paired``), with bootstrap 95% intervals, the targets and whether
each interval is under its target.

The "plain TensorFlow outside any tape" figures compare two long-lived worker
processes (``benchmarks.worker``): one that used an AssignAwareTape (patches
installed, dormant), one that never imported assigntape. The parent asks each
in turn, alternating which goes first, to time one side of a round. The same
cases are also timed in this process, the patches installed on one side and
removed on the other (``outside_same_process_*``): no difference between two
processes' memory layouts, only what the dormant patches cost.

``--quick`` takes about 1-3 minutes; the full run about 10-20. Each run saves
``benchmarks/results/latest.json`` (everything, with every round's times) and
a small summary ``benchmarks/results/<date>-<mode>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"

PER_WRITE_N = 100

# name, label, unit, kind, target (None: report only), modes
IN_PROCESS = [
    ("enter_exit", "tape enter+exit, AssignAwareTape - tf.GradientTape", "us", "diff_us", 10.0),
    ("no_write_eager", "no-write step vs tf.GradientTape [eager]", "x", "ratio", 1.02),
    ("no_write_compiled", "no-write step vs tf.GradientTape [compiled]", "x", "ratio", 1.01),
    ("meta_eager", "meta step vs functional rewrite [eager]", "x", "ratio", 1.05),
    ("meta_compiled", "meta step vs functional rewrite [compiled]", "x", "ratio", 1.02),
    ("per_write_eager", f"per-write cost, {PER_WRITE_N} writes vs rebindings [eager]", "us", "diff_us", None),
    ("per_write_compiled", f"per-write cost, {PER_WRITE_N} writes vs rebindings [compiled]", "us", "diff_us", None),
]
OUTSIDE_TARGET = 1.01
OUTSIDE_QUICK = ["no_write_eager", "keras_optimizer_loop", "keras_fit_epoch"]
OUTSIDE_FULL = ["no_write_eager", "no_write_compiled", "keras_optimizer_loop", "keras_fit_epoch"]

MODES = {
    # rounds per figure, and per outside-any-tape figure; seconds per side of
    # a round, seconds per chunk (in this process; in the workers, where each
    # chunk is a request); worker process pairs. The outside figures get twice
    # the rounds and six process pairs: their target is 1% and what they
    # compare differs by less, where a round's ratio scatters by more, and
    # the median of one process pair differs from another's by up to 2.5%.
    "quick": {
        "rounds": 25,
        "outside_rounds": 25,
        "target_s": 0.05,
        "chunk_s": 0.002,
        "worker_chunk_s": 0.01,
        "pairs": 1,
    },
    "full": {
        "rounds": 101,
        "outside_rounds": 201,
        "target_s": 0.15,
        "chunk_s": 0.002,
        "worker_chunk_s": 0.01,
        "pairs": 6,
    },
}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _steps(name: str):
    from benchmarks import workloads

    if name == "enter_exit":
        return workloads.enter_exit()
    kind, mode = name.rsplit("_", 1)
    compiled = mode == "compiled"
    if kind == "no_write":
        return workloads.no_writes(compiled)
    if kind == "meta":
        return workloads.meta_step(compiled)
    if kind == "per_write":
        return workloads.writes_per_tape(PER_WRITE_N, compiled=compiled)
    raise KeyError(name)


def _in_process(names: List[str], cfg: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    from assigntape import AssignAwareTape
    from benchmarks import paired

    with AssignAwareTape():  # install the patches once, outside every figure
        pass
    out = {}
    for name, label, unit, kind, target in IN_PROCESS:
        if name not in names:
            continue
        _log(f"timing {label} ...")
        steps = _steps(name)
        for _ in range(3):  # warm caches and the wrappers
            steps["assigntape"]()
            steps["baseline"]()
        cand = steps["baseline" if cfg["aa"] else "assigntape"]
        res = paired.measure(
            paired.loop_side(cand),
            paired.loop_side(steps["baseline"]),
            rounds=cfg["rounds"],
            target_s=cfg["target_s"],
            chunk_s=cfg["chunk_s"],
            kind=kind,
            before_round=gc.collect,
            per=PER_WRITE_N if name.startswith("per_write") else 1.0,
            clock=cfg["clock"],
        )
        res.update(label=("A/A: " if cfg["aa"] else "") + label, unit=unit, target=target)
        out[name] = res
        del steps
    return out


class Worker:
    """One ``benchmarks.worker`` process."""

    def __init__(self, assigntape: bool, threads: int, log_dir: str):
        import assigntape as _at

        src = str(pathlib.Path(_at.__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([src, str(HERE.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.role = "assigntape" if assigntape else "plain"
        self.log_path = os.path.join(log_dir, f"worker-{self.role}-{id(self)}.log")
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "benchmarks.worker", f"--threads={threads}"]
        if assigntape:
            cmd.append("--assigntape")
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=str(HERE.parent),
            env=env,
            bufsize=1,
        )

    def ask(self, req: Dict[str, Any]) -> Dict[str, Any]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self._log.flush()
            raise RuntimeError(
                f"worker {self.role} died; see {self.log_path}:\n" + pathlib.Path(self.log_path).read_text()[-3000:]
            )
        return json.loads(line)

    def side(self, case: str):
        def run(reps: int):
            reply = self.ask({"op": "time", "case": case, "reps": reps})
            return reply["wall"], reply["cpu"]

        return run

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
        self._log.close()


def _patches_side(step: Any, installed: bool) -> Any:
    """A side that runs ``step`` with the patches installed (dormant, as after
    a tape) or removed, switched before its timer starts."""
    from assigntape import _patches, _versions
    from benchmarks import paired

    timed = paired.loop_side(step)

    def run(reps: int):
        if installed != _patches.installed():
            if installed:
                _patches.acquire()  # (no holder: installs only)
                # As in a process whose last tape is long gone: the wrappers
                # TensorFlow's code calls are off again (``_versions.idle``).
                _versions.idle(wait=0.0)
            else:
                _patches.remove_unused()
            # One call untimed: switching sets hundreds of attributes, which
            # leaves the caches (CPython's and the CPU's) cold for the first
            # call after it, unevenly between the two sides.
            step()
        return timed(reps)

    return run


def _outside_same_process(cases: List[str], cfg: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The outside-any-tape figures in one process, without the differences
    between two processes: the patches installed and dormant on one side,
    removed (``uninstall``) on the other, switched chunk by chunk."""
    from benchmarks import paired, worker, workloads

    out: Dict[str, Dict[str, Any]] = {}
    for case in cases:
        label = ("A/A: " if cfg["aa"] else "") + "outside any tape, one process: " + worker.CASES[case]
        _log(f"timing {label} ...")
        step = worker.build(case)
        workloads.writes_per_tape(3)["assigntape"]()  # a tape with writes and a gradient, then closed
        gc.collect()
        for _ in range(3):
            step()
        cand = _patches_side(step, installed=not cfg["aa"])
        base = _patches_side(step, installed=False)
        res = paired.measure(
            cand,
            base,
            rounds=cfg["outside_rounds"],
            target_s=cfg["target_s"],
            chunk_s=cfg["worker_chunk_s"],
            kind="ratio",
            before_round=gc.collect,
            clock=cfg["clock"],
        )
        res.update(label=label, unit="x", target=OUTSIDE_TARGET)
        out["outside_same_process_" + case] = res
        _patches_side(step, installed=True)(0)  # leave them installed, as the other figures expect
    return out


def _outside(cases: List[str], cfg: Dict[str, Any], threads: int) -> Dict[str, Dict[str, Any]]:
    from benchmarks import paired, worker

    out: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as log_dir:
        _log(f"starting {cfg['pairs']} pair(s) of worker processes ...")
        pairs = [
            (Worker(not cfg["aa"], threads, log_dir), Worker(False, threads, log_dir)) for _ in range(cfg["pairs"])
        ]
        try:
            infos = [[w.ask({"op": "info"}) for w in pair] for pair in pairs]
            for cinfo, binfo in infos:
                assert cinfo["patches_installed"] != cfg["aa"] and not binfo["assigntape_imported"], infos
            for case in cases:
                label = ("A/A: " if cfg["aa"] else "") + "outside any tape: " + worker.CASES[case]
                _log(f"timing {label} ...")
                # The same repetitions in every process: calibrated on the first pair.
                plan = paired.calibrate(
                    pairs[0][0].side(case), pairs[0][1].side(case), cfg["target_s"], cfg["worker_chunk_s"]
                )
                per_pair = []
                for cand, base in pairs:
                    # Rounds split among the pairs: differences between processes
                    # (memory layout, ...) then show in the pooled median.
                    n = max(5, cfg["outside_rounds"] // len(pairs))
                    per_pair.append(
                        paired.measure(
                            cand.side(case),
                            base.side(case),
                            rounds=n,
                            target_s=cfg["target_s"],
                            chunk_s=cfg["worker_chunk_s"],
                            plan=plan,
                            clock=cfg["clock"],
                            before_round=lambda c=cand, b=base: (c.ask({"op": "gc"}), b.ask({"op": "gc"})),
                        )
                    )
                reps = plan[0] * plan[1]
                tc = [t for r in per_pair for t in r["candidate_s"]]
                tb = [t for r in per_pair for t in r["baseline_s"]]
                res = paired.figure(tc, tb, kind="ratio", reps=reps, clock=cfg["clock"])
                other = paired.figure(tc, tb, kind="ratio", reps=reps, clock="wall" if cfg["clock"] == "cpu" else "cpu")
                other.pop("candidate_s"), other.pop("baseline_s")
                res.update(
                    other_clock=other,
                    chunk_reps=plan[0],
                    chunks=plan[1],
                    per_pair_median=[r["median"] for r in per_pair],
                    label=label,
                    unit="x",
                    target=OUTSIDE_TARGET,
                )
                out["outside_" + case] = res
        finally:
            for pair in pairs:
                for w in pair:
                    w.close()
    return out


def _fmt(res: Dict[str, Any]) -> str:
    if res["unit"] == "us":
        return f"{res['median']:+.1f} [{res['lo']:+.1f}, {res['hi']:+.1f}] us"
    return f"{res['median']:.3f} [{res['lo']:.3f}, {res['hi']:.3f}]"


def _target(res: Dict[str, Any]) -> str:
    if res["target"] is None:
        return "report"
    return f"<= {res['target']:+.0f} us" if res["unit"] == "us" else f"<= {res['target']:.2f}x"


def _width(res: Dict[str, Any]) -> str:
    if res["unit"] == "us":
        return f"{res['hi'] - res['lo']:.1f} us"
    return f"{(res['hi'] - res['lo']) * 100:.1f}%"


def _print_table(figures: Dict[str, Dict[str, Any]]) -> None:
    from benchmarks.paired import verdict

    print()
    head = f"{'figure':<72} {'target':>11}  {'median [95% interval]':<28} {'width':>8}  {'verdict':<10} {'base / cand us per call':>24}  {'other clock: median'}"
    print(head)
    print("-" * len(head))
    for res in figures.values():
        res["verdict"] = verdict(res["lo"], res["hi"], res["target"])
        print(
            f"{res['label']:<72} {_target(res):>11}  {_fmt(res):<28} {_width(res):>8}  {res['verdict']:<10} "
            f"{res['baseline_us_per_call']:>11.1f} / {res['candidate_us_per_call']:<10.1f}  "
            f"{res['other_clock']['clock']} {_fmt(dict(res['other_clock'], unit=res['unit'])).split(' [')[0]}"
        )


def _print_pairs(figures: Dict[str, Dict[str, Any]]) -> None:
    rows = [(r["label"], r["per_pair_median"]) for r in figures.values() if len(r.get("per_pair_median", [])) > 1]
    if rows:
        print(
            "\nouter figures, median of each worker pair (the interval above covers round-to-round noise,"
            " not differences between processes):"
        )
        for label, meds in rows:
            print(f"  {label}: " + ", ".join(f"{m:.3f}" for m in meds))


def _dumps(obj: Any) -> str:
    """Indented JSON with lists of numbers (and lists of those) on one line each."""
    text = json.dumps(obj, indent=1)
    flat = re.compile(r"\[\s*([-0-9.eE+]+(?:,\s*[-0-9.eE+]+)*)\s*\]")
    text = flat.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    nested = re.compile(r"\[\s*(\[[^\[\]\n]*\](?:,\s*\[[^\[\]\n]*\])*)\s*\]")
    return nested.sub(lambda m: "[" + re.sub(r"\],\s*\[", "], [", m.group(1)) + "]", text)


def _git() -> Dict[str, Any]:
    def run(*args: str) -> Optional[str]:
        try:
            return subprocess.run(
                ["git", "--no-optional-locks", *args], cwd=HERE.parent, capture_output=True, text=True, check=True
            ).stdout.strip()
        except Exception:
            return None

    status = run("status", "--porcelain", "--untracked-files=no")
    return {"commit": run("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def _machine() -> Dict[str, Any]:
    model = None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": model or platform.processor(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and cases (about 1-3 minutes)")
    parser.add_argument("--rounds", type=int, help="rounds per figure (quick 25, full 101; outside any tape 201)")
    parser.add_argument("--side-ms", type=float, help="milliseconds per side of a round (quick 50, full 150)")
    parser.add_argument("--pairs", type=int, help="worker process pairs for the outside-tape figures")
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="the time the figures are of: process CPU time (default) or wall time; both are saved",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="TensorFlow intra- and inter-op threads in every process (0: TensorFlow's default)",
    )
    parser.add_argument(
        "--only", nargs="*", help="figure names to run (e.g. enter_exit meta_eager outside_keras_fit_epoch)"
    )
    parser.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure memory (benchmarks.memory; default: on in the full run, off with --quick)",
    )
    parser.add_argument(
        "--aa",
        action="store_true",
        help="A/A check of the harness: every figure with the baseline on both sides "
        "(two plain workers); the ratios should be 1 and the differences 0",
    )
    args = parser.parse_args()

    mode = "quick" if args.quick else "full"
    cfg = dict(MODES[mode])
    if args.rounds:
        cfg["rounds"] = cfg["outside_rounds"] = args.rounds
    if args.side_ms:
        cfg["target_s"] = args.side_ms / 1e3
    if args.pairs:
        cfg["pairs"] = args.pairs
    cfg["clock"] = args.clock
    cfg["aa"] = args.aa
    run_name = mode + ("-aa" if args.aa else "")
    with_memory = (mode == "full") if args.memory is None else args.memory

    import tensorflow as tf

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    names = [n for n, *_ in IN_PROCESS]
    outside = OUTSIDE_QUICK if mode == "quick" else OUTSIDE_FULL
    same_process = OUTSIDE_QUICK if mode == "quick" else OUTSIDE_FULL
    if args.only:
        names = [n for n in names if n in args.only]
        outside = [c for c in OUTSIDE_FULL if "outside_" + c in args.only]
        same_process = [c for c in OUTSIDE_FULL if "outside_same_process_" + c in args.only]

    started = time.time()
    load_before = os.getloadavg()
    figures = _in_process(names, cfg)
    if same_process:
        figures.update(_outside_same_process(same_process, cfg))
    if outside:
        figures.update(_outside(outside, cfg, args.threads))
    _print_table(figures)
    _print_pairs(figures)

    mem = None
    if with_memory:
        _log("measuring memory (benchmarks.memory) ...")
        from benchmarks import memory

        mem = memory.measure()
        print()
        memory.print_report(mem)

    elapsed = time.time() - started
    date = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "date": date.isoformat(timespec="seconds"),
        "mode": run_name,
        "config": cfg,
        "threads": args.threads,
        "elapsed_s": round(elapsed, 1),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "machine": _machine(),
        "tensorflow": tf.__version__,
        "git": _git(),
    }
    import keras

    meta["keras"] = keras.__version__
    summary = dict(
        meta,
        figures={
            name: {
                k: (round(v, 4) if isinstance(v, float) else v)
                for k, v in res.items()
                if k
                in (
                    "label",
                    "unit",
                    "target",
                    "median",
                    "lo",
                    "hi",
                    "verdict",
                    "rounds",
                    "reps",
                    "baseline_us_per_call",
                    "candidate_us_per_call",
                )
            }
            for name, res in figures.items()
        },
        memory=mem,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(_dumps(dict(meta, figures=figures, memory=mem)))
    stamp = date.strftime("%Y-%m-%dT%H%M%S")
    (RESULTS / f"{stamp}-{run_name}.json").write_text(_dumps(summary))
    print(
        f"\n{run_name} run, {elapsed / 60:.1f} min, load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}; "
        f"saved {RESULTS / 'latest.json'} and {RESULTS / f'{stamp}-{run_name}.json'}"
    )


if __name__ == "__main__":
    main()
