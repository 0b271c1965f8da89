"""tf.distribute: cross-replica updates of variables a replica's tape tracks.

Under ``MirroredStrategy`` each replica runs in a thread of its own, with its own
versions. A write that becomes a cross-replica update (``merge_call``: a
``MirroredVariable`` with an aggregation other than NONE written in replica
context, or an optimizer step there) is applied in another thread, where the
replica's versions are not visible. It is refused rather than left to give a
wrong gradient.
"""

from __future__ import annotations

from typing import Any, Callable

from assigntape import _versions
from assigntape._errors import UntrackedWriteError

__all__ = ["distributed_update"]


def distributed_update(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``StrategyExtendedV2.update``: a cross-replica write of a distributed variable.

    It runs in cross-replica context (for MirroredStrategy, outside the replica
    threads), so a replica's tape cannot see it: reads after it would credit
    the version from before. Refuse it while a replica's tape is open.
    """
    var = args[0] if args else kwargs.get("var")
    # Refused whenever a tape is open in a replica, whether it has read the
    # variable yet or not: one that reads it later would read the updated value
    # and credit the version from before the update.
    if _versions.differentiable(var) and _versions.open_elsewhere():
        aggregation = getattr(var, "aggregation", None)
        raise UntrackedWriteError(
            f"A cross-replica update of variable {var.name!r} (aggregation "
            f"{getattr(aggregation, 'name', aggregation)}), while an AssignAwareTape is open "
            "in a replica: it is applied outside the replica's sight (merge_call), "
            "so reads after it would credit the version from before, a silently wrong "
            "gradient. Such updates come from writes in replica context to a "
            "MirroredVariable whose aggregation is not NONE, and from optimizer steps "
            "(apply_gradients) in replica context. Inside the tape, write per replica "
            "instead: aggregation=NONE (each replica writes its own component) or "
            "synchronization=ON_READ, with assign / assign_sub; aggregate the "
            "meta-gradients after the tape."
        )
    return wrapped(*args, **kwargs)
