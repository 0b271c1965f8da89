"""Take write rules away for a test: the op is then refused, as a write op a
future TensorFlow adds without a rule would be."""

from __future__ import annotations

import contextlib
from typing import Iterator

from assigntape import _patches, _rules, uninstall


def _rebuild_patches() -> None:
    """Has the next tape build its op wrappers from the rules as they are now."""
    uninstall()  # raises if a tape of an earlier test is still alive
    _patches._groups.clear()


@contextlib.contextmanager
def rules_removed(*names: str) -> Iterator[None]:
    taken = {name: _rules.RULES.pop(name) for name in names}
    try:
        _rebuild_patches()
        assert all(_rules.refused(name) for name in names)
        yield
    finally:
        _rules.RULES.update(taken)
        _rebuild_patches()
