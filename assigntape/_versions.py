"""Version bookkeeping: which handle tensor is each variable's current version.

Every write made while an ``AssignAwareTape`` is open gives the variable a new
*version*: a new handle tensor for the same resource. The mapping from a variable
to its current version lives here, never on the variable object, so that:

* threads do not see each other's versions (``threading.local``);
* a ``tf.function`` being traced does not see the versions of the eager tape
  around it, and so captures the variable's own (canonical) handle. One scope is
  kept for eager execution and one per ``FuncGraph`` in which a tape is open.

``HandleDescriptor`` is installed over ``BaseResourceVariable._handle`` while any
tape is open (a scope exists, in any thread). Python (``self._handle``,
``self.handle``) and TensorFlow's C++ fast path (``PyObject_GetAttrString(var,
"_handle")``) both look the attribute up, so every read of every kind goes to
the current version. While none is, the class has no ``_handle``: reads cost
what they cost without assigntape, and ``constructed`` notes new handles.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from assigntape import _leases, _signals
from assigntape._errors import ControlFlowWriteError, GraphWriteOrderError, NotAVariableError, UntrackedWriteError
from assigntape._record import Record, WriteRecord
from assigntape._tf import (
    BaseResourceVariable as _BASE_VARIABLE,
)
from assigntape._tf import (
    ControlFlowFuncGraph as _CONTROL_FLOW_GRAPH,
)
from assigntape._tf import (
    ShardedVariable,
    UnconnectedGradients,
    array_ops,
    dtypes,
    eager_tape,
    executing_eagerly,
    gen_resource_variable_ops,
    ops,
    pywrap_tfe,
    record,
    resource_variable_ops,
    tensor_lib,
)
from assigntape._tf import (
    context as _context,
)

__all__ = [
    "WriteRecord",
    "Scope",
    "HandleDescriptor",
    "constructed",
    "serve_handles",
    "owner",
    "check_writable_here",
    "Branch",
    "open_branch",
    "close_branch",
    "cond_context",
    "version_in",
    "open_scope",
    "close_scope",
    "open_elsewhere",
    "canonical_handle",
    "differentiable",
    "new_version",
    "same_handle_attributes",
]

_tls: Any = threading.local()  # per thread: scopes, plain, merging, constructing, ...
# Every open scope of every thread, for the one question asked across threads:
# is a variable tracked by a tape in another thread (see ``tracked_in_other_thread``)?
_all_scopes: List["Scope"] = []
_all_lock = threading.Lock()


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
        # Plain tapes and forward accumulators that were open around the last
        # AssignAwareTape here when it closed, and still are: they recorded its
        # writes, so until they close the scope stays, and every read and write
        # goes on through versions, for them (``close_scope``).
        self.holders: List[Any] = []
        # id(a variable's own handle) -> (that handle, the tapes that were closed
        # when it was written): writes no tape here saw, made while those tapes
        # were closed, resolved at the variable's first read (``cut_on_first_read``).
        self.dirty: Dict[int, Tuple[Any, List[Any]]] = {}
        # id(a variable's own handle) -> (a version, its variable, whether it
        # was made for a write no tape here saw, the records of the tapes
        # entered again that go on from it): each also in ``dirty``, whose
        # first read makes it current (``go_on_from``).
        self.resumed: Dict[int, Tuple[Any, Any, bool, List[Any]]] = {}
        # id(handle) -> (handle, op name): variables written, since the tape
        # opened, through a handle no tape could name (``unknown_variable_write``).
        self.unnamed: Dict[int, Tuple[Any, str]] = {}

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

    def current_versions(self, recorder: Any = None) -> Dict[str, Any]:
        """``current``, and the versions ``recorder`` (a tape, or a record)
        entered again goes on from, which become current at their variables'
        first read (``go_on_from``): until then, for the other tapes, the
        variable's own handle is its version."""
        found = dict(self.current)
        if recorder is None:
            return found
        for handle, var, _, knowing in self.resumed.values():
            if _among(knowing, recorder):
                found.setdefault(var._unique_id, handle)
        # Written while it was closed, not read since: a version it did not see made.
        for own, closed in self.dirty.values():
            var = variable_of_handle(own)
            if var is not None and var._unique_id not in found and _among(closed, recorder):
                unseen = found[var._unique_id] = new_version(own, None)
                self.owners[id(unseen)] = var
                self.pinned.append(unseen)
        return found

    def current_version(self, var: Any) -> Any:
        handle = self.current.get(var._unique_id)
        return canonical_handle(var) if handle is None else handle

    def advance(self, var: Any, old: Any, new: Any, write: "WriteRecord") -> None:
        """Makes ``new`` the variable's current version, for every open tape."""
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

    def adopt(self, var: Any, handle: Any) -> None:
        """Makes ``handle``, an existing version (not a write here), the
        variable's current one, kept while the scope lives."""
        uid = var._unique_id
        self.current[uid] = handle
        self.owners[id(handle)] = var
        self.pinned.append(handle)
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
        return any(r.recording() for r in self.records) or any(getattr(h, "_recording", False) for h in self.holders)


def _scopes() -> Dict[Any, Scope]:
    scopes = getattr(_tls, "scopes", None)
    if scopes is None:
        scopes = _tls.scopes = {}
    return scopes


def current_key() -> Any:
    return None if executing_eagerly() else ops.get_default_graph()


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


# The lock regions on a tape's way in and out are one-line ``with``
# statements around a function: an exception (a KeyboardInterrupt) can then
# land before the lock is taken, or in the function, whose exit releases it,
# but not between the block's last line and the release (a line event of the
# ``with`` line itself), which would leave it held for good.


def _list(scope: Scope) -> None:
    with _all_lock: _list_locked(scope)  # noqa: E701 - see above  # fmt: skip


def _list_locked(scope: Scope) -> None:
    global _active_at
    _all_scopes.append(scope)
    if len(_all_scopes) == 1:
        _serve_versions(True)
        _active_at = time.monotonic()
        if not _switched:
            _switch(True)


def _serve_versions(on: bool) -> None:
    """Puts the ``served`` class attributes in place while some scope is open
    in some thread, and takes them off when none is: code outside every tape
    then reads ``_handle`` from the instance dict, in C, and calls
    TensorFlow's own ``assign`` methods, as if nothing were installed.
    Called under ``_all_lock``."""
    for owner, name, replacement, original in served:
        present = owner.__dict__.get(name)
        if on and _serving and present is original:
            setattr(owner, name, replacement)
        elif not on and present is replacement:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _check_reads(on: bool) -> None:
    """Puts the ``read_checks`` in place while some scope has a write through
    a handle no tape could name (``_with_unnamed``), and takes them off when
    none has. Called under ``_all_lock``."""
    if _serving:
        for place in read_checks:
            place.put(on)


def serve_handles(on: bool) -> None:
    """``_patches`` installs (``on``) or uninstalls: the descriptor is served
    from now on while a scope is open, or never."""
    global _serving, _switched, _active_at
    with _all_lock:
        if on:
            _serving = True
            _serve_versions(bool(_all_scopes))
            _switched, _active_at = True, time.monotonic()  # installing put them all in place
        else:
            _serve_versions(False)
            _check_reads(False)
            for place in acting_checks:
                place.put(False)
            _serving = _switched = False
            read_checks.clear()
            acting_checks.clear()
            switches.clear()


def _switch(on: bool) -> None:
    """Puts the ``switches`` in place (``on``) or takes them off. Called under ``_all_lock``."""
    global _switched
    if _serving:
        for put in switches:
            put(on)
        _switched = on


def idle(wait: Optional[float] = None) -> None:
    """A dormant patch was called with no tape open or closed-but-alive in
    any thread: if none has been for ``wait`` seconds (``IDLE_SECONDS``), and
    no plain tape keeps versions, the ``switches`` come off, and code outside
    every tape calls TensorFlow's own functions from then on (until the next
    tape opens). Waiting keeps a loop that opens a tape every step from
    putting them on and off every step."""
    global _active_at
    if time.monotonic() - _active_at < (IDLE_SECONDS if wait is None else wait):
        return
    with _all_lock:
        if _switched and not _all_scopes and not _leases.closed_refs:
            if _leases.plain:
                # A plain tape that ran beside one of ours keeps versions: its
                # gradient must still map them (``_plain_tapes.gradient``).
                # Asked again once it may be gone.
                _active_at = time.monotonic()
                return
            _switch(False)


def hold_closed(tape_record: Record) -> None:
    """A tape closes and may be entered again (or asked for gradients): its
    record notes the writes made meanwhile, so the write patches must be in
    place while it lives."""
    with _all_lock: _hold_closed_locked(tape_record)  # noqa: E701 - see _list  # fmt: skip


def _hold_closed_locked(tape_record: Record) -> None:
    global _active_at
    closed_tapes.add(tape_record)
    # (A forked child forgets the tapes other threads closed: ``_after_fork_in_child``.)
    tape_record.closed_in = threading.get_ident()
    _active_at = time.monotonic()
    if not _switched:
        _switch(True)


_serving = False
# What ``_patches`` puts in place only while a tape may need it: callables
# ``put(on)``, the wrappers of the functions TensorFlow's own code calls
# (writes, strategy updates, traced functions' calls), each of which costs a
# call through a dormant wrapper outside every tape. (The ``tf.raw_ops``
# modules keep their wrappers: setting them is slow, and TensorFlow does not
# call them.)
switches: List[Any] = []
_switched = False
# When the last tape opened or closed (time.monotonic()), for ``idle``.
_active_at = 0.0
IDLE_SECONDS = 0.05
# (class, attribute, what is put there, what was there or None) while a
# scope is open: the handle descriptor (on a class that has none, so that
# taking it off leaves the instance's), and the eager short paths of a
# variable's methods (``_short_paths``).
served: List[Tuple[Any, str, Any, Any]] = []
# The places (``_wrapping.Place``) of the patches ``_patches`` puts in
# place only while ``_with_unnamed`` is not empty (``accessed``): every
# variable read calls them, and until then they have nothing to do.
read_checks: List[Any] = []
# The places of the patches ``_patches`` puts in place only while some thread
# acts for a replica (``acting_for``; how many do: ``_acting``): every variable
# read calls them, and only a replica's work in merge_call needs them.
acting_checks: List[Any] = []
_acting = 0


def _seed_from_around(scope: Scope) -> None:
    """A tape opened inside a cond branch or loop body of another tape's graph
    starts from the versions that body sees (the outer tape's, and the body's
    own writes): read through the variable's own handle instead, its values
    would be right and their gradient would not reach the outer tape."""
    around = branch_around(scope)
    if around is None:
        return
    outer = around.scope
    for uid in set(outer.current).union(*(b.versions for b in _chain(around))):
        handle = around.version_of_uid(uid)
        if handle is None:
            handle = outer.current[uid]
        var = outer.owners.get(id(handle))
        if var is not None:
            scope.current[uid] = handle
            scope.owners[id(handle)] = var


def _chain(branch: Optional["Branch"]) -> Iterator["Branch"]:
    """``branch`` and the bodies it is nested in, innermost first."""
    while branch is not None:
        yield branch
        branch = branch.parent


def close_scope(scope: Scope, tape_record: Record, holders: Sequence[Any] = ()) -> None:
    """Unregisters ``tape``; the last tape out drops the scope's versions,
    unless ``holders`` (plain tapes, forward accumulators open around it)
    keep them until they close (``release_holder``)."""
    # The holders first: the tape's exit, interrupted after the removal, is
    # finished by ``finish_close``, which must find them.
    if holders and all(r is tape_record for r in scope.records):
        scope.holders = list(holders)
    scope.records.remove(tape_record)
    if not scope.records and not scope.holders:
        _drop(scope)


def finish_close(scope: Scope, tape_record: Record, holders: Sequence[Any] = ()) -> None:
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


def held_by(holder: Any) -> Dict[str, Tuple[Any, Any]]:
    """The versions ``holder`` (a plain tape or forward accumulator closing)
    holds in the current graph: unique id -> (handle, variable)."""
    scope = _scopes().get(current_key())
    if scope is None or scope.records or not any(h is holder for h in scope.holders):
        return {}
    return owned(scope.current_versions(holder))


def _among(records: Sequence[Any], recorder: Any) -> bool:
    """Whether ``recorder`` (a tape, or its record) is one of ``records``."""
    return any(r is recorder or r._tape() is recorder for r in records)


def unseen_writes(recorder: Any, ids: bool = False) -> List[Any]:
    """The own handles (``ids``: their ids) of the variables written while
    ``recorder`` (a tape entered again, or its record) was closed and not read
    since (``Scope.dirty``, for a variable not current here: a variable written
    through a handle no read served may be current with its entry left): a
    write it did not see, also when it is entered once more."""
    scope = _scopes().get(current_key())
    if scope is None:
        return []
    found = []
    for own, closed in scope.dirty.values():
        var = variable_of_handle(own)
        if _among(closed, recorder) and (var is None or var._unique_id not in scope.current):
            found.append(id(own) if ids else own)
    return found


def resume_holder(
    holder: Any, held: Dict[str, Tuple[Any, Any]], written: Dict[int, Any], resuming: Optional[Record] = None
) -> None:
    """A plain tape or forward accumulator that held versions (``held_by``),
    or that exited where a tape of ours was open (``owned``: the versions
    current then), is entered again in the same graph: it goes on from them,
    except for the variables written meanwhile (``written``, by id of their
    own handle): for it such a write is one it did not record, as under
    ``stop_recording``, so they go on from a new version with no gradient path
    (their own handle may be a version it started from).

    A plain tape (``resuming``: its record, which pauses it) does so at each
    variable's first read, as a tape of ours entered again does
    (``_resume_inside``), also where a tape of ours opened since is open
    (which goes on from its own). An accumulator, which cannot be paused, does
    so at once where no tape of ours is open (``_resume_now``), and goes on
    from that tape's versions where one is.
    """
    key = current_key()
    scope = _scopes().get(key)
    if scope is None and (held or written):
        scope = _scopes()[key] = Scope(key)
        _list(scope)
        scope.holders = [holder]
        if resuming is None:
            _resume_now(scope, held, written)
            return
    if scope is not None and resuming is not None:
        _resume_inside(scope, held, written, resuming)


def _resume_now(scope: Scope, held: Dict[str, Tuple[Any, Any]], written: Dict[int, Any]) -> None:
    """``resume_holder`` for an accumulator, in the scope just made for it."""
    written = dict(written)
    for handle, var in held.values():
        own = canonical_handle(var)
        if written.pop(id(own), None) is not None:
            handle = new_version(own, None)
        scope.adopt(var, handle)
    # Written meanwhile and not among them: its own handle would be credited
    # to it as its source (which means the version at its entry, not this one).
    for own in written.values():
        var = variable_of_handle(own)
        if var is not None:
            scope.adopt(var, new_version(own, None))


def _resume_inside(scope: Scope, held: Dict[str, Tuple[Any, Any]], written: Dict[int, Any], resuming: Record) -> None:
    """``resume_holder`` for a plain tape: each variable no tape of ``scope``
    wrote goes on from the holder's version (``go_on_from``), or,
    written while the holder was closed, from a new version it has no path
    through, made at its first read (``cut_on_first_read``). A variable a
    tape of ``scope`` wrote goes on from that tape's version, made by a write
    the holder did not record."""
    resumed = []
    for handle, var in held.values():
        own = canonical_handle(var)
        if id(own) not in written and var._unique_id not in scope.current:
            resumed.append((var, own, handle, False))
    go_on_from(scope, resumed, resuming)
    for own in written.values():
        var = variable_of_handle(own)
        if var is not None and var._unique_id not in scope.current:
            scope.dirty.setdefault(id(own), (own, []))[1].append(resuming)
            scope.seen.add(var._unique_id)


def go_on_from(scope: Scope, resumed: Sequence[Tuple[Any, Any, Any, bool]], resuming: Record) -> None:
    """Each ``(variable, its own handle, version, made)`` of ``resumed``: the
    tape of ``resuming``, entered again, goes on from that version (``made``:
    one it made for a write it did not see while closed). The tapes opened
    since it was closed know the variable by its own handle (none open then
    and still is: the scope would have kept its versions), so at its first
    read here the version becomes current, recorded as an identity of that
    handle on every recorder but those that know it and those that did not
    see it made (``cut_on_first_read``). Another tape entered again before
    may go on from another version of the variable: one some tape knows is
    kept, and for the others it is a write they did not see. Noted as seen
    now: another thread must not write the variable behind the tape."""
    for var, own, handle, made in resumed:
        closed_at_write = scope.dirty.setdefault(id(own), (own, []))[1]
        entry = scope.resumed.get(id(own))
        if entry is None or (entry[2] and not made):
            if entry is not None:
                closed_at_write.extend(entry[3])  # the made one yields
            scope.resumed[id(own)] = (handle, var, made, [resuming])
            scope.owners[id(handle)] = var
            scope.pinned.append(handle)
        elif entry[0] is handle:
            entry[3].append(resuming)
        else:
            closed_at_write.append(resuming)
        scope.seen.add(var._unique_id)


def owned(versions: Dict[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """``versions`` (unique id -> handle, current in this thread's scope here)
    with their variables, as ``held_by`` gives them."""
    scope = _scopes().get(current_key())
    owners = scope.owners if scope is not None else {}
    return {uid: (handle, owners[id(handle)]) for uid, handle in versions.items() if id(handle) in owners}


def release_holder(instance: Any) -> None:
    """A plain tape or forward accumulator closes: the scopes of this thread
    that it held, and nothing else holds, are dropped."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes:
        return
    for scope in list(scopes.values()):
        if any(h is instance for h in scope.holders):
            scope.holders = [h for h in scope.holders if h is not instance]
        # (Also one whose drop was interrupted: it is finished now.)
        if not scope.holders and not scope.records:
            _drop(scope)


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


def _unlist_unnamed_locked(scope: Scope) -> None:
    _with_unnamed.discard(id(scope))
    if not _with_unnamed:
        _check_reads(False)


def _unlist_locked(scope: Scope) -> None:
    global _active_at
    if any(s is scope for s in _all_scopes):
        _all_scopes.remove(scope)
    if not _all_scopes:
        _serve_versions(False)
        _active_at = time.monotonic()


def open_here() -> bool:
    """Whether this thread has a scope (an open tape, or versions held for a
    plain one): else ``v._handle`` is the variable's own handle, served with
    no side effect."""
    return bool(getattr(_tls, "scopes", None))


def any_scopes() -> bool:
    """Whether a tape is open in any thread."""
    return bool(_all_scopes)


def _other_threads() -> List[Scope]:
    me = threading.get_ident()
    # Acting for a replica in merge_call: the replicas are all paused there,
    # and each touches its own components (though it may have looked at
    # another's, for its device).
    merging = getattr(_tls, "merging", ())
    with _all_lock:
        return [scope for scope in _all_scopes if scope.thread != me and scope not in merging]


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
    with _all_lock:
        scopes = list(_all_scopes)
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
    theirs = _recording_tapes(scope)
    for tape in theirs:
        eager_tape.push_tape(tape)
    try:
        return bool(pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop(tensors))
    finally:
        for tape in reversed(theirs):
            eager_tape.pop_tape(tape)


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
    for tape in reversed(mine):
        eager_tape.pop_tape(tape)
    try:
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
    finally:
        for tape in mine:
            eager_tape.push_tape(tape)


@contextlib.contextmanager
def acting_for(scope: Scope, merging: Sequence[Scope]) -> Iterator[None]:
    """Runs the block in this thread as if in ``scope``'s (a replica thread
    paused in ``merge_call``, with the others of ``merging``): its versions
    are served and advanced, and its recording tapes and forward accumulators
    record the block's ops (TensorFlow keeps both sets per thread), and the
    variables they read are watched as the replica's reads are
    (``_distribute.watched_as_replica``, an ``acting_checks`` patch)."""
    saved = getattr(_tls, "scopes", None), getattr(_tls, "merging", ())
    recording = _recording_tapes(scope)
    accumulators = _recording_accumulators(scope)
    # All or nothing: each change is noted on the line that makes it (no line
    # between for an exception, a KeyboardInterrupt, to land on), and undone
    # from those notes; the undoing runs once more if interrupted.
    pushed: List[Any] = []
    added: List[Any] = []
    counted: List[bool] = []

    def undo() -> None:
        while added: pywrap_tfe.TFE_Py_ForwardAccumulatorSetRemove(added.pop())  # noqa: E701  # fmt: skip
        while pushed: eager_tape.pop_tape(pushed.pop())  # noqa: E701  # fmt: skip
        _tls.scopes, _tls.merging = saved
        if counted: _count_acting(-1); counted.clear()  # noqa: E701, E702  # fmt: skip

    try:
        _tls.scopes, _tls.merging = {scope.key: scope}, tuple(merging)
        for tape in recording: eager_tape.push_tape(tape); pushed.append(tape)  # noqa: E701, E702  # fmt: skip
        for accumulator in accumulators: pywrap_tfe.TFE_Py_ForwardAccumulatorSetAdd(accumulator); added.append(accumulator)  # noqa: E701, E702, E501  # fmt: skip
        _count_acting(1); counted.append(True)  # noqa: E702  # fmt: skip
        yield
    finally:
        try: undo()  # noqa: E701  # fmt: skip
        except BaseException:
            undo()
            raise


def _count_acting(step: int) -> None:
    """One more (``step`` 1) or one fewer (-1) thread acting for a replica:
    the ``acting_checks`` are in place while any does (the replica threads a
    merge_call starts act at once)."""
    global _acting
    with _all_lock:
        _acting += step
        if _serving and _acting == (1 if step > 0 else 0):
            for place in acting_checks:
                place.put(step > 0)


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


def _before_fork() -> None:
    # Held across the fork, so that the child's copy is not held by a thread
    # that does not exist there (it would wait on it for ever).
    _leases.lock.acquire()
    _all_lock.acquire()
    me = threading.get_ident()
    for thread, opened in list(_plain_by_thread.items()):
        if thread != me:
            _open_elsewhere_at_fork.extend(ref() for ref, _ in list(opened))


def _after_fork_in_parent() -> None:
    _open_elsewhere_at_fork.clear()
    _all_lock.release()
    _leases.lock.release()


def _after_fork_in_child() -> None:
    """In a forked child only the thread that forked exists: the tapes the
    other threads had open will never close, and must not bind it (refuse
    its writes to variables they read, keep the patches from ``uninstall``,
    keep the descriptor served). Their scopes and leases go."""
    global _active_at
    try:
        _leases.forget_other_threads()
        me = threading.get_ident()
        gone = [scope for scope in _all_scopes if scope.thread != me]
        for scope in gone:
            _all_scopes.remove(scope)
            _with_unnamed.discard(id(scope))
        if gone and not _with_unnamed:
            _check_reads(False)
        if gone and not _all_scopes:
            _serve_versions(False)
            _active_at = time.monotonic()
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
            return found
    return None


def variable_of_handle(handle: Any) -> Optional[Any]:
    """The variable whose own (eager) handle ``handle`` is, if it is one."""
    if not isinstance(handle, ops.EagerTensor):
        return None
    var = _by_handle.get(id(handle))
    return var if var is not None and var.__dict__.get("_handle") is handle else None


def refuse_other_thread(handle: Any, var: Optional[Any], op_name: str) -> None:
    """Refuses a write to a variable that a tape open in another thread has
    read or written: that tape would read the value written here while it
    credits its own version."""
    found = tracked_in_other_thread(handle, var)
    if found is not None and differentiable(found):
        raise UntrackedWriteError(
            f"{op_name} to variable {found.name!r} from thread {threading.current_thread().name!r}, "
            "while an AssignAwareTape open in another thread has read or written it: that "
            "tape would read the value written here and credit its own version, a silently "
            "wrong gradient. Write the variable from the tape's thread, or after its tape closes."
        )


def refuse_or_cut(scopes: List[Scope], var: Any, what: str, message: str) -> None:
    """The one answer to a write of ``var`` that the tapes of ``scopes`` cannot
    differentiate: raise ``UntrackedWriteError`` with ``message`` unless every
    tape there passed ``untracked_writes="cut"``, in which case warn. Call it
    before the write, so that a refusal leaves the variable and the tapes as
    they were, and ``cut`` after it."""
    if any(scope.refuses_untracked() for scope in scopes):
        raise UntrackedWriteError(
            message + " Or pass AssignAwareTape(untracked_writes='cut') to treat the write as a "
            "new version with no gradient path."
        )
    warnings.warn(
        f"AssignAwareTape: {what} wrote {var.name!r}; no gradient flows through that write (untracked_writes='cut').",
        stacklevel=4,
    )


def cut(scopes: List[Scope], var: Any, what: str, after: Any = None) -> None:
    """After a write ``refuse_or_cut`` let through: a new version, no gradient path."""
    for scope in scopes:
        old = scope.current_version(var)
        scope.advance(var, old, new_version(old, after), WriteRecord(what, cut=True))


# The records of tapes that are closed (exited, and not yet done) and may be
# entered again (AssignAwareTapes, and plain tapes that held versions).
# Every write made meanwhile, by any path, is noted on each of them: on
# re-entry such a write is, for that tape, a new version with no gradient path,
# as a write under stop_recording is (see ``AssignAwareTape.__enter__``).
# They are ``_leases.closed``: while any is there, the patches are needed.
closed_tapes = _leases.closed
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


def forget_closed_writes(recorder: Any) -> None:
    """``tape.reset()`` (``recorder``: a tape of ours' record, or a plain tape
    entered again): writes made while the tape was closed and not read yet
    (``Scope.dirty``) now come before the tape's start, so for it they are no
    longer writes with no gradient path: their first read is an identity for
    it, as for the tapes opened since."""
    for scope in _scopes().values():
        for _, closed_at_write in scope.dirty.values():
            closed_at_write[:] = [r for r in closed_at_write if not _among((r,), recorder)]


# What made a version written while a tape was closed, as that tape sees it.
CLOSED_WRITE = WriteRecord("a write while the tape was closed", cut=True)


def cut_on_first_read(scope: "Scope", var: Any, own: Any) -> Any:
    """The first read, in ``scope``, of a variable written while a tape of it was
    closed and not otherwise known to that tape: a new version, with no gradient
    path for the tapes that were closed at the write, and an identity for the
    tapes opened since (for them the write came before they started)."""
    closed_at_write = scope.dirty.pop(id(own))[1]
    # Or the version tapes entered again go on from (``go_on_from``).
    entry = scope.resumed.pop(id(own), None)
    new, knowing = (new_version(own, None), []) if entry is None else (entry[0], entry[3])
    # Record the identity on every recording tape except those that were
    # closed (those of ours here, or plain ones entered again) and those that
    # know the version.
    paused: List[Any] = []
    for r in [*closed_at_write, *knowing]:
        if r.recording() and all(r is not p for p in paused):
            paused.append(r)
    for r in paused:
        r.pause()
    try:
        # As a read would: watched, so that the tapes opened since record it.
        resource_variable_ops.variable_accessed(var)
        record.record_operation("Identity", [new], [own], lambda g: [g], forward_function=lambda t: [t])
    finally:
        for r in reversed(paused):
            r.resume()
    scope.adopt(var, new)
    for r in scope.records:
        if all(r is not k for k in knowing):
            r.note_write(var, own, new, CLOSED_WRITE if r in closed_at_write else WriteRecord("Identity"))
    return new


def zeros_like_source(source: Any, handle: Any, shape: Any = None) -> Any:
    """Zeros for a gradient ``source``: a variable (``handle`` its version),
    whose shape is the variable's, or ``shape`` where given (a version's shape
    when the variable's is not fully defined), or else the resource's now."""
    var = resolve(source)
    if var is None:
        return array_ops.zeros_like(source)
    if var.shape.is_fully_defined():
        return array_ops.zeros(var.shape, dtype=var.dtype)
    return array_ops.zeros(dynamic_shape(handle) if shape is None else shape, dtype=var.dtype)


def dynamic_shape(handle: Any) -> Any:
    """The shape of the variable behind ``handle`` now, as a tensor."""
    with record.stop_recording():
        return gen_resource_variable_ops.variable_shape(handle)


def _enclosing_scope(scopes: Dict[Any, Scope]) -> Optional[Scope]:
    """The scope of the current graph or, inside a control-flow body, of the
    nearest enclosing graph that has one."""
    if executing_eagerly():
        return scopes.get(None)
    graph: Any = ops.get_default_graph()
    while graph is not None:
        scope = scopes.get(graph)
        if scope is not None:
            return scope
        # A tf.cond branch or while body is a control-flow FuncGraph whose
        # outer_graph is the graph around it, and runs as part of it. Any other
        # FuncGraph (a nested tf.function, AutoGraph's staging graph) is a
        # function of its own: it captures the variable's own handle, and a
        # call maps that capture to the current version (``_functions``).
        if not isinstance(graph, _CONTROL_FLOW_GRAPH):
            return None
        graph = graph.outer_graph
    return None


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


def plain_question(target: Any, sources: Any, unconnected_gradients: Any) -> bool:
    """Whether a tape's ``gradient`` is asked of a tensor target, for a list or
    tuple of plain variables, with ``None`` for the unconnected ones: where
    no source or target needs mapping to a version if ``serves_own_handles``."""
    if not isinstance(target, tensor_lib.Tensor) or type(sources) not in (list, tuple):
        return False
    if unconnected_gradients is not UnconnectedGradients.NONE and unconnected_gradients != "none":
        return False
    for s in sources:
        if type(s) is not _RESOURCE_VARIABLE:
            return False
    return True


def serves_own_handles() -> bool:
    """Whether ``v.handle`` is every variable's own handle here, and asking it
    has no side effect: no tape is open in this thread, or, eagerly, the only
    scope of the thread has no version, no write awaiting a first read, and
    no write through a handle no tape could name."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes:
        return True
    scope = eager_scope()
    return (
        scope is not None
        and len(scopes) == 1
        and not scope.current
        and not scope.dirty
        and not scope.unnamed
        and not getattr(_tls, "merging", ())
    )


def short_path_read_scope(var: Any) -> Optional[Scope]:
    """This thread's eager scope where a method of ``var`` may take its short
    path (``_short_paths``), else None: executing eagerly with no graph made
    the default (not inside ``tf.init_scope()`` while a function is traced,
    whose graph notes the variables used), on a plain ``ResourceVariable``
    (no distribution strategy's component)."""
    scope = eager_scope()
    if (
        scope is None
        or _GRAPH_STACK.stack
        or type(var) is not _RESOURCE_VARIABLE
        or var.__dict__.get("_distribute_strategy") is not None
    ):
        return None
    return scope


def short_path_scope(var: Any) -> Optional[Scope]:
    """``short_path_read_scope``, for a write method: also in a thread whose
    tape is the only one open in any thread (none could have seen the
    variable), not acting for a replica, on a differentiable variable."""
    scope = short_path_read_scope(var)
    if (
        scope is None
        or len(_tls.scopes) < len(_all_scopes)
        or getattr(_tls, "merging", None)
        or not differentiable(var)
    ):
        return None
    return scope


def owner(tensor: Any) -> Optional[Tuple[Scope, Any]]:
    """The scope and variable whose handle ``tensor`` is, if a tape tracks it
    (or, eagerly, if it is a variable's own handle: the tape tracks it from now)."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes or not isinstance(tensor, tensor_lib.Tensor) or getattr(_tls, "constructing", None):
        return None
    scope = _enclosing_scope(scopes)
    if scope is None:
        return None
    var = scope.owners.get(id(tensor))
    if var is None and isinstance(tensor, ops.EagerTensor):
        # (In a tape's graph too: the op is given the eager handle, captured after.)
        var = _by_handle.get(id(tensor))
        if var is None or var.__dict__.get("_handle") is not tensor:
            # A version an earlier tape made (``tape.versions(v)``, kept): it
            # names the same resource, so the variable's current version here.
            made = _eager_versions.get(id(tensor))
            if made is None or made[0]() is not tensor:
                return None
            return scope, made[1]
        # A handle fetched before the tape opened (or by code that keeps
        # handles): the variable's own, so the version the tape starts from.
        if var._unique_id not in scope.current:
            scope.owners[id(tensor)] = var
            scope.seen.add(var._unique_id)
            scope.canonical[id(tensor)] = var
        else:
            # Already written in this tape: the handle names its current version.
            scope.canonical[id(tensor)] = var
    return None if var is None else (scope, var)


def constructing(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """A variable's constructor (``UnliftedInitializerVariable``, which a
    ``tf.function`` makes on its first trace, Keras layers built lazily
    included): its initializing write, which TensorFlow puts in a ``tf.cond``
    in the function's graph, is creation, not a write a tape differentiates
    (as an eager variable's is not): left to TensorFlow."""
    _tls.constructing = getattr(_tls, "constructing", 0) + 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        _tls.constructing -= 1


def unknown_variable_write(tensor: Any, op_name: str) -> None:
    """Notes, inside a recording tape, a write through an eager handle no tape
    can name (a variable created before any tape, its handle fetched before
    this one opened) to an initialized floating-point variable. Its first read
    in the tape is refused (``refuse_unnamed``): the tape would read the
    written value and credit the version from before. A variable the tape
    never reads is plain TensorFlow; a variable's first write (its
    initialization) is not noted."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes or not isinstance(tensor, ops.EagerTensor):
        return
    scope = _enclosing_scope(scopes)
    if scope is None or tensor.dtype != dtypes.resource or pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return
    data = resource_variable_ops.get_eager_safe_handle_data(tensor)
    if not data.is_set or not data.shape_and_type:
        return
    dtype = dtypes.as_dtype(data.shape_and_type[0].dtype)
    if not (dtype.is_floating or dtype.is_complex):
        return
    with ops.init_scope():  # the handle is eager, even while a graph is built
        if not gen_resource_variable_ops.var_is_initialized_op(tensor):
            return
    scope.unnamed[id(tensor)] = (tensor, op_name)
    with _all_lock:
        if not _with_unnamed:
            _check_reads(True)
        _with_unnamed.add(id(scope))


# id() of every scope with a write noted by ``unknown_variable_write``: while
# it is not empty every read asks ``accessed`` (``read_checks``).
_with_unnamed: Set[int] = set()


def accessed(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``tape.variable_accessed``, the first thing an eager read does: refuse
    a variable written through a handle no tape could name here, in Python,
    before TensorFlow's C++ code reads ``v.handle`` (an error raised from there
    would surface as a SystemError)."""
    scopes = getattr(_tls, "scopes", None) if _with_unnamed else None
    if scopes:
        scope = _enclosing_scope(scopes)
        if scope is not None and scope.unnamed:
            var = resolve(args[0] if args else kwargs.get("variable"))
            if var is not None and var._unique_id not in scope.current:
                refuse_unnamed(scope, var, var.__dict__.get("_handle"))
    return wrapped(*args, **kwargs)


def handle_for_read(handle: Any) -> Any:
    """The resource a raw read op (``tf.raw_ops.ReadVariableOp``, ...) given
    ``handle`` should read: the handle ``v.handle`` would give here now, if
    ``handle`` is one of the handles of a variable ``v`` a tape tracks (its
    own, fetched before the tape, or an earlier version): the read is then
    credited to the current version, as any other read."""
    found = owner(handle)
    if found is None:
        scopes = getattr(_tls, "scopes", None)
        scope = _enclosing_scope(scopes) if scopes else None
        if scope is not None and scope.unnamed:
            refuse_unnamed(scope, None, handle)
        return handle
    return found[1].handle


def refuse_unnamed(scope: Scope, var: Any, handle: Any) -> None:
    """Raises if ``var`` (its own ``handle``) was written through a handle no
    tape could name since ``scope``'s tape opened (``unknown_variable_write``)."""
    found = scope.unnamed.get(id(handle))
    if found is None or found[0] is not handle:
        return
    raise UntrackedWriteError(
        f"{'A variable' if var is None else f'Variable {var.name!r}'} was written by {found[1]} through a resource handle that no "
        "open AssignAwareTape could name (the variable was created before assigntape's "
        "first tape, and the handle fetched before this tape opened), and is now read in "
        "the tape: it would read the written value and credit the version from before, a "
        "silently wrong gradient. Fetch the handle inside the tape (v.handle), or write "
        "with v.assign / assign_add / assign_sub."
    )


def call_context() -> Optional[Tuple[Scope, Optional["Branch"]]]:
    """For a function called now: the scope of the tape around the call, and
    the cond branch or loop body the call is in (None at the tape's level)."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes:
        return None
    scope = _enclosing_scope(scopes)
    if scope is None:
        return None
    if executing_eagerly() or scope.key is ops.get_default_graph():
        return scope, None
    return scope, _current_branch()


# The default-graph stack (per thread): empty while executing eagerly
# outside every ``as_default()`` and function trace.
_GRAPH_STACK = ops._default_graph_stack


def eager_scope() -> Optional[Scope]:
    """This thread's eager scope, when executing eagerly with a tape open."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes:
        return None
    ctx = _context._context  # (every eager read asks: TensorFlow's context, directly)
    if ctx is None or not ctx._thread_local_data.is_eager:
        return None
    scope: Optional[Scope] = scopes.get(None)
    return scope


class Branch:
    """A ``tf.cond`` branch being traced in the graph of an open tape (or in a
    branch of such a cond: ``parent``).

    Writes in the branch cannot make versions in the tape's graph directly (a
    tensor made in the branch cannot leave it), so the branch keeps its own:
    ``versions`` maps a variable to its latest handle inside the branch, and
    ``values`` to its full value after the branch's writes, written as plain
    ops so that the cond's own gradient can differentiate it. The cond returns
    those values as extra outputs, and the graph around it makes the versions.
    """

    __slots__ = ("scope", "graph", "parent", "versions", "values", "carried", "token")

    def __init__(
        self,
        scope: Scope,
        graph: Any,
        parent: Optional["Branch"],
        carried: Optional[List[str]] = None,
        token: Any = None,
    ) -> None:
        self.scope = scope
        self.graph = graph
        self.parent = parent
        self.versions: Dict[str, Any] = {}  # unique id -> handle inside the branch
        self.values: Dict[str, Tuple[Any, Any]] = {}  # unique id -> (variable, value)
        # A loop body, not a cond branch: the variables carried as loop state, and
        # the loop's identity across the attempts to trace it.
        self.carried = carried
        self.token = token

    def version_of_uid(self, uid: str) -> Optional[Any]:
        """The latest handle written here or in an enclosing branch, if any."""
        branch: Optional[Branch] = self
        while branch is not None:
            handle = branch.versions.get(uid)
            if handle is not None:
                return handle
            branch = branch.parent
        return None

    def version_of(self, var: Any) -> Any:
        """The variable's version as this branch sees it."""
        handle = self.version_of_uid(var._unique_id)
        return self.scope.current_version(var) if handle is None else handle


def latest_unread(scope: Scope, var: Any, recorder: Any) -> Any:
    """A variable target's version for ``recorder``, a plain tape entered
    again and open in ``scope``, where the variable has not been read since
    (not current there): the version it goes on from, or, written while it was
    closed, one it did not see made (no gradient path), else its own handle."""
    own = canonical_handle(var)
    entry = scope.resumed.get(id(own))
    if entry is not None and _among(entry[3], recorder):
        return entry[0]
    dirty = scope.dirty.get(id(own))
    if dirty is not None and _among(dirty[1], recorder):
        return new_version(own, None)
    return own


def version_in(scope: Scope, branch: Optional[Branch], var: Any) -> Any:
    """The variable's version in ``branch`` (a cond branch or loop body), or at
    the tape's own level when ``branch`` is None."""
    return scope.current_version(var) if branch is None else branch.version_of(var)


def open_branch(
    scope: Scope, parent: Optional[Branch], carried: Optional[List[str]] = None, token: Any = None
) -> Branch:
    """Registers the graph being traced now as a cond branch (or, with
    ``carried``, a loop body) of ``scope``."""
    branches = getattr(_tls, "branches", None)
    if branches is None:
        branches = _tls.branches = {}
    graph = ops.get_default_graph()
    branch = branches[graph] = Branch(scope, graph, parent, carried, token)
    return branch


def close_branch(branch: Branch) -> None:
    _tls.branches.pop(branch.graph, None)


def cond_context() -> Optional[Tuple[Scope, Optional[Branch]]]:
    """For a ``tf.cond`` or loop being built now: the scope of the tape whose
    graph it is in, and the branch or loop body it is nested in (None at the
    tape's own level). None if the graph being built is neither (eager, no
    tape, or a body we do not track, such as a nested tf.function's)."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes or executing_eagerly():
        return None
    graph = ops.get_default_graph()
    scope = scopes.get(graph)
    if scope is not None:
        return scope, None
    branch = _current_branch()
    return None if branch is None else (branch.scope, branch)


def _current_branch() -> Optional[Branch]:
    branches = getattr(_tls, "branches", None)
    return branches.get(ops.get_default_graph()) if branches else None


def open_plain() -> List[Any]:
    """The plain tapes and forward accumulators open in this thread, as
    (weak reference, graph key it was opened in), innermost last (kept by
    ``_plain_tapes``)."""
    found = getattr(_tls, "plain", None)
    if found is None:
        found = _tls.plain = _plain_by_thread[threading.get_ident()] = _PlainList()
    return found


class _PlainList(List[Any]):
    """A list that can be referenced weakly."""


# The same lists by thread: a replica's, read from the main thread while it
# waits in merge_call. (A thread's entry goes with its thread-local list.)
_plain_by_thread: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def recording_now() -> List[Any]:
    """What records in this thread now: the records of our tapes recording,
    and the plain tapes and forward accumulators recording."""
    found: List[Any] = [r for s in getattr(_tls, "scopes", {}).values() for r in s.records if r.recording()]
    for ref, _ in open_plain():
        recorder = ref()
        if recorder is not None and getattr(recorder, "_recording", False):
            found.append(recorder)
    return found


def records(recorder: Any) -> bool:
    """Whether one of our tapes (its record), a plain tape or an accumulator
    records now."""
    if pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return False
    return recorder.recording() if isinstance(recorder, Record) else bool(getattr(recorder, "_recording", False))


def outermost(scope: Scope) -> Scope:
    """The scope of the tape whose graph holds the outermost cond or loop
    around ``scope`` (``scope`` itself unless its tape was opened in another
    tape's body): the tape whose gradient of that cond or loop is symbolic."""
    around = branch_around(scope)
    while around is not None:
        scope = around.scope
        around = branch_around(scope)
    return scope


def branch_around(scope: Scope) -> Optional[Branch]:
    """For a tape opened inside a cond branch or loop body of another tape's
    graph: that body (its writes must leave it as the outer tape's versions
    too), else None."""
    branches = getattr(_tls, "branches", None)
    if not branches or scope.key is None:
        return None
    branch = branches.get(scope.key)
    return branch if branch is not None and branch.scope is not scope else None


def check_writable_here(scope: Scope, var: Any, op_name: str) -> Any:
    """Where a write goes: the tape's own graph (None), a cond branch or loop body
    of it (the ``Branch``), or a body it cannot leave (refused)."""
    if scope.key is current_key():
        return None
    branch = _current_branch()
    if branch is not None and branch.scope is scope:
        return branch
    raise ControlFlowWriteError(
        f"{op_name} to variable {var.name!r} inside a graph body the tape cannot "
        "follow (a tf.function called inside the tape's function, tf.switch_case, or "
        "another functional op) while an AssignAwareTape is open around it: the new "
        "version cannot leave that body. Write in the tape's own function, in "
        "tf.cond branches or tf.while_loop bodies, which the tape follows, or open "
        "the tape inside the body."
    )


def refuse_unordered_graph(handles: Sequence[Any], op_name: str) -> None:
    """Refuses a write to a floating-point variable built, while a tape is open
    in this thread (an AssignAwareTape, or versions held for a followed plain
    recorder), in a graph with no automatic control dependencies: a TF1 graph
    (its cond and loop bodies, TF1 control flow included) or a
    ``tf.compat.v1.wrap_function``. There ops run in no build order and a
    write nothing depends on is pruned, while versions assume build order is
    run order (which a ``tf.function``'s automatic control dependencies give,
    in its cond and loop bodies too): a gradient, even a value, could be
    silently wrong. Raised before anything is written or noted. A write while
    a variable is created (its initializer) is creation, not refused."""
    creating: int = getattr(_tls, "creating", 0)
    if creating or not getattr(_tls, "scopes", None) or executing_eagerly():
        return
    graph: Any = ops.get_default_graph()
    while graph is not None:
        # A graph staged inside a function being traced (AutoGraph traces a
        # loop body once in a throwaway FuncGraph, with no automatic control
        # dependencies, whose ops never run) is that function's business.
        if getattr(graph, "_add_control_dependencies", False):
            return
        graph = getattr(graph, "outer_graph", None)
    for handle in handles:
        dtype = _resource_dtype(handle)
        if dtype is not None and not (dtype.is_floating or dtype.is_complex):
            continue  # not differentiable: plain TensorFlow, as everywhere
        raise GraphWriteOrderError(
            f"{op_name} to variable {_resource_name(handle)!r} in a TF1 graph / wrap_function while an "
            "AssignAwareTape is open in this thread: a TF1 graph / wrap_function has no automatic "
            "control dependencies, so the order of writes is not known when the graph is built "
            "(TensorFlow may run them in any order, or prune a write nothing depends on), and the "
            "tape's versions could be silently wrong. Build the program in a tf.function (with the "
            "tape inside it, or around its call), or make the write outside every tape."
        )


def _resource_dtype(handle: Any) -> Any:
    """The dtype of the variable a resource handle names, or None if unknown."""
    var = _scope_owner(handle)
    if var is not None:
        return var.dtype
    try:
        data = resource_variable_ops.get_eager_safe_handle_data(handle)
    except (TypeError, ValueError, AttributeError):
        return None
    if not data.is_set or not data.shape_and_type:
        return None
    return dtypes.as_dtype(data.shape_and_type[0].dtype)


def _resource_name(handle: Any) -> str:
    """A name for the variable behind a resource handle, for a message."""
    var = _scope_owner(handle)
    if var is not None:
        return str(var.name)
    op = getattr(handle, "op", None)
    if op is not None and op.type == "VarHandleOp":
        name: str = op.get_attr("shared_name").decode() or op.name
        return name
    return str(getattr(op, "name", "a variable"))


def _scope_owner(handle: Any) -> Optional[Any]:
    """The variable a handle names: its own (eager) handle, or a version or
    handle served by a scope of this thread."""
    var = variable_of_handle(handle)
    if var is not None:
        return var
    for scope in getattr(_tls, "scopes", {}).values():
        var = scope.owners.get(id(handle))
        if var is not None:
            return var
    return None


def note_handle(inst: Any, value: Any) -> None:
    """A variable's handle was set: noted, so that a write through a handle
    fetched before a tape opened can name its variable (``owner``)."""
    if type(inst) is _UNREAD_VARIABLE and not _all_scopes:
        # What ``assign`` returns, given its variable's own handle outside
        # every tape: the variable names it already.
        return
    if isinstance(value, ops.EagerTensor):
        known = _by_handle.get(id(value))
        # An ``_UnreadVariable`` (what ``assign`` returns) is given its
        # variable's handle: the variable stays its owner.
        if known is None or known.__dict__.get("_handle") is not value:
            _by_handle[id(value)] = inst


def constructed(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> None:
    """``ResourceVariable.__init__`` and ``UninitializedVariable.__init__``,
    which set ``_handle``: noted while no descriptor is there to see it (a
    variable of another class, made outside every tape, is named only once
    a tape has read it)."""
    # Its initializing write, in a graph, is creation: not refused as a write
    # in a graph with no automatic control dependencies (``refuse_unordered_graph``).
    _tls.creating = getattr(_tls, "creating", 0) + 1
    try:
        wrapped(*args, **kwargs)
    finally:
        _tls.creating -= 1
    handle = instance.__dict__.get("_handle")
    if handle is not None:
        note_handle(instance, handle)
        # Its initialization went through the write patches (which could not
        # name it yet) as a write: for a closed tape it is creation, not a
        # write made while it was closed (its first read would be cut).
        for r in _closed_records() if _closed_refs else ():
            r.written_while_closed.pop(id(handle), None)


def _no_handle(inst: Any) -> AttributeError:
    """Python's own error for the missing attribute, as without the descriptor."""
    return AttributeError(f"{type(inst).__name__!r} object has no attribute '_handle'")


def serve_handle(scope: Scope, inst: Any, d: Dict[str, Any], handle: Any = None) -> Any:
    """The handle the descriptor serves for ``inst`` (whose ``__dict__`` is
    ``d``) in ``scope``, noted: ``handle`` if given (a cond branch's version),
    else the variable's current version there. (The short paths call it with
    the scope they found.)"""
    uid: Any = d.get("_unique_id")
    if handle is None:
        handle = scope.current.get(uid)
        if handle is None:
            handle = d.get("_handle")
            if handle is None:
                raise _no_handle(inst)
            if scope.dirty and id(handle) in scope.dirty:
                return cut_on_first_read(scope, inst, handle)
            if scope.unnamed:
                refuse_unnamed(scope, inst, handle)
    # Every handle served is noted, not only the first: a kept ``assign``
    # result serves an older version of the same variable, and the
    # other-thread check names writes by handle.
    scope.owners[id(handle)] = inst
    scope.seen.add(uid)
    return handle


class HandleDescriptor:
    """``BaseResourceVariable._handle`` while some scope is open: the current version.

    TensorFlow's C++ code looks the attribute up too (the eager fast path's
    ``ReadVariableOp``, the tapes' ``WatchVariable``), and does not expect
    it to fail: an exception raised here from there kills the process. So
    nothing here raises but Python's own error for a variable with no
    handle (as without the descriptor): any other error (a refused read, an
    interrupt) is deferred (``defer``), and the variable is served a handle
    that no read can use, so that the read fails in TensorFlow and the
    deferred error is raised at the next Python-level step.
    """

    def __get__(self, inst: Any, owner: Any = None) -> Any:
        # Every read asks this two or three times (TensorFlow fetches
        # ``v.handle`` that often, and once more for each tape watching).
        if inst is None:
            return self
        d = inst.__dict__
        try:
            scopes = getattr(_tls, "scopes", None)
            if scopes:
                ctx = _context._context
                if ctx is not None and ctx._thread_local_data.is_eager:
                    scope = scopes.get(None)
                    if scope is not None:
                        return serve_handle(scope, inst, d)
                else:
                    scope = _enclosing_scope(scopes)
                    if scope is not None:
                        branches = getattr(_tls, "branches", None)
                        branch = branches.get(ops.get_default_graph()) if branches else None
                        # Inside a cond branch that wrote the variable: its branch version.
                        return serve_handle(
                            scope, inst, d, None if branch is None else branch.version_of_uid(d.get("_unique_id"))
                        )
            return d["_handle"]
        except BaseException as error:  # noqa: B036 - an interrupt too: see the class docstring
            if "_handle" not in d:
                raise _no_handle(inst) from None
            return defer(error)

    def __set__(self, inst: Any, value: Any) -> None:
        if type(inst) is _UNREAD_VARIABLE and isinstance(value, ops.EagerTensor):
            # What ``assign`` returns inside a tape is given the version being
            # read: it keeps its variable's own handle instead, as in plain
            # TensorFlow, and is served the current version through this
            # descriptor while a tape is open (it shares the unique id). Kept
            # after the tape, it would otherwise credit the old version.
            made = _eager_versions.get(id(value))
            if made is not None and made[0]() is value:
                value = canonical_handle(made[1])
        inst.__dict__["_handle"] = value
        note_handle(inst, value)

    def __delete__(self, inst: Any) -> None:
        del inst.__dict__["_handle"]


# The shared name of the resource behind the handle ``defer`` serves: a
# resource never created, so that any read through it fails in TensorFlow
# (with this name in the message, where the deferred error was not raised).
POISON_NAME = "assigntape_refused_read_see_the_UntrackedWriteError_raised_before"


def defer(error: BaseException) -> Any:
    """Keeps ``error``, raised where TensorFlow's C++ code may be the caller,
    for this thread's next Python-level step (``raise_deferred``), and returns
    the handle to serve meanwhile: one no read can use, so that the read
    fails in TensorFlow, cleanly, and its error is replaced by ``error``
    (``not_ok_status``). A first error deferred is kept over later ones."""
    if getattr(_tls, "deferred", None) is None:
        _tls.deferred = error
    try:
        with ops.init_scope():
            return gen_resource_variable_ops.var_handle_op(
                dtype=dtypes.float32, shape=[], shared_name=POISON_NAME, container=""
            )
    except BaseException:  # noqa: B036 - no handle to serve: the variable's own, the error still deferred
        return _no_poison


def _no_poison() -> None:
    """What ``defer`` returns if it cannot make a handle: nothing a read can
    use either (C++'s read refuses anything but a tensor)."""


def take_deferred() -> Optional[BaseException]:
    """The error ``defer`` kept in this thread, if any, forgotten here."""
    error = getattr(_tls, "deferred", None)
    if error is not None:
        _tls.deferred = None
    return error


def raise_deferred() -> None:
    """Raises the error ``defer`` kept in this thread, if any."""
    error = take_deferred()
    if error is not None:
        raise error


def not_ok_status(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """``ops.raise_from_not_ok_status``, which every generated op wrapper
    calls, in Python, when its op failed in C++: a read through the handle
    ``defer`` served has failed, and the error deferred is the one to raise."""
    error = take_deferred()
    if error is not None:
        raise error.with_traceback(None) from None
    return wrapped(*args, **kwargs)


_READING = HandleDescriptor()
_signals.called_from_c(HandleDescriptor.__get__.__code__)  # no signal handler raises in it
served.append((_BASE_VARIABLE, "_handle", _READING, None))


def _of_own_handle(name: str, original: Any) -> property:
    """``BaseResourceVariable.<name>`` (``op``, ``graph``, ``device``), which
    TensorFlow derives from ``v.handle``, taken from the variable's own handle
    while versions are served: a variable is the same variable after a write.
    Through a version, a variable written in a ``tf.function`` would have an
    ``op`` (the version's identity) where TensorFlow raises AttributeError
    (an eager handle has none), and slot lookups keyed by it
    (``tf.compat.v1.train``'s ``_var_key``) would not find the slots made
    for the variable."""

    def get(self: Any) -> Any:
        own = self.__dict__.get("_handle")
        if own is None:  # a wrapper with no handle of its own: TensorFlow's way
            return original.fget(self)
        return getattr(own, name)

    return property(get, original.fset, original.fdel, original.__doc__)


for _name in ("op", "graph", "device"):
    _original = _BASE_VARIABLE.__dict__[_name]
    served.append((_BASE_VARIABLE, _name, _of_own_handle(_name, _original), _original))
_UNREAD_VARIABLE = resource_variable_ops._UnreadVariable


def canonical_handle(var: Any) -> Any:
    """The variable's own handle, whatever version is current (``var`` as
    ``resolve`` returns it)."""
    return var.__dict__["_handle"]


def watched_in_order(found: Sequence[Any]) -> Tuple[Any, ...]:
    """What a tape's ``watched_variables()`` lists, from TensorFlow's own
    answer ``found``: each variable once, however many of its versions were
    read, in TensorFlow's order. TensorFlow's tape keeps the variables in a
    set ordered by the id of the handle each was watched through: with no
    writes, the variable's own handle (made when it was created), but a
    version's handle is made when it is written, so after writes the order
    would follow the writes. Ordered by the variables' own handles instead,
    as with no writes (code zips the list with another: TensorFlow
    Probability's minimize carries it through a ``tf.cond``). A wrapper
    TensorFlow lists (a ``MirroredVariable``, watched through its component's
    handle) is ordered by the own handle of the variable it stands for here
    (``resolve``: in a replica, that replica's component), as TensorFlow's
    order would be with no writes."""
    unique: Dict[Any, Any] = {}
    for var in found:
        unique.setdefault(getattr(var, "_unique_id", None) or id(var), var)
    listed = tuple(unique.values())
    ids: List[Any] = [getattr(getattr(resolve(var), "__dict__", {}).get("_handle"), "_id", None) for var in listed]
    if None in ids:
        return listed  # (a variable with no handle of its own: TensorFlow's order kept)
    order: List[int] = sorted(range(len(listed)), key=ids.__getitem__)
    return tuple(listed[i] for i in order)


_RESOURCE_VARIABLE = resource_variable_ops.ResourceVariable

# Where wrappers keep the variable they delegate to: Keras 3's ``Variable``
# (``_value``), tf_keras mixed precision's ``AutoCastVariable`` (``_variable``),
# and tf.distribute's ``AggregatingVariable`` (``_v``; parameter-server and
# central-storage strategies). Read from the instance's own ``__dict__``: their
# ``__getattr__`` would delegate the lookup itself.
_WRAPPED_IN = ("_value", "_variable", "_v")


def resolve(x: Any) -> Optional[Any]:
    """The ``tf.Variable`` with a handle of its own that ``x`` stands for: ``x``
    itself, or the variable a wrapper delegates to (for a ``MirroredVariable``
    or ``SyncOnReadVariable``, the component of the current replica, or the
    primary one in cross-replica context), else None (a tensor)."""
    if type(x) is _RESOURCE_VARIABLE and "_handle" in x.__dict__:  # the usual case, without isinstance
        return x
    for _ in range(8):  # wrappers of wrappers, never a cycle
        attributes = getattr(x, "__dict__", None)
        if attributes is None:
            return None
        if "_handle" in attributes and isinstance(x, _BASE_VARIABLE):
            return x
        component = getattr(type(x), "_get_on_device_or_primary", None)
        if component is not None:
            x = x._get_on_device_or_primary()
            continue
        inner = next((attributes[a] for a in _WRAPPED_IN if a in attributes), None)
        if inner is None and isinstance(x, _BASE_VARIABLE):
            # A BaseResourceVariable subclass with no handle of its own that
            # keeps the variable it delegates to under another name.
            inner = _delegate(attributes)
        x = inner
    return None


def _delegate(attributes: Dict[str, Any]) -> Optional[Any]:
    """The one ``BaseResourceVariable`` among a wrapper's attributes, which
    it must be delegating to; None if there is none, or more than one (no
    way to tell which it stands for)."""
    found = [value for value in attributes.values() if isinstance(value, _BASE_VARIABLE)]
    return found[0] if len(found) == 1 else None


def gradient_variable(x: Any) -> Optional[Any]:
    """``resolve`` for a source or target of ``gradient``, which refuses a
    ``ShardedVariable`` (a parameter-server variable split in shards) with the
    fix, where TensorFlow's own tapes fail with an AttributeError."""
    var = resolve(x)
    if var is not None:
        return var
    if isinstance(x, ShardedVariable):
        raise NotAVariableError(
            f"{x.name!r} is a ShardedVariable (a variable split across parameter servers), "
            "which no gradient tape takes as a whole: give its shards instead "
            "(v.variables), as sources or targets, and concatenate their gradients."
        )
    if isinstance(x, _BASE_VARIABLE):
        raise NotAVariableError(
            f"{getattr(x, 'name', type(x).__name__)!r} ({type(x).__name__}) stands for no single "
            "tf.Variable the tape can find: it has no handle of its own and does not hold exactly "
            "one variable to delegate to. Give the tape the variable it wraps instead."
        )
    return var


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
