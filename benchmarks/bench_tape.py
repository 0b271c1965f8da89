"""Timed with pytest-benchmark. Each case times a candidate and its baseline;
``python -m benchmarks`` pairs them by group into ratios."""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from benchmarks import workloads  # noqa: E402

ROLES = ["baseline", "assigntape"]
MODES = {"eager": False, "compiled": True}

CASES = []
for mode, compiled in MODES.items():
    CASES.append((f"1 no writes, MLP [{mode}]", lambda c=compiled: workloads.no_writes(c)))
    CASES.append((f"2 meta-learning step vs functional [{mode}]", lambda c=compiled: workloads.meta_step(c)))
    for k in (1, 4, 16, 64):
        CASES.append((f"3 vs chain-rule workaround, K={k} [{mode}]", lambda k=k, c=compiled: workloads.workaround(k, c)))
    CASES.append((f"5 Keras Adam step, 1M params [{mode}]", lambda c=compiled: workloads.adam_step(c)))
    for n in (1, 10, 100, 1000):
        CASES.append((f"4a {n} writes to one variable [{mode}]",
                      lambda n=n, c=compiled: workloads.writes_per_tape(n, compiled=c)))
        CASES.append((f"4b {n} variables written once [{mode}]",
                      lambda n=n, c=compiled: workloads.variables_per_tape(n, compiled=c)))
    for n in (100, 10_000, 1_000_000):
        CASES.append((f"4c assign_add of {n} elements [{mode}]",
                      lambda n=n, c=compiled: workloads.tensor_size(n, compiled=c)))

_built = {}


def _steps(group, factory):
    if group not in _built:
        _built.clear()  # keep one workload's variables alive at a time
        _built[group] = factory()
    return _built[group]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("group,factory", CASES, ids=[c[0] for c in CASES])
def test_step(benchmark, group, factory, role):
    step = _steps(group, factory)[role]
    start = time.perf_counter()
    for _ in range(3):  # warm caches, allocator pools and the patches' wrappers
        step()
    per_call = (time.perf_counter() - start) / 3
    benchmark.group = group
    benchmark.extra_info["role"] = role
    # About two seconds a case, and at least 7 rounds for a stable median.
    rounds = max(7, min(200, int(2.0 / max(per_call, 1e-6))))
    benchmark.pedantic(step, rounds=rounds, iterations=1, warmup_rounds=1)
