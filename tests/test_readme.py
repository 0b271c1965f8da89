"""The README's and the documentation's Python snippets run and assert what they
claim; the README's demo table is what the demo prints.

Every ```python block in README.md and docs/**/*.md runs, each in a fresh
namespace, except a block right after a line ``<!-- not run: REASON -->``
(which must say why; there are few).
"""

from __future__ import annotations

import pathlib
import re

import pytest

from assigntape.examples import seed_cases

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOT_RUN = re.compile(r"<!-- not run: (\S[^>]*?) -->\n```python\n")
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def _blocks(text: str):
    """(the block's code, whether it is marked not to run), in page order."""
    skipped = {m.end() for m in NOT_RUN.finditer(text)}
    return [(m.group(1), m.start(1) in skipped) for m in BLOCK.finditer(text)]


def _snippets():
    found = []
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        for index, (code, skip) in enumerate(_blocks(page.read_text())):
            if not skip:
                found.append(pytest.param(code, id=f"{name}#{index}"))
    return found


SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
RUN = _snippets()


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 4


@pytest.mark.parametrize("code", RUN)
def test_snippet_runs(code, request):
    exec(compile(code, request.node.callspec.id, "exec"), {})


def test_every_python_block_is_seen():
    """A ```python fence anywhere but at the start of a line (indented in a list
    or an admonition) would not be run: pages keep them at the margin. Blocks
    not run are marked, say why, and are few."""
    marked = 0
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"^[ \t]+```python", text, flags=re.M), f"{page}: indented python block"
        marks = re.findall(r"^<!-- not run", text, flags=re.M)
        assert len(marks) == len(NOT_RUN.findall(text)), f"{page}: a not-run mark with no reason or block"
        marked += len(NOT_RUN.findall(text))
    assert marked <= 5
    assert len(RUN) >= 30


def test_readme_is_short():
    assert len(README.splitlines()) <= 300


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
        [
            sys.executable,
            "-m",
            "assigntape",
            "--iterations",
            "5",
            "--baseline-iterations",
            "5",
            "--meta-batch",
            "2",
            "--eval-tasks",
            "8",
            "--quiet",
            "--plot",
            str(tmp_path / "m.png"),
        ],
        cwd=root,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "AssignAwareTape" in out and "6.0000000" in out  # the reference cases
    assert "Mean squared error on 8 held-out tasks" in out and "MAML after 1 step" in out
    assert "python -m assigntape.examples.hypergradient_lr" in out
    # It speaks to users: no internal goals, no bare NaN, and it ends by saying
    # what was shown and where to read next.
    assert "target" not in out.lower() and " nan" not in out.lower()
    last = out.strip().splitlines()[-1]
    assert last.startswith("Shown: ") and "Read next: docs/getting-started.md" in last
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_version_is_set_in_one_place():
    """``assigntape.__version__`` is the version; setup.cfg reads it, and no page
    or changelog repeats it (the changelog's "Unreleased" is renamed at release)."""
    import assigntape

    assert "version = attr: assigntape.__version__" in (ROOT / "setup.cfg").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and "Keep a Changelog" in changelog
    for page in [*PAGES, ROOT / "CHANGELOG.md"]:
        assert assigntape.__version__ not in page.read_text(), f"{page} repeats the version"


def test_api_reference_lists_every_public_name():
    """The API reference is generated from the docstrings of every public name:
    each name in ``assigntape.__all__`` and ``assigntape.testing.__all__`` has
    its mkdocstrings entry, so a new public name cannot be left out."""
    import assigntape
    import assigntape.testing

    api = (ROOT / "docs" / "api.md").read_text()
    for module in (assigntape, assigntape.testing):
        for name in module.__all__:
            assert f"::: {module.__name__}.{name}\n" in api, f"docs/api.md lacks {module.__name__}.{name}"
