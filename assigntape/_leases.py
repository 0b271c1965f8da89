"""Who still needs the patches: open tapes, closed ones that may be entered
again or asked for gradients, and plain tapes that ran beside one.

``_patches.uninstall`` refuses while any does. The count lives here, below
every module that takes a lease, so that none of them imports ``_patches``.
"""

from __future__ import annotations

import threading

__all__ = ["lock", "take", "give", "count"]

# Reentrant: ``_patches`` installs and takes its lease under it in one step.
lock = threading.RLock()
_count = 0


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
    return _count
