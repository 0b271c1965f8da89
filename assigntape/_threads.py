"""Other threads: their tapes' variables refused here, replicas acting in
``merge_call``, and forks.

A write from one thread to a variable a tape of another thread tracks is
refused (``refuse_other_thread``); a cross-replica update in ``merge_call``
runs in one thread on behalf of each replica (``acting_for``). A forked
child forgets the scopes of the threads that do not exist there.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from assigntape import _compiled_tapes, _leases, _nesting, _registry
from assigntape._compiled_tapes import CallScope
from assigntape._errors import UntrackedWriteError
from assigntape._registry import (
    _all_lock,
    _all_scopes,
    _check_reads,
    _count_acting,
    _plain_by_thread,
    _serve_versions,
    _tls,
    _with_unnamed,
    current_key,
)
from assigntape._resuming import _closed_records, closed_tapes
from assigntape._tf import (
    eager_tape,
    executing_eagerly,
    pywrap_tfe,
    tensor_lib,
)
from assigntape._versions import Scope, differentiable, variable_of_handle


def _other_threads() -> List[Scope]:
    me = threading.get_ident()
    # Acting for a replica in merge_call: the replicas are all paused there,
    # and each touches its own components (though it may have looked at
    # another's, for its device).
    merging = getattr(_tls, "merging", ())
    with _all_lock: scopes = list(_all_scopes)  # noqa: E701 - see _registry._list  # fmt: skip
    return [scope for scope in scopes if scope.thread != me and scope not in merging]


def replica_scopes(strategy: Any, any_graph: bool = False) -> Dict[int, Scope]:
    """The scopes open in ``strategy``'s replica threads (``MirroredStrategy``'s,
    and its subclasses'), paused in ``merge_call``, by the replica's local id:
    the replicas whose ``merge_call`` is running here, in the main thread.
    Only those in the graph being built here (or eagerly), unless
    ``any_graph``. A thread of another strategy, or of none, is no replica of
    this one: its tapes are its own (a plain thread's update is a plain write)."""
    key = current_key()
    threads = {t.ident: t for t in threading.enumerate()}
    found: Dict[int, Scope] = {}
    with _all_lock: scopes = list(_all_scopes)  # noqa: E701 - see _registry._list  # fmt: skip
    for scope in scopes:
        thread = threads.get(scope.thread)
        replica = getattr(thread, "replica_id", None)
        # A replica thread (mirrored_run._MirroredReplicaThread) paused in
        # merge_call: not done, and waiting for its should_run event.
        paused = not getattr(thread, "done", True) and not getattr(thread, "should_run", _SET).is_set()
        if (
            (any_graph or scope.key is key)
            and isinstance(replica, int)
            and getattr(thread, "distribution", None) is strategy
            and paused
            and scope.records
        ):
            found[replica] = scope
    return found


class _Set:
    @staticmethod
    def is_set() -> bool:
        return True


_SET = _Set()


def _recording_tapes(scope: Scope) -> List[Any]:
    """TensorFlow's tape objects recording in ``scope``: its AssignAwareTapes'
    and the plain tapes open in its thread and graph (a replica's, whose
    cross-replica update runs as it: ``acting_for``)."""
    tapes = [t for t in (r.recording_tape() for r in scope.records) if t is not None]
    for ref, key in _plain_by_thread.get(scope.thread, ()):
        tape = ref()
        # The thread's ForwardAccumulators are noted there too: they have no
        # tape (TensorFlow's accumulators are not on the tape stack).
        inner = getattr(tape, "_tape", None)
        if inner is not None and key is scope.key and tape._recording and inner not in tapes:
            tapes.append(inner)
    return tapes


def recorded_by(scope: Scope, tensors: Sequence[Any]) -> bool:
    """Whether ``scope``'s recording tapes (a replica's, from its ``merge_call``)
    would follow a gradient into any of ``tensors``."""
    with _tapes_moved(_recording_tapes(scope), push=True):
        return bool(pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop(tensors))


@contextlib.contextmanager
def _tapes_moved(
    tapes: Sequence[Any],
    push: bool,
    accumulators: Sequence[Any] = (),
    then: Tuple[Callable[[], None], Callable[[], None]] = (lambda: None, lambda: None),
) -> Iterator[None]:
    """Runs the block with ``tapes`` pushed onto this thread's set (``push``)
    or popped from it, and ``accumulators`` added to its set of forward
    accumulators, then as they were, the nesting numbers of all kept
    (``_nesting``: pushed, each would be numbered again, in this order,
    whatever their order where they were entered). ``then``: what else to do
    once they are moved, and how to undo it (first), on the same terms.

    All or nothing, an interrupt landing between a move and its note
    included: TensorFlow's push of a tape already in the set does nothing,
    but its pop of one not in it drops a reference it does not hold. So the
    notes err on the side of a push: a push is noted after it, a pop before
    it; undoing a push drops its note first, undoing a pop pushes before it
    drops the note; the undoing runs once more if interrupted."""
    numbers = _nesting.saved([tape._tape for tape in tapes] + list(accumulators))
    moved: List[Any] = []
    added: List[Any] = []

    def undo() -> None:
        then[1]()
        while added: pywrap_tfe.TFE_Py_ForwardAccumulatorSetRemove(added.pop())  # noqa: E701  # fmt: skip
        if push:
            while moved: eager_tape.pop_tape(moved.pop())  # noqa: E701  # fmt: skip
        else:
            while moved: eager_tape.push_tape(moved[-1]); moved.pop()  # noqa: E701, E702  # fmt: skip
        _nesting.restore(numbers)

    try:
        if push:
            for tape in tapes: eager_tape.push_tape(tape); moved.append(tape)  # noqa: E701, E702  # fmt: skip
        else:
            for tape in reversed(tapes): moved.append(tape); eager_tape.pop_tape(tape)  # noqa: E701, E702  # fmt: skip
        for accumulator in accumulators: pywrap_tfe.TFE_Py_ForwardAccumulatorSetAdd(accumulator); added.append(accumulator)  # noqa: E701, E702, E501  # fmt: skip
        _nesting.restore(numbers)
        then[0]()
        yield
    finally:
        try: undo()  # noqa: E701  # fmt: skip
        except BaseException:
            undo()
            raise


def refuse_foreign_inputs(var: Any, op_name: str, tensors: Sequence[Any]) -> None:
    """Acting for a replica in ``merge_call`` (``acting_for``): refuses a
    write whose value comes from another replica's tape and not this one's
    (an update function holding values the first replica computed, as
    tf_keras legacy optimizers do before ``_coefficients_per_replica``),
    whose gradient this replica's tape could not follow."""
    merging = getattr(_tls, "merging", ())
    if not merging:
        return
    acting = _tls.scopes[next(iter(_tls.scopes))]
    tensors = [t for t in tensors if isinstance(t, tensor_lib.Tensor)]
    mine = _recording_tapes(acting)
    unseen = [t for t in tensors if not pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop([t])]
    if not unseen:
        return
    with _tapes_moved(mine, push=False):
        for other in merging:
            if other is not acting and recorded_by(other, unseen):
                raise UntrackedWriteError(
                    f"A cross-replica update of variable {var.name!r} by {op_name} uses a value "
                    "computed by another replica (not this one), while AssignAwareTapes are open "
                    "in the replicas: this replica's tape cannot follow its gradient, a silently "
                    "wrong gradient (merge_call hands the update function the values one replica "
                    "passed it, for every replica's component). Compute such values inside the "
                    "update function, or step each replica's own components (aggregation=NONE "
                    "variables, assign_sub) in replica context inside the tape."
                )


@contextlib.contextmanager
def acting_for(scope: Scope, merging: Sequence[Scope]) -> Iterator[None]:
    """Runs the block in this thread as if in ``scope``'s (a replica thread
    paused in ``merge_call``, with the others of ``merging``): its versions
    are served and advanced, and its recording tapes and forward accumulators
    record the block's ops (TensorFlow keeps both sets per thread), and the
    variables they read are watched as the replica's reads are
    (``_distribute.watched_as_replica``, an ``acting_checks`` patch)."""
    saved = getattr(_tls, "scopes", None), getattr(_tls, "merging", ())
    # Pushed here, each is numbered again, whatever its order in the replica
    # (a tape entered inside an accumulator would count as outside it): their
    # own numbers, while acting and after (``_tapes_moved``). All or nothing,
    # as there: the count is noted on the line that makes it.
    counted: List[bool] = []

    def act() -> None:
        _tls.scopes, _tls.merging = {scope.key: scope}, tuple(merging)
        _count_acting(1); counted.append(True)  # noqa: E702  # fmt: skip

    def undo() -> None:
        _tls.scopes, _tls.merging = saved
        if counted: _count_acting(-1); counted.clear()  # noqa: E701, E702  # fmt: skip

    with _tapes_moved(_recording_tapes(scope), True, _recording_accumulators(scope), (act, undo)):
        yield


def acting() -> bool:
    """Whether this thread is acting for a replica (``acting_for``)."""
    return bool(getattr(_tls, "merging", ()))


def _recording_accumulators(scope: Scope) -> List[Any]:
    """TensorFlow's accumulator objects recording in ``scope``'s thread and
    graph (its ``ForwardAccumulator``s, entered first first), for ``acting_for``."""
    found = []
    for ref, key in _plain_by_thread.get(scope.thread, ()):
        accumulator = ref()
        inner = getattr(accumulator, "_accumulator", None)
        if inner is not None and key is scope.key and accumulator._recording:
            found.append(inner)
    return found


# The plain tapes and accumulators open in other threads when this one
# forks (in the child, their threads' lists may be gone before the hook runs).
_open_elsewhere_at_fork: List[Any] = []


# The thread forking, between the fork's hooks (``_thread_ended``).
_forking: List[int] = []


def _before_fork() -> None:
    # Held across the fork, so that the child's copy is not held by a thread
    # that does not exist there (it would wait on it for ever).
    _leases.lock.acquire()
    _all_lock.acquire()
    _forking.append(threading.get_ident())
    me = threading.get_ident()
    for thread, opened in list(_plain_by_thread.items()):
        if thread != me:
            _open_elsewhere_at_fork.extend(ref() for ref, _ in list(opened))


def _after_fork_in_parent() -> None:
    _forking.clear()
    _open_elsewhere_at_fork.clear()
    _all_lock.release()
    _leases.lock.release()


def _after_fork_in_child() -> None:
    """In a forked child only the thread that forked exists: the tapes the
    other threads had open will never close, and must not bind it (refuse
    its writes to variables they read, keep the patches from ``uninstall``,
    keep the descriptor served). Their scopes and leases go."""
    try:
        me = threading.get_ident()
        _forget_threads(lambda thread: thread != me)
        # Plain tapes open there (beside a tape of ours), never closed here.
        for tape in _open_elsewhere_at_fork:
            if tape is not None:
                _leases.plain.discard(tape)
        for thread in list(_plain_by_thread.keys()):
            if thread != me:
                _plain_by_thread.pop(thread, None)
        # Tapes closed there: none can be entered again in that thread. (One
        # entered again here does not see the writes made here while it was
        # closed as such: see the README's known limits.)
        for r in list(_closed_records()):
            if r.closed_in not in (None, me):
                closed_tapes.discard(r)
    finally:
        _after_fork_in_parent()


def _forget_threads(gone: Callable[[int], bool]) -> None:
    """The tapes open in the threads ``gone`` names, which do not exist any
    more, will never close: their scopes and leases go (``_leases.lock`` and
    ``_all_lock`` held)."""
    _leases.forget_threads(gone)
    _compiled_tapes.forget_threads(gone)
    left = [scope for scope in _all_scopes if gone(scope.thread)]
    for scope in left:
        _all_scopes.remove(scope)
        _with_unnamed.discard(id(scope))
    if left and not _with_unnamed:
        _check_reads(False)
    if left and not _all_scopes:
        _serve_versions(False)
        _registry._active_at = time.monotonic()


def _thread_ended(ident: int) -> None:
    """A thread ended with a tape of ours open (entered and never exited: kept
    by an object that outlives the thread, an ExitStack, a suspended
    generator). Plain TensorFlow forgets a tape left so; here its scopes
    would refuse every other thread's writes to the variables it touched, and
    keep the patches from ``uninstall``, for the rest of the process. They go,
    as a forked child forgets the threads it does not have. (Called as the
    thread's locals go, in that thread: its ident is not reused yet.)"""
    if threading.get_ident() in _forking:
        # A forked child, where Python drops the other threads' locals while
        # this thread holds the locks: ``_after_fork_in_child`` forgets them.
        return
    with _leases.lock:
        with _all_lock: _forget_threads(lambda thread: thread == ident)  # noqa: E701 - see _registry._list  # fmt: skip


_registry.thread_end_hooks.append(_thread_ended)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def open_elsewhere() -> bool:
    """Whether a tape is open in another thread.

    MirroredStrategy runs each replica in a thread of its own, and a
    cross-replica update (inside ``merge_call``) in yet another, where the
    replicas' versions are not visible.
    """
    return bool(_all_scopes) and bool(_other_threads())


def tracked_in_other_thread(handle: Any, var: Optional[Any]) -> Optional[Any]:
    """The variable behind ``handle`` (or ``var``) if a tape open in another
    thread has read or written it, else None.

    Its versions there are invisible here: a write from this thread would
    change what that tape reads while it credits its own version.
    """
    found = _tracking(handle, var)
    return None if found is None else found[0]


def _tracking(handle: Any, var: Optional[Any]) -> Optional[Tuple[Any, Scope]]:
    """``tracked_in_other_thread``'s variable, with the scope that tracks it."""
    if not _all_scopes or not executing_eagerly():
        return None
    mine = getattr(_tls, "scopes", None)
    if mine is not None and len(mine) >= len(_all_scopes):
        # Every open scope is this thread's (each is in both), the usual case,
        # checked on every write. (A scope another thread opens meanwhile has
        # seen nothing yet.)
        return None
    if var is None:
        # A variable's own handle names it even where no scope of this thread
        # does (a tape entered again tracks it by its versions only).
        var = variable_of_handle(handle)
    for scope in _other_threads():
        found = var if var is not None and var._unique_id in scope.seen else scope.owners.get(id(handle))
        if found is not None:
            return found, scope
    return None


def refuse_other_thread(handle: Any, var: Optional[Any], op_name: str) -> None:
    """Refuses a write to a variable that a tape open in another thread has
    read or written (or, in a function that thread is running, a tape open
    in its graph: ``_compiled_tapes``): that tape would read the value
    written here while it credits its own version."""
    tracking = _tracking(handle, var)
    if tracking is None or not differentiable(tracking[0]):
        return
    found, scope = tracking
    here = f"{op_name} to variable {found.name!r} from thread {threading.current_thread().name!r}"
    if isinstance(scope, CallScope):
        raise UntrackedWriteError(
            f"{here}, while {scope.function} runs in thread {scope.thread_name!r}, and an "
            "AssignAwareTape open in that function's graph reads or writes it: that tape would "
            "read the value written here and credit its own version, a silently wrong gradient. "
            "Write the variable before or after that call (synchronize the threads), or give "
            "each thread its own variables."
        )
    raise UntrackedWriteError(
        f"{here}, while an AssignAwareTape open in another thread has read or written it: that "
        "tape would read the value written here and credit its own version, a silently "
        "wrong gradient. Write the variable from the tape's thread, or after its tape closes."
    )
