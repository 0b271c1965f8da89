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
from typing import Any, Set

__all__ = ["lock", "take", "give", "count", "closed", "closed_refs", "plain"]

# Reentrant: ``_patches`` installs and takes its lease under it in one step.
lock = threading.RLock()
_count = 0
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


def take() -> None:
    """One more holder."""
    global _count
    with lock:
        _count += 1


def give() -> None:
    """One holder fewer (a finalizer may call it at any time)."""
    global _count
    with lock:
        _count -= 1


def count() -> int:
    """Open tapes, closed tapes, and plain tapes that ran beside one."""
    return _count + len(closed) + len(plain)
