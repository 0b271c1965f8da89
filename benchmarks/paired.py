"""Paired, interleaved timing and its statistics.

A *side* is a function ``time(reps) -> (wall, cpu)`` that runs its step
``reps`` times and returns the elapsed wall time and the CPU time of its
process (all threads: ``time.process_time``), in seconds, measured in this
process or in a worker process (see ``benchmarks.worker``). A figure compares
two sides:

* each round times the candidate and its baseline with the same number of
  calls, interleaved: the round is cut into chunks of a few milliseconds, and
  the two sides alternate chunk by chunk (ABBA: which goes first alternates
  from chunk to chunk and from round to round); each side's round time is
  the sum of its chunks;
* the per-round value is the ratio candidate / baseline, or the difference
  (candidate - baseline) / reps / per, in microseconds;
* the figure is the median of the per-round values, with a bootstrap 95%
  interval (the rounds resampled with replacement, the median of each
  resample, the 2.5th and 97.5th percentiles).

Load from other processes that lasts longer than a chunk slows both sides of
that round alike and cancels in its ratio; a burst that hits one side more
spoils one round, which the median ignores. (Timing whole 20-60 ms blocks
back to back instead gave per-round ratios scattered by +-30% on this
machine under load: the speed of a shared core changes faster than that.)

The figures use CPU time by default (``clock="cpu"``). On a shared 2-core
machine where other test suites keep both cores busy, wall time includes the
time a side waits for a core, which the scheduler hands out in slices of
milliseconds, unevenly between the two sides of a round; CPU time counts only
the work done. The programs do no I/O and no sleeping, so their CPU time is
their cost. Wall times are kept too (``clock="wall"`` figures them).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

Side = Callable[[int], Tuple[float, float]]
CLOCKS = {"wall": 0, "cpu": 1}


def loop_side(step: Callable[[], object]) -> Side:
    """A side that calls ``step`` in this process."""

    def run(reps: int) -> Tuple[float, float]:
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(reps):
            step()
        return time.perf_counter() - wall, time.process_time() - cpu

    return run


def calibrate(cand: Side, base: Side, target_s: float, chunk_s: float) -> Tuple[int, int]:
    """``(reps, chunks)``: calls per chunk for which the slower side takes about
    ``chunk_s`` of CPU time, and chunks per round for about ``target_s`` a side."""
    reps = 1
    while True:
        slower = max(cand(reps)[1], base(reps)[1])
        if slower >= 0.02 or reps >= 10**6:
            break
        reps *= 10 if slower < 0.002 else 3
    per_call = slower / reps
    chunk_reps = max(1, int(round(chunk_s / per_call)))
    chunks = max(1, int(round(target_s / (chunk_reps * per_call))))
    return chunk_reps, chunks


def bootstrap_median(values, resamples: int = 2000, seed: int = 0):
    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    meds = np.median(values[idx], axis=1)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    return float(np.median(values)), float(lo), float(hi)


def measure(
    cand: Side,
    base: Side,
    *,
    rounds: int,
    target_s: float,
    chunk_s: float,
    kind: str = "ratio",
    per: float = 1.0,
    plan: Optional[Tuple[int, int]] = None,
    clock: str = "cpu",
    before_round: Optional[Callable[[], None]] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Dict[str, object]:
    """Time ``rounds`` paired rounds; return the figure and the raw rounds.

    ``kind`` is ``"ratio"`` (candidate / baseline) or ``"diff_us"``
    ((candidate - baseline) / reps / per, in microseconds: ``per`` is the
    number of items one call does, e.g. writes).
    """
    if plan is None:
        plan = calibrate(cand, base, target_s, chunk_s)
    chunk_reps, chunks = plan
    reps = chunk_reps * chunks  # calls per side per round
    cand(chunk_reps), base(chunk_reps)  # discarded, at the final size
    tc: List[Tuple[float, float]] = []
    tb: List[Tuple[float, float]] = []
    for i in range(rounds):
        if before_round is not None:
            before_round()
        c = [0.0, 0.0]
        b = [0.0, 0.0]
        for j in range(chunks):
            # ABBA: the two sides alternate chunk by chunk, and which goes
            # first alternates too, so that a slow spell of the machine
            # (longer than a chunk) falls on both sides alike.
            pair = (cand, base) if (i + j) % 2 == 0 else (base, cand)
            for side in pair:
                w, u = side(chunk_reps)
                acc = c if side is cand else b
                acc[0] += w
                acc[1] += u
        tc.append((c[0], c[1]))
        tb.append((b[0], b[1]))
        if progress is not None and (i + 1) % 10 == 0:
            progress(f"{i + 1}/{rounds}")
    res = figure(tc, tb, kind=kind, reps=reps, per=per, clock=clock)
    res["chunk_reps"], res["chunks"] = chunk_reps, chunks
    res["other_clock"] = figure(tc, tb, kind=kind, reps=reps, per=per, clock="wall" if clock == "cpu" else "cpu")
    for k in ("candidate", "baseline"):
        res["other_clock"].pop(k + "_s")
    return res


def figure(tc, tb, *, kind: str, reps: int, per: float = 1.0, clock: str = "cpu") -> Dict[str, object]:
    """The figure from the rounds' ``(wall, cpu)`` times of each side."""
    col = CLOCKS[clock]
    tc_a, tb_a = np.array(tc)[:, col], np.array(tb)[:, col]
    if kind == "ratio":
        values = tc_a / tb_a
    elif kind == "diff_us":
        values = (tc_a - tb_a) / reps / per * 1e6
    else:
        raise ValueError(kind)
    median, lo, hi = bootstrap_median(values)
    return {
        "kind": kind,
        "clock": clock,
        "median": median,
        "lo": lo,
        "hi": hi,
        "rounds": len(values),
        "reps": reps,
        "per": per,
        "candidate_us_per_call": float(np.median(tc_a)) / reps * 1e6,
        "baseline_us_per_call": float(np.median(tb_a)) / reps * 1e6,
        "candidate_s": [list(t) for t in tc],
        "baseline_s": [list(t) for t in tb],
    }


def verdict(lo: float, hi: float, target: Optional[float]) -> str:
    """Against a target ``<= target``: whether the whole interval is under it."""
    if target is None:
        return "-"
    if hi <= target:
        return "holds"
    if lo > target:
        return "misses"
    return "unresolved"
