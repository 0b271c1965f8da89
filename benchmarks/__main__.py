"""``python -m benchmarks``: time every workload against its baseline, measure
memory, print a table of ratios and save the raw results as JSON.

Ratios are candidate / baseline from the same run (the machines are shared and
noisy, so absolute times alone mean little), taken on the *minimum* of each
case's rounds: the work is deterministic, so the fastest round is the one least
disturbed by other load, and on a shared 2-core machine medians swing by tens
of percent between runs. Medians are saved too.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _time_workloads(extra_args):
    with tempfile.TemporaryDirectory() as tmp:
        raw = pathlib.Path(tmp) / "bench.json"
        cmd = [
            sys.executable, "-m", "pytest", str(HERE / "bench_tape.py"), "-q",
            "-o", "python_files=bench_*.py", "-p", "no:cacheprovider",
            f"--benchmark-json={raw}", "--benchmark-disable-gc", "--benchmark-quiet",
            "--benchmark-columns=min,median", *extra_args,
        ]
        subprocess.run(cmd, check=True, cwd=HERE.parent)
        return json.loads(raw.read_text())


def _ratios(raw):
    groups = {}
    for bench in raw["benchmarks"]:
        groups.setdefault(bench["group"], {})[bench["extra_info"]["role"]] = bench["stats"]
    rows = []
    for group in sorted(groups):
        roles = groups[group]
        if {"baseline", "assigntape"} <= set(roles):
            base, cand = roles["baseline"]["min"], roles["assigntape"]["min"]
            rows.append({"workload": group, "baseline_ms": base * 1e3, "assigntape_ms": cand * 1e3,
                         "ratio": cand / base,
                         "median_ratio": roles["assigntape"]["median"] / roles["baseline"]["median"]})
    return rows


def _slope(points, idx):
    xs = [p[0] for p in points]
    ys = [p[idx] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _slopes(rows):
    """Per-item cost from 4a/4b: least squares of time on the count."""
    out = {}
    for key, what in [("4a", "writes to one variable"), ("4b", "variables written once")]:
        for mode in ("eager", "compiled"):
            points = [
                (int(r["workload"].split()[1]), r["assigntape_ms"], r["baseline_ms"])
                for r in rows
                if r["workload"].startswith(key + " ") and r["workload"].endswith(f"[{mode}]")
            ]
            if len(points) >= 2:
                out[f"{what} [{mode}]"] = {
                    "assigntape_us_per_item": _slope(points, 1) * 1e3,
                    "baseline_us_per_item": _slope(points, 2) * 1e3,
                }
    return out


def main() -> None:
    extra = sys.argv[1:]
    raw = _time_workloads(extra)
    rows = _ratios(raw)
    from benchmarks import memory  # after timing: its allocations would add noise

    mem = memory.measure()
    slopes = _slopes(rows)
    print()
    print(f"{'workload (min of rounds)':<52} {'baseline ms':>12} {'assigntape ms':>14} {'ratio':>7} {'(median)':>9}")
    print("-" * 98)
    for row in rows:
        print(f"{row['workload']:<52} {row['baseline_ms']:>12.3f} {row['assigntape_ms']:>14.3f} "
              f"{row['ratio']:>7.3f} {row['median_ratio']:>9.3f}")
    print()
    for label, s in slopes.items():
        print(f"slope, {label}: {s['assigntape_us_per_item']:.1f} us per item "
              f"(baseline {s['baseline_us_per_item']:.1f} us)")
    print()
    for name, m in mem.items():
        print(f"memory, {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "processor": platform.processor()},
        "rows": rows, "slopes": slopes, "memory": mem, "raw": raw["benchmarks"],
    }
    RESULTS.mkdir(exist_ok=True)
    stamp = result["date"][:19].replace(":", "")
    for path in (RESULTS / f"{stamp}.json", RESULTS / "latest.json"):
        path.write_text(json.dumps(result, indent=1))
    print(f"\nsaved {RESULTS / 'latest.json'}")


if __name__ == "__main__":
    main()
