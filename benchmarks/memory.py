"""Peak and retained resident memory, from /proc (Linux).

TensorFlow allocates outside Python's allocator, so tracemalloc cannot see it,
and it keeps no allocator statistics for the CPU; the process's resident set
shows it. Each peak is taken in a fresh process (``python -m benchmarks.memory
WORKLOAD ROLE``) on the first step after the workload is built, so that memory
reused from an earlier step cannot hide it: the resident set before the step is
subtracted from the peak (VmHWM, reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from typing import Callable, Dict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WORKLOADS = {
    "2 meta-learning step, hidden 1024, batch 512": ("meta_step", dict(compiled=False, hidden=1024, batch=512)),
    "4a 100 writes to one 1e5-element variable": ("writes_per_tape", dict(n=100, size=100_000)),
}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_bytes(step: Callable[[], object]) -> int:
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    return _status("VmHWM") - before


def _in_subprocess(name: str, role: str) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", name, role],
        check=True, capture_output=True, text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def measure() -> Dict[str, Dict[str, float]]:
    out: Dict[str, Dict[str, float]] = {}
    for name in WORKLOADS:
        base, cand = _in_subprocess(name, "baseline"), _in_subprocess(name, "assigntape")
        out[name] = {"baseline peak MiB": base, "assigntape peak MiB": cand, "ratio": cand / base}
    from benchmarks import workloads

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


if __name__ == "__main__":
    from benchmarks import workloads

    factory, kwargs = WORKLOADS[sys.argv[1]]
    steps = getattr(workloads, factory)(**kwargs)
    print(json.dumps({"peak_mib": _peak_bytes(steps[sys.argv[2]]) / 2**20}))
