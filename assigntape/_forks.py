"""Tapes closed by another thread when the process forks.

A forked child has only the thread that forked. The tapes another thread had
closed are no longer followed there (``_versions``' at-fork hook lets their
records go, so that they keep no patch active and ``uninstall`` works in the
child): the writes the child makes while they are closed are not noted on
them. Entered again in the child, such a tape would go on from versions the
child's writes have made stale, a silently wrong gradient: it is refused
instead, by name (``refuse_forgotten``).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, List, Set

from assigntape import _leases
from assigntape._errors import ForkedTapeError

__all__ = ["forgotten_refs", "refuse_forgotten"]

# The records of the tapes closed by other threads, while this one forks.
_closed_elsewhere: List[Any] = []
# In a forked child: those records (weakly, as ``_leases.closed``), and the
# weak set's own set of references, whose truth is C code, for the hot path
# of a plain tape's entry (``_plain_tapes``: it looks for one while any is).
_forgotten: "weakref.WeakSet[Any]" = weakref.WeakSet()
forgotten_refs: Set[Any] = _forgotten.data  # type: ignore[attr-defined]


def _before_fork() -> None:
    me = threading.get_ident()
    # (The weak set's own references: its iterator runs Python code, and
    # another thread may add to it meanwhile.)
    for ref in list(_leases.closed_refs):
        record = ref()
        if record is not None and getattr(record, "closed_in", None) not in (None, me):
            _closed_elsewhere.append(ref)


def _after_fork_in_parent() -> None:
    _closed_elsewhere.clear()


def _after_fork_in_child() -> None:
    try:
        for ref in _closed_elsewhere:
            record = ref()
            if record is not None:
                _forgotten.add(record)
    finally:
        _closed_elsewhere.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def refuse_forgotten(record: Any, recorder: Any) -> None:
    """Before ``recorder`` (a tape of ours, a plain tape or a forward
    accumulator, whose record of the writes made while it is closed is
    ``record``) is entered again: refused if it was closed by another thread
    of the process this one was forked from."""
    if not _forgotten or record not in _forgotten:
        return
    kind = getattr(recorder, "_assigntape_kind", type(recorder).__name__)
    raise ForkedTapeError(
        f"This {kind} (at {id(recorder):#x}) was closed by another thread before os.fork(), and is "
        "entered again in the forked child: the writes the child made while it was closed were "
        "not followed for it, so it would go on from stale versions, a silently wrong gradient. "
        f"Open a new {kind} in the child (or enter this one again only in the parent)."
    )
