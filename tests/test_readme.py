"""The README's Python snippets run and assert what they claim; its demo table is
what the demo prints."""

from __future__ import annotations

import pathlib
import re

import pytest

from assigntape.examples import seed_cases

README = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 4


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index):
    exec(compile(SNIPPETS[index], f"README snippet {index}", "exec"), {})


def test_demo_table_in_readme_is_current(capsys):
    seed_cases.main()
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    for line in printed:
        assert line in README, f"README's demo table is stale: {line!r}"


def _setup_commands():
    block = re.search(r"## Set-up\n.*?```sh\n(.*?)```", README, flags=re.S)
    assert block, "README has no Set-up block"
    return [line.split("#")[0].strip() for line in block.group(1).strip().splitlines()]


def test_setup_is_two_commands_and_ci_runs_the_test_one():
    demo, tests = _setup_commands()
    assert demo == 'pip install ".[examples]" && python -m assigntape'
    ci = (pathlib.Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert tests in ci.splitlines()


def test_main_command_runs_the_headline_example(tmp_path):
    """``python -m assigntape``, with the headline example shrunk by its own flags
    (the later flags override the quick defaults)."""
    import os
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "assigntape", "--iterations", "5", "--baseline-iterations", "5",
         "--meta-batch", "2", "--eval-tasks", "8", "--quiet", "--plot", str(tmp_path / "m.png")],
        cwd=root, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "AssignAwareTape" in out and "6.0000000" in out  # the reference cases
    assert "Mean squared error on 8 held-out tasks" in out and "MAML after 1 step" in out
    assert "python -m assigntape.examples.hypergradient_lr" in out
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
