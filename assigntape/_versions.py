"""The version store: which handle tensor is each variable's current version.

Every write made while an ``AssignAwareTape`` is open gives the variable a new
*version*: a new handle tensor for the same resource. The mapping from a variable
to its current version lives here, never on the variable object, so that:

* threads do not see each other's versions (``threading.local``);
* a ``tf.function`` being traced does not see the versions of the eager tape
  around it, and so captures the variable's own (canonical) handle. One scope is
  kept for eager execution and one per ``FuncGraph`` in which a tape is open.

``Scope`` is that mapping for one thread and graph, and ``new_version`` /
``Scope.advance`` / ``Scope.adopt`` are the only ways a version is made current.
Opening and closing a scope is here too; the handle descriptor that serves the
versions is in ``_serving``, the records of closed tapes in ``_resuming``.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from assigntape import _leases
from assigntape._branches import _seed_from_around
from assigntape._record import Record, WriteRecord
from assigntape._registry import (
    _all_lock,
    _all_scopes,
    _list,
    _scopes,
    _unlist_locked,
    _unlist_unnamed_locked,
    _with_unnamed,
    current_key,
)
from assigntape._tf import (
    array_ops,
    dtypes,
    executing_eagerly,
    ops,
    record,
)
from assigntape._tf import (
    context as _context,
)


class Scope:
    """The versions of one thread in one graph (``None`` for eager execution)."""

    __slots__ = (
        "key",
        "thread",
        "current",
        "owners",
        "records",
        "holders",
        "seen",
        "canonical",
        "pinned",
        "dirty",
        "resumed",
        "unnamed",
    )

    def __init__(self, key: Any) -> None:
        self.key = key
        self.thread = threading.get_ident()
        # The variable's ``_unique_id`` -> its current version's handle. Keying by
        # the unique id rather than the object makes the ``_UnreadVariable`` that
        # ``assign()`` returns (a separate object on the same resource) see the
        # same versions as the variable it came from.
        self.current: Dict[str, Any] = {}
        # id(handle tensor) -> the variable it was served for. Write ops receive
        # only a handle; this finds the variable. The variable keeps its own
        # handle alive and ``pinned`` every version made here, so no id in here
        # can be reused by another object while the scope lives (``reset()``
        # drops a tape's versions, not the scope's).
        self.owners: Dict[int, Any] = {}
        self.pinned: List[Any] = []
        # Unique ids of the variables read or written here: what another thread
        # must not write behind this scope's back.
        self.seen: Set[str] = set()
        # id(the variable's own handle) -> variable, for the variables written
        # here: a traced function captures that handle, and a call maps it to
        # the current version (``_functions``).
        self.canonical: Dict[int, Any] = {}
        # The records of the AssignAwareTapes open in this scope, outermost first.
        self.records: List[Record] = []
        # The records (``_recorders.holding``) of the plain tapes and forward
        # accumulators that were open around the last AssignAwareTape here when
        # it closed, and still are: they recorded its writes, so until they
        # close the scope stays, and every read and write goes on through
        # versions, for them (``close_scope``).
        self.holders: List[Record] = []
        # id(a variable's own handle) -> (that handle, the tapes that were closed
        # when it was written): writes no tape here saw, made while those tapes
        # were closed, resolved at the variable's first read (``cut_on_first_read``).
        self.dirty: Dict[int, Tuple[Any, List[Any]]] = {}
        # id(a variable's own handle) -> (a version, its variable, whether it
        # was made for a write no tape here saw (``_resuming.settle``), the
        # records of the tapes entered again that go on from it): each also in
        # ``dirty``, whose first read makes it current (``go_on_from``).
        self.resumed: Dict[int, Tuple[Any, Any, bool, List[Any]]] = {}
        # id(handle) -> (handle, op name, refusal or ""): variables written, since the tape
        # opened, through a handle no tape could name (``_refusals.unknown_variable_write``),
        # or that TensorFlow's runtime may write unseen (``_refusals.note_unseen_writer``).
        self.unnamed: Dict[int, Tuple[Any, str, str]] = {}

    def state(self, full: bool) -> Tuple[Any, ...]:
        """What a tape's entry may change here (``full``: a tape entered
        again; else only the records), for ``put_back``."""
        records = list(self.records)
        if not full:
            return (records,)
        return (
            records,
            dict(self.current),
            dict(self.owners),
            len(self.pinned),
            set(self.seen),
            dict(self.canonical),
            {k: (own, list(closed)) for k, (own, closed) in self.dirty.items()},
            {k: (h, var, made, list(knowing)) for k, (h, var, made, knowing) in self.resumed.items()},
        )

    def put_back(self, state: Tuple[Any, ...]) -> None:
        """The scope as ``state`` had it (an interrupted tape entry undone)."""
        self.records[:] = state[0]
        if len(state) == 1:
            return
        _, current, owners, pinned, seen, canonical, dirty, resumed = state
        self.current.clear()
        self.current.update(current)
        self.owners.clear()
        self.owners.update(owners)
        del self.pinned[pinned:]
        self.seen.clear()
        self.seen.update(seen)
        self.canonical.clear()
        self.canonical.update(canonical)
        self.dirty.clear()
        self.dirty.update(dirty)
        self.resumed.clear()
        self.resumed.update(resumed)

    def current_version(self, var: Any) -> Any:
        handle = self.current.get(var._unique_id)
        return canonical_handle(var) if handle is None else handle

    def advance(self, var: Any, old: Any, new: Any, write: "WriteRecord", closed: bool = False) -> None:
        """Makes ``new`` the variable's current version, for every open tape
        (each record notes the write) and every recorder that holds the
        scope's versions (they are kept); ``closed``: a write the op made
        here, noted on every closed recorder too (``note_write_while_closed``):
        the one store call of a write, whatever recorders it concerns."""
        if closed and _closed_refs:
            note_write_while_closed(None, var)
        uid = var._unique_id
        self.current[uid] = new
        self.owners[id(new)] = var
        if self.key is None:
            key = id(new)
            _eager_versions[key] = (weakref.ref(new, lambda ref: _forget_version(ref, key)), var)
        if self.key is not None or self.holders or any(r.keeps_history for r in self.records):
            self.pinned.append(new)
        else:
            # Only forward-only tapes (``_forward``): a version may go when the
            # next replaces it (and a forward accumulator's tangent with it);
            # its entry goes with it, before its id can be reused.
            weakref.finalize(new, self.owners.pop, id(new), None)
        self.seen.add(uid)
        self.canonical[id(var.__dict__["_handle"])] = var  # canonical_handle(var)
        for r in self.records:
            r.note_write(var, old, new, write)

    def keep(self, var: Any, handle: Any) -> None:
        """Keeps ``handle``, a version of ``var`` not current (yet), while the
        scope lives, and names its variable."""
        self.owners[id(handle)] = var
        self.pinned.append(handle)

    def adopt(self, var: Any, handle: Any) -> None:
        """Makes ``handle``, an existing version (not a write here), the
        variable's current one, kept while the scope lives."""
        uid = var._unique_id
        self.current[uid] = handle
        self.keep(var, handle)
        self.seen.add(uid)
        self.canonical[id(canonical_handle(var))] = var

    def tracks(self, var: Any) -> bool:
        """Whether the tape has seen this variable (read or written)."""
        return var._unique_id in self.seen

    def refuses_untracked(self) -> bool:
        # Held by plain recorders only: they have no option, refuse.
        return not self.records or any(r.untracked_writes == "raise" for r in self.records)

    def recording(self) -> bool:
        """Whether a tape here records: an AssignAwareTape, or a holder."""
        return any(r.recording() for r in self.records) or any(h.recording() for h in self.holders)


def open_scope(tape_record: Record) -> Scope:
    """Registers the tape of ``tape_record`` as open in the current thread and graph."""
    scopes = _scopes()
    key = current_key()
    scope = scopes.get(key)
    if scope is None:
        scope = scopes[key] = Scope(key)
        _seed_from_around(scope)
        _list(scope)
    scope.records.append(tape_record)
    return scope


def close_scope(scope: Scope, tape_record: Record, holders: Sequence[Record] = ()) -> None:
    """Unregisters ``tape``; the last tape out drops the scope's versions,
    unless ``holders`` (the records of the plain tapes and forward accumulators open around it)
    keep them until they close (``release_holder``)."""
    # The holders first: the tape's exit, interrupted after the removal, is
    # finished by ``finish_close``, which must find them.
    if holders and all(r is tape_record for r in scope.records):
        scope.holders = list(holders)
    scope.records.remove(tape_record)
    if not scope.records and not scope.holders:
        _drop(scope)


def finish_close(scope: Scope, tape_record: Record, holders: Sequence[Record] = ()) -> None:
    """``close_scope``, to finish a tape's exit that was interrupted (a
    ``KeyboardInterrupt``) at any point in it, or before it."""
    if any(r is tape_record for r in scope.records):
        close_scope(scope, tape_record, holders)
    elif not scope.records and not scope.holders:
        _drop(scope)


def abandon_scope(key: Any, tape_record: Record, before: Optional[Tuple[Scope, Tuple[Any, ...]]]) -> None:
    """Undoes an interrupted entry of the tape of ``tape_record`` in the scope
    of ``key``: ``before`` is ``scope_state(key)`` taken before it (None: the
    scope did not exist), or the scope is only left by the record."""
    scope = _scopes().get(key)
    if scope is None:
        scope = next((s for s in _all_scopes if s.key is key and s.thread == threading.get_ident()), None)
        if scope is None:
            return
    if before is None or before[0] is not scope:
        # Made by the entry (or listed, not yet in this thread's dict): it goes.
        scope.records[:] = [r for r in scope.records if r is not tape_record]
        if not scope.records and not scope.holders:
            _drop(scope)
        return
    scope.put_back(before[1])


def scope_state(key: Any, full: bool) -> Optional[Tuple[Scope, Tuple[Any, ...]]]:
    """This thread's scope of ``key`` and, if ``full``, a copy of what a tape
    entered again changes there (else only its records), for ``abandon_scope``."""
    scope = _scopes().get(key)
    return None if scope is None else (scope, scope.state(full))


def _drop(scope: Scope) -> None:
    """Forgets ``scope``'s versions and unregisters it. Each step can be run
    again, and the scope stays found (in this thread's scopes, with its
    holders) until it is unlisted everywhere: an interrupted tape exit
    finishes by dropping it once more (``finish_close``, ``release_holder``)."""
    with _all_lock: _unlist_locked(scope)  # noqa: E701 - see _list  # fmt: skip
    scopes = _scopes()
    if scopes.get(scope.key) is scope:
        del scopes[scope.key]
    if _with_unnamed:
        with _all_lock: _unlist_unnamed_locked(scope)  # noqa: E701 - see _list  # fmt: skip
    scope.current.clear()
    scope.owners.clear()
    scope.pinned.clear()
    scope.seen.clear()
    scope.canonical.clear()
    scope.dirty.clear()
    scope.resumed.clear()
    scope.unnamed.clear()
    scope.holders = []


# The records of the recorders closed that may be entered again
# (``_resuming.closed_tapes``), weakly.
_closed_refs = _leases.closed_refs


def note_write_while_closed(handle: Any, var: Any = None) -> None:
    """Notes, on every closed tape, that the variable behind ``handle`` (its
    own handle, as served with no tape open) or ``var`` was written."""
    if not _closed_refs:
        return
    own = handle if var is None else canonical_handle(var)
    for r in _closed_records():
        r.written_while_closed[id(own)] = own


def _closed_records() -> Iterator[Record]:
    """``closed_tapes``, through the weak set's own references, not its
    iterator: every write inside a tape asks while a plain tape that exited
    inside it lives, and the iterator's guard costs more than the rest."""
    for ref in list(_closed_refs):
        r = ref()
        if r is not None:
            yield r


def variable_of_handle(handle: Any) -> Optional[Any]:
    """The variable whose own (eager) handle ``handle`` is, if it is one."""
    if not isinstance(handle, ops.EagerTensor):
        return None
    var = _by_handle.get(id(handle))
    return var if var is not None and var.__dict__.get("_handle") is handle else None


# Every variable created while the patches are installed, by id of its own
# (eager) handle: a write through a handle fetched before a tape opened names
# its variable through this (``owner``).
_by_handle: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()

# id(an eager version handle) -> (a weak reference to it, its variable), for
# every eager version made, while it lives: a handle kept from a tape that has
# closed still names its variable.
_eager_versions: Dict[int, Tuple[Any, Any]] = {}


def _forget_version(ref: Any, key: int) -> None:
    found = _eager_versions.get(key)
    if found is not None and found[0] is ref:
        del _eager_versions[key]


def canonical_handle(var: Any) -> Any:
    """The variable's own handle, whatever version is current (``var`` as
    ``resolve`` returns it)."""
    return var.__dict__["_handle"]


def differentiable(var: Any) -> bool:
    """Whether writes to ``var`` carry gradients. Integer and bool variables
    (optimizer iteration counters, step flags) do not: their writes stay plain
    TensorFlow."""
    floating: bool = var.dtype.is_floating or var.dtype.is_complex
    return floating


def new_version(old: Any, write_result: Any) -> Any:
    """A fresh handle tensor for the same resource, unrecorded.

    It must not be recorded: a recorded Identity would chain the new version to
    the old one whenever the write itself is not recorded (a constant value, or
    nothing watched), leaking gradient to what produced the old value.
    """
    if executing_eagerly():
        copy = getattr(old, "_copy_nograd", None)
        if copy is not None:
            # A new EagerTensor for the same handle, without dispatching an op
            # and without recording: ~3 us against ~45 us for tf.identity. The
            # handle's dtype-and-shape data (which gradients w.r.t. a version
            # need) lives on the Python object, so carry it over.
            new = copy(_context.context(), old.device)
            handle_data = getattr(old, "_handle_data", None)
            if handle_data is not None:
                new._handle_data = handle_data
            return same_handle_attributes(old, new)
    with record.stop_recording():
        if executing_eagerly() or write_result is None:
            return same_handle_attributes(old, array_ops.identity(old))
        # In a graph, reads through the new handle must run after the write.
        with ops.control_dependencies([write_result]):
            return same_handle_attributes(old, array_ops.identity(root_handle(old)))


# Python attributes TensorFlow puts on a variable's handle tensor, which code
# that is given the variable looks up on ``v.handle``: a distributed
# variable's component keeps its container there (``values.DistributedVariable``
# sets it, since attributes of the variable itself, a CompositeTensor, are lost
# through nest). Keras 3 and tf_keras optimizers find a component's slots by it.
_HANDLE_ATTRIBUTES = ("_distributed_container",)


def same_handle_attributes(old: Any, new: Any) -> Any:
    """``new``, a version of the variable whose handle (or version) is ``old``,
    given the Python attributes TensorFlow set on the variable's handle, so that
    whatever looks them up on ``v.handle`` finds them on every version as on the
    handle itself. Every version is made through here (``new_version``, and the
    graph versions of ``_control_flow``)."""
    for name in _HANDLE_ATTRIBUTES:
        value = getattr(old, name, None)
        if value is not None:
            setattr(new, name, value)
    return new


def root_handle(handle: Any) -> Any:
    """In a graph: the handle that ``handle``, a version, is an identity of.

    Every version made in a graph is an identity of this root (not of the
    version before it, which the write's control dependency already orders):
    TensorFlow's automatic control dependencies resolve each op's resource
    through such identities, and a chain as long as the writes would make
    tracing quadratic in their number."""
    for _ in range(4):
        op = getattr(handle, "op", None)
        if op is None or op.type not in ("Identity", "IdentityN") or not op.inputs:
            break
        source = op.inputs[0]
        if source.dtype != dtypes.resource:
            break
        handle = source
    return handle
