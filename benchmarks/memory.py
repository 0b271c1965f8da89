"""Peak and retained resident memory, from /proc (Linux).

TensorFlow allocates outside Python's allocator, so tracemalloc cannot see it;
the process's resident set can. Writing 5 to /proc/self/clear_refs resets the
peak (VmHWM), so each measurement's peak is its own.
"""

from __future__ import annotations

import gc
from typing import Callable, Dict

from benchmarks import workloads


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_mib(step: Callable[[], object]) -> float:
    for _ in range(3):
        step()
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    return (_status("VmHWM") - before) / 2**20


def measure() -> Dict[str, Dict[str, float]]:
    out: Dict[str, Dict[str, float]] = {}
    for name, steps in [
        ("2 meta-learning step, hidden 1024, batch 512", workloads.meta_step(False, hidden=1024, batch=512)),
        ("4a 100 writes to one 1e5-element variable", workloads.writes_per_tape(100, size=100_000)),
    ]:
        base, cand = _peak_mib(steps["baseline"]), _peak_mib(steps["assigntape"])
        out[name] = {"baseline peak MiB": base, "assigntape peak MiB": cand,
                     "ratio": cand / base if base > 0 else float("nan")}
    step = workloads.writes_per_tape(1)["assigntape"]
    for _ in range(1000):
        step()
    gc.collect()
    after_1k = _status("VmRSS")
    for _ in range(10_000):
        step()
    gc.collect()
    out["10,000 tape uses"] = {"retained growth MiB": (_status("VmRSS") - after_1k) / 2**20}
    return out
