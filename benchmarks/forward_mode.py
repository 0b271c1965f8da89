"""``python -m benchmarks.forward_mode``: issue #19's figures.

* Peak memory of a forward-mode hypergradient (``assigntape.ForwardAccumulator``)
  against reverse mode (``AssignAwareTape``) through K = 10, 100 and 1,000 Keras
  ``SGD`` steps on a 100,000-element weight, each in a fresh process
  (``benchmarks.memory``'s measurement). Forward mode's peak must stay flat.
* The first call (trace plus run) of a ``tf.function`` with N = 100, 300 and
  1,000 Python-unrolled writes under the tape, against the rewrite, each in a
  fresh process, rounds alternating which goes first: the tape's cost must
  grow like the rewrite's.

Saves ``benchmarks/results/<date>-forward-mode.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

KS = (10, 100, 1000)
NS = (100, 300, 1000)


def _child(*args: str) -> Dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.forward_mode", *args], check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory() -> Dict[str, Dict[str, float]]:
    out = {}
    for k in KS:
        out[f"K={k}"] = {
            f"{mode} peak MiB": _child("memory", str(k), mode)["peak_mib"] for mode in ("forward", "reverse")
        }
    return out


def trace_time(rounds: int = 3) -> Dict[str, Dict[str, Any]]:
    out = {}
    for n in NS:
        ratios: List[float] = []
        times: Dict[str, List[float]] = {"assigntape": [], "baseline": []}
        for r in range(rounds if n < 1000 else 1):
            order = ("assigntape", "baseline") if r % 2 == 0 else ("baseline", "assigntape")
            got = {role: _child("trace", str(n), role)["seconds"] for role in order}
            for role in got:
                times[role].append(got[role])
            ratios.append(got["assigntape"] / got["baseline"])
        out[f"N={n}"] = {
            "assigntape s": statistics.median(times["assigntape"]),
            "rewrite s": statistics.median(times["baseline"]),
            "ratio": statistics.median(ratios),
            "rounds": len(ratios),
        }
    return out


def main() -> None:
    result = {"memory": memory(), "trace": trace_time()}
    for section, rows in result.items():
        for name, row in rows.items():
            print(f"{section}, {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()))
    from benchmarks.__main__ import RESULTS

    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    (RESULTS / f"{stamp}-forward-mode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__" and len(sys.argv) == 1:
    main()
elif __name__ == "__main__" and sys.argv[1] == "memory":
    from benchmarks import workloads
    from benchmarks.memory import _peak_and_retained

    step = workloads.hypergradient(int(sys.argv[2]))[sys.argv[3]]
    print(json.dumps(_peak_and_retained(step)))
elif __name__ == "__main__" and sys.argv[1] == "trace":
    from assigntape import AssignAwareTape
    from benchmarks import workloads

    with AssignAwareTape():
        pass  # one-time costs (building the patches) are not the trace's
    function = workloads.unrolled_writes(int(sys.argv[2]))[sys.argv[3]]()
    began = time.perf_counter()
    function()
    print(json.dumps({"seconds": time.perf_counter() - began}))
