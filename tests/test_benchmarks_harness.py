"""The benchmark harness runs against the library as it is now: each figure's
two sides run once, and the switch between the patches installed (dormant)
and removed works. (The figures themselves are measured by ``python -m
benchmarks``, not asserted here; this only keeps the harness from drifting
from the library's internals, as it once did: ``_patches.release``'s
signature changed and ``--quick`` failed.)"""

from __future__ import annotations

import pytest

from assigntape import _patches


@pytest.mark.parametrize("name", ["enter_exit", "no_write_eager", "meta_eager", "per_write_eager", "meta_compiled"])
def test_each_figures_two_sides_run(name: str) -> None:
    from benchmarks.__main__ import IN_PROCESS, _steps

    assert name in [entry[0] for entry in IN_PROCESS]
    steps = _steps(name)
    steps["assigntape"]()
    steps["baseline"]()


def test_the_outside_figures_switch_the_patches_both_ways() -> None:
    from benchmarks import worker
    from benchmarks.__main__ import _patches_side

    step = worker.build(sorted(worker.CASES)[0])
    calls = []

    def counted() -> None:
        calls.append(1)
        step()

    _patches_side(counted, installed=False)(1)
    assert not _patches.installed()
    _patches_side(counted, installed=True)(1)
    assert _patches.installed()
    assert calls
