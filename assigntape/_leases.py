"""Who still needs the patches: open tapes, closed ones that may be entered
again or asked for gradients, and plain tapes that ran beside one.

``_patches.uninstall`` refuses while any does. The count lives here, below
every module that takes a lease, so that none of them imports ``_patches``.
Open tapes are counted; closed tapes (by their records) and plain tapes are
kept in weak sets instead: a tape joins at exit and leaves at its gradient, on
every step, where a counted lease with a finalizer cost about ten
microseconds a tape.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Set, Tuple

__all__ = ["lock", "take", "give", "count", "prune", "closed", "closed_refs", "plain", "take_plain", "forget_threads"]

# Reentrant: ``_patches`` installs and takes its lease under it in one step.
lock = threading.RLock()
# The open tapes (by their records), each with the thread that opened it:
# id(holder) -> (holder, thread). Taking and giving a lease is idempotent,
# so that a tape's enter or exit interrupted on either side of it can be
# undone without knowing which side (``AssignAwareTape.__enter__``); and a
# forked child forgets the leases of the threads that do not exist in it.
_open: Dict[int, Tuple[Any, int]] = {}
# The records of closed tapes that may be entered again or asked for
# gradients; a record lives as long as its tape. While any is here the
# patches stay active, to note the writes made meanwhile (``_versions``).
closed: "weakref.WeakSet[Any]" = weakref.WeakSet()
# The WeakSet's own set of references, for the hot paths: its truth is C code,
# the WeakSet's len() is Python. A dead reference not yet removed only sends a
# call down the general path. (``data`` is WeakSet's attribute, not typed.)
closed_refs: Set[Any] = closed.data  # type: ignore[attr-defined]
# Plain tapes (and forward accumulators) that ran beside a tape of ours and
# keep versions, until they are garbage (``_plain_tapes.lease``).
plain: "weakref.WeakSet[Any]" = weakref.WeakSet()
# The thread each of ``plain`` ran in beside a tape of ours, which a forked
# child that does not have it forgets.
_plain_threads: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def take_plain(recorder: Any) -> None:
    """``recorder`` (a plain tape or accumulator that ran beside a tape of
    ours, in this thread) needs the patches until it is garbage."""
    plain.add(recorder)
    _plain_threads[recorder] = threading.get_ident()


def take(holder: Any) -> None:
    """``holder`` (an open tape's record) needs the patches; again: no change."""
    _open[id(holder)] = (holder, threading.get_ident())


def give(holder: Any) -> None:
    """``holder`` no longer does (a finalizer may call it at any time); again: no change."""
    _open.pop(id(holder), None)


def holds(holder: Any) -> bool:
    """Whether ``holder`` has a lease."""
    found = _open.get(id(holder))
    return found is not None and found[0] is holder


def count() -> int:
    """Open tapes, closed tapes, and plain tapes that ran beside one."""
    prune()
    return len(_open) + len(closed) + len(plain)


def prune() -> None:
    """Drops the references to records and tapes that are gone, which the
    weak sets' own callback left: an exception landing in it (a
    KeyboardInterrupt as a tape is freed) is swallowed by Python with the
    reference still there, and the patches would be needed for good."""
    for weak in (closed, plain):
        refs = weak.data  # type: ignore[attr-defined]
        for ref in [r for r in refs if r() is None]:
            refs.discard(ref)


def forget_threads(gone: Callable[[int], bool]) -> None:
    """The threads ``gone`` names (by ident) do not exist any more (a forked
    child has only the thread that forked; a thread ended with a tape open):
    the leases of the tapes they opened, which nothing will close, go; and
    those of the plain tapes that ran there, open or closed, which no code
    can let go either."""
    for key, (_, thread) in list(_open.items()):
        if gone(thread):
            del _open[key]
    for recorder, thread in list(_plain_threads.items()):
        if gone(thread):
            plain.discard(recorder)
            _plain_threads.pop(recorder, None)
