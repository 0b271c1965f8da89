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
