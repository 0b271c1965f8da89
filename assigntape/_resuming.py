"""Closed tapes, and recorders entered again that go on from their versions.

A tape that closes and may be entered again (ours, or a plain tape or an
accumulator that held versions) is noted as closed (``closed_tapes``); every
write made while it is closed is noted on its record. When it is entered
again it goes on from its versions, lazily: at each variable's first read
(``go_on_from``, ``cut_on_first_read``), which the handle descriptor
(``_serving``) calls.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from assigntape import _leases
from assigntape._record import CLOSED_WRITE, Record, WriteRecord
from assigntape._recorders import among, holding
from assigntape._registry import _list, _scopes, _tls, current_key
from assigntape._tf import (
    ops,
    record,
    resource_variable_ops,
)
from assigntape._versions import Scope, _by_handle, _drop, canonical_handle, new_version, variable_of_handle
from assigntape._versions import _closed_records as _closed_records  # (re-exported)
from assigntape._versions import note_write_while_closed as note_write_while_closed  # (re-exported)


def held_by(holder: Any, versions: Optional[Dict[str, Any]] = None) -> Dict[str, Tuple[Any, Any]]:
    """The versions ``holder`` (a plain tape or forward accumulator closing)
    holds in the current graph: unique id -> (handle, variable).
    ``versions``: ``versions_for(scope, holder)`` here, if already taken."""
    scope = _scopes().get(current_key())
    if scope is None or scope.records or not among(scope.holders, holder):
        return {}
    return owned(versions_for(scope, holder) if versions is None else versions)


def versions_for(scope: Scope, recorder: Any = None, unseen: Optional[List[Any]] = None) -> Dict[str, Any]:
    """The versions current in ``scope`` for ``recorder`` (a tape, or a
    record; None: for every tape): ``scope.current``, and the versions
    ``recorder``, entered again, goes on from, which become current at their
    variables' first read (``go_on_from``): until then, for the other tapes,
    the variable's own handle is its version. A variable written while it
    was closed and not read since gets a version it did not see made, kept
    by the scope (the store's queries make nothing: this does). In the same
    pass over ``scope.dirty``, ``unseen`` (if given) gets what
    ``unseen_writes`` would give, for ``scope`` the current graph's."""
    found = dict(scope.current)
    if recorder is None:
        return found
    for handle, var, _, knowing in scope.resumed.values():
        if among(knowing, recorder):
            found.setdefault(var._unique_id, handle)
    for own, closed in scope.dirty.values():
        if not among(closed, recorder):
            continue
        var = variable_of_handle(own)
        if unseen is not None and (var is None or var._unique_id not in scope.current):
            unseen.append(own)
        if var is not None and var._unique_id not in found:
            new = found[var._unique_id] = unseen_version(scope, own)
            scope.keep(var, new)
    return found


def unseen_writes(recorder: Any, ids: bool = False) -> List[Any]:
    """The own handles (``ids``: their ids) of the variables written while
    ``recorder`` (a tape entered again, or its record) was closed and not read
    since (``Scope.dirty``, for a variable not current here: a variable written
    through a handle no read served may be current with its entry left): a
    write it did not see, also when it is entered once more."""
    scope = _scopes().get(current_key())
    if scope is None:
        return []
    return [id(own) if ids else own for own, unseen in _closed_writes(scope, recorder) if unseen]


def _closed_writes(scope: Scope, recorder: Any) -> Iterator[Tuple[Any, bool]]:
    """Each variable's own handle in ``scope.dirty`` written while
    ``recorder`` was closed, with whether it is unseen (``unseen_writes``)."""
    for own, closed in scope.dirty.values():
        if among(closed, recorder):
            var = variable_of_handle(own)
            yield own, var is None or var._unique_id not in scope.current


def note_closed_writes(scope: Scope, record: Record) -> None:
    """A tape of ours (``record``) closes in ``scope``: the writes made while
    it was closed before and not read since it was entered again stay, for
    it, writes it did not see when it is entered once more (the scope forgets
    its note of them when its last tape closes): noted on its record, those
    still unseen in ``unseen_at_exit``. One pass over ``scope.dirty`` where
    ``scope`` is the current graph's (``unseen_writes`` asks that one).
    (What it read is its own watched variables, given at its re-entry: not
    ``note_read``'s ``scope.seen``, which holds what the other tapes of the
    scope read too; but for an ``assigntape.ForwardAccumulator``'s internal
    tape, which keeps no history: its reads are the scope's.)"""
    if not record.keeps_history:
        note_read(scope, record)
    here = _scopes().get(current_key()) is scope
    unseen_ids = set() if here else set(unseen_writes(record, ids=True))
    for own, unseen in _closed_writes(scope, record):
        record.written_while_closed[id(own)] = own
        if unseen and here:
            unseen_ids.add(id(own))
    record.unseen_at_exit = unseen_ids


def note_read(scope: Optional[Scope], record: Record) -> None:
    """A recorder (``record``: its record, any kind) that may be entered again
    closes in ``scope``: the variables read or written there (``seen``, a set
    of unique ids, however many versions were read) are marked seen again at
    its re-entry (``enter_again``), so that another thread's write to one of
    them is refused as in its first entry (rule 9), whatever the recorder's
    kind. (Not its watched variables: a plain tape's list grows with every
    version read, a TensorFlow accumulator's is not to be asked.)"""
    if scope is not None:
        record.read_ids |= scope.seen


def resume_holder(holder: Any, held: Dict[str, Tuple[Any, Any]], written: Dict[int, Any], resuming: Record) -> None:
    """A plain tape or forward accumulator that held versions (``held_by``),
    or that exited where a tape of ours was open (``owned``: the versions
    current then), is entered again in the same graph (``resuming`` is its
    record, which pauses it: ``_recorders.record_for``; ``written`` the
    writes made while it was closed): it goes on from them as a tape of ours
    entered again does (``enter_again``), also where a tape of ours opened
    since is open (which goes on from its own)."""
    key = current_key()
    scope = _scopes().get(key)
    if scope is None and (held or written):
        scope = _scopes()[key] = Scope(key)
        _list(scope)
        scope.holders = [holding(holder)]
    if scope is not None:
        # (What it read before: ``note_read``, at its exit.)
        enter_again(scope, resuming, held, written)


def enter_again(
    scope: Scope,
    record: Record,
    known: Dict[str, Tuple[Any, Any]],
    written: Dict[int, Any],
    watched: Iterable[Any] = (),
) -> None:
    """The recorder protocol's "go on from my versions", for every kind of
    recorder entered again in ``scope`` (``record``: its record, ``ours`` or
    not): ``known`` (unique id -> (version, variable)) the latest versions it
    knows, ``written`` (id(own handle) -> own handle; not changed here) the
    variables written while it was closed, ``watched`` the variables it read
    before (another thread must not write them behind it, nor the ones it
    goes on from: ``scope.seen``).

    Lazily, the same for every kind (rule 7: for it, a write made while it
    was closed is a write under ``stop_recording``):

    * a variable it knows, not written meanwhile: it goes on from its
      version, current at the variable's first read here (``go_on_from``);
    * a variable written while it was closed and not current here: at its
      first read here a new version, with no gradient path for it
      (``cut_on_first_read``; a tape of ours notes the write from the version
      it knew, as it does if it names the version before that read:
      ``settle``). An unidentifiable variable (``variable_of_handle`` gives
      None: made while no tape was about) is cut there too, by its handle.
      One it never knew is not noted as seen: no read of it is behind the
      recorder, as for any variable it has not read;
    * a variable current here (written by a tape open while it was closed):
      that version, which a tape of ours notes as a write it did not see."""
    scope.seen |= record.read_ids
    for var in watched:
        uid = getattr(var, "_unique_id", None)
        if uid is not None:
            scope.seen.add(uid)
    remaining = dict(written)
    resumed = []
    for uid, (mine, var) in known.items():
        own = canonical_handle(var)
        cut = remaining.pop(id(own), None) is not None
        current = scope.current.get(uid)
        if current is not None:
            if current is not mine and record.ours:
                record.note_write(var, mine, current, CLOSED_WRITE)
        elif cut:
            scope.dirty.setdefault(id(own), (own, []))[1].append(record)
            scope.seen.add(uid)
            # Its handle names it from now on (one made before the patches
            # were installed did not: ``settle`` and the other passes over
            # ``scope.dirty`` would skip it).
            if variable_of_handle(own) is None:
                _by_handle[id(own)] = var
        else:
            resumed.append((var, own, mine))
    go_on_from(scope, resumed, record)
    for uid, current in scope.current.items():
        var = scope.owners.get(id(current))
        if uid in known or var is None:
            continue
        own = canonical_handle(var)
        remaining.pop(id(own), None)
        if record.ours and current is not own:
            record.note_write(var, own, current, CLOSED_WRITE)
    for key, own in remaining.items():
        scope.dirty.setdefault(key, (own, []))[1].append(record)


def go_on_from(scope: Scope, resumed: Sequence[Tuple[Any, Any, Any]], resuming: Record) -> None:
    """Each ``(variable, its own handle, version)`` of ``resumed``: the
    tape of ``resuming``, entered again, goes on from that version. The
    tapes opened since it was closed know the variable by its own handle
    (none open then and still is: the scope would have kept its versions),
    so at its first read here the version becomes current, recorded as an
    identity of that handle on every recorder but those that know it and
    those that did not see it made (``cut_on_first_read``). Another tape
    entered again before may go on from another version of the variable:
    one a tape knows (not made by ``settle``) is kept, and for the others it
    is a write they did not see (those that named the one ``settle`` made
    name this one instead). Noted as seen now: another thread must not
    write the variable behind the tape."""
    for var, own, handle in resumed:
        closed_at_write = scope.dirty.setdefault(id(own), (own, []))[1]
        entry = scope.resumed.get(id(own))
        if entry is None or entry[2]:
            # The one ``settle`` made yields: for the tapes that named it, this
            # one is the version they did not see made (their records name it
            # at the first read: ``cut_on_first_read``; nothing of another
            # tape's record changes here, in this tape's entry).
            knowing = [resuming] if entry is None else [*entry[3], resuming]
            scope.resumed[id(own)] = (handle, var, False, knowing)
            scope.keep(var, handle)
        elif entry[0] is handle:
            entry[3].append(resuming)
        else:
            closed_at_write.append(resuming)
        scope.seen.add(var._unique_id)


def settle(scope: Scope, record: Record) -> None:
    """A tape of ours (``record``) entered again names its versions (it is
    asked ``versions``, ``history``, ``explain`` or a variable target, or it
    exits) before the first read of a variable it knew that was written
    while it was closed: the version it did not see made is made now, the
    one that read will make current (``scope.resumed``; shared with a tape
    that goes on from a version of the variable), and noted on its record
    from the version it knew, as that read would (``cut_on_first_read``)."""
    if not scope.dirty or not record.keeps_history:
        return
    for key, (own, closed_at_write) in list(scope.dirty.items()):
        if all(r is not record for r in closed_at_write):
            continue
        var = variable_of_handle(own)
        if var is None or var._unique_id in scope.current:
            continue
        mine = record.latest_of(var._unique_id, None)
        if mine is None:
            continue  # a variable it never knew: named at its first read
        # (Each step can run again: an interrupted exit runs it once more.)
        entry = scope.resumed.get(key)
        if entry is None:
            new = unseen_version(scope, own)
            scope.keep(var, new)
            entry = scope.resumed[key] = (new, var, True, [])
        if all(r is not record for r in entry[3]):
            entry[3].append(record)
        if mine is not entry[0]:
            record.note_write(var, mine, entry[0], CLOSED_WRITE)
        closed_at_write[:] = [r for r in closed_at_write if r is not record]


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
        if among(scope.holders, instance):
            scope.holders = [h for h in scope.holders if not h.stands_for(instance)]
        # (Also one whose drop was interrupted: it is finished now.)
        if not scope.holders and not scope.records:
            _drop(scope)


# The records of tapes that are closed (exited, and not yet done) and may be
# entered again (AssignAwareTapes, and plain tapes that held versions).
# Every write made meanwhile, by any path, is noted on each of them: on
# re-entry such a write is, for that tape, a new version with no gradient path,
# as a write under stop_recording is (see ``AssignAwareTape.__enter__``).
# They are ``_leases.closed``: while any is there, the patches are needed.
# (Noting a write on them is the version store's: ``Scope.advance``.)
closed_tapes = _leases.closed
_closed_refs = _leases.closed_refs


def forget_closed_writes(recorder: Any) -> None:
    """``tape.reset()`` (``recorder``: a tape of ours' record, or a plain tape
    entered again): writes made while the tape was closed and not read yet
    (``Scope.dirty``) now come before the tape's start, so for it they are no
    longer writes with no gradient path: their first read is an identity for
    it, as for the tapes opened since."""
    for scope in _scopes().values():
        for _, closed_at_write in scope.dirty.values():
            closed_at_write[:] = [r for r in closed_at_write if not r.stands_for(recorder)]


def first_touch(scope: Scope, var: Any) -> Any:
    """The version a write to ``var`` in ``scope`` replaces. Where no read
    was served here since a tape was entered again (the write made in a
    ``tf.data`` or ``tf.function`` graph, through a handle captured there),
    the version the scope goes on from lazily becomes current first, as that
    read would have made it (``cut_on_first_read``): else the pending entry
    outlived the write, and the next read made the older version current
    again, over the write's (a silently wrong gradient)."""
    if scope.dirty and var._unique_id not in scope.current:
        own = canonical_handle(var)
        if id(own) in scope.dirty:
            return cut_on_first_read(scope, var, own)
    return scope.current_version(var)


def cut_on_first_read(scope: "Scope", var: Any, own: Any) -> Any:
    """The first read, in ``scope``, of a variable written while a tape of it was
    closed and not otherwise known to that tape: a new version, with no gradient
    path for the tapes that were closed at the write, and an identity for the
    tapes opened since (for them the write came before they started)."""
    closed_at_write = scope.dirty.pop(id(own))[1]
    # Or the version tapes entered again go on from (``go_on_from``).
    entry = scope.resumed.pop(id(own), None)
    new, knowing = (unseen_version(scope, own), []) if entry is None else (entry[0], entry[3])
    # Record the identity on every recording tape except those that were
    # closed (those of ours here, or plain ones entered again) and those that
    # know the version.
    # (A record's ``paired`` recorder, assigntape.ForwardAccumulator's for its
    # internal tape, is paused with it: set aside, in its nesting order.)
    paused: List[Any] = []
    for r in [*closed_at_write, *knowing]:
        for q in (r, r.paired):
            if q is not None and q.recording() and all(q is not p for p in paused):
                paused.append(q)
    for r in paused:
        r.pause()
    try:
        # As a read would: watched, so that the tapes opened since record it.
        # (In the scope's graph, as a read at the recorder's entry: the first
        # read may be in a cond branch or loop body, whose tensors the rest
        # of the function cannot use.)
        with in_graph_of(scope):
            resource_variable_ops.variable_accessed(var)
            record.record_operation("Identity", [new], [own], lambda g: [g], forward_function=lambda t: [t])
    finally:
        for r in reversed(paused):
            r.resume()
    scope.adopt(var, new)
    # A tape that named a version ``settle`` made, which yielded to this one
    # (``go_on_from``), names this one.
    for r in knowing:
        r.replace_latest(var, new)
    # Each notes it from the version it knew (a tape entered again: the one
    # it goes on from; the tapes opened since: the variable's own handle).
    uid = var._unique_id
    for r in scope.records:
        if all(r is not k for k in knowing):
            old = r.latest_of(uid, own)
            r.note_write(var, old, new, CLOSED_WRITE if r in closed_at_write else WriteRecord("Identity"))
    return new


def latest_version(scope: Scope, var: Any, recorder: Any, known: Any) -> Any:
    """The recorder protocol's "my current version of ``var``", for
    ``recorder`` (a record, or a plain tape) open in ``scope``, where the
    variable is not current (not read nor written in the scope since the
    recorder was entered again): the version it goes on from (``go_on_from``),
    or, written while it was closed, a version it did not see made (no
    gradient path: ``dirty``); else ``known``, the latest version the
    recorder itself knows (a tape of ours: its record's; a plain tape: the
    variable's own handle). Every kind of recorder asks this, a variable
    target of ``gradient`` or ``jacobian``. (The two checks' order does not
    matter: ``go_on_from`` puts a recorder among a version's knowing ones or
    among the write's closed ones, never both. Where the answers of the two
    kinds used to differ is ``known``: a tape of ours falls back to what its
    record saw (its start version), a plain tape, which keeps no record, to
    the variable's own handle; either is the version current when it was
    entered, rule 6b.)"""
    own = canonical_handle(var)
    entry = scope.resumed.get(id(own))
    if entry is not None and among(entry[3], recorder):
        return entry[0]
    dirty = scope.dirty.get(id(own))
    if dirty is not None and among(dirty[1], recorder):
        return unseen_version(scope, own)
    return known


def in_graph_of(scope: Scope) -> ContextManager[Any]:
    """Builds in ``scope``'s graph (the graph of the tape's scope, around any
    cond branch or loop body being built), with none of the control
    dependencies in force where this is called: what is built is what a read
    at the recorder's entry would have built there, which every branch, body
    and the code after them can use."""
    if scope.key is None or ops.get_default_graph() is scope.key:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(scope.key.as_default())
    stack.enter_context(ops.control_dependencies(None))
    return stack


def unseen_version(scope: Scope, own: Any) -> Any:
    """A version of the variable whose own handle is ``own``, made by a write
    a recorder did not see (made while it was closed): no gradient path, and
    made in ``scope``'s graph (``in_graph_of``)."""
    with in_graph_of(scope):
        return new_version(own, None)
