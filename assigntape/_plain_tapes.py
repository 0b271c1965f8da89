"""Plain ``tf.GradientTape``s used beside an ``AssignAwareTape``.

A write made while an ``AssignAwareTape`` is open is recorded on every tape
that is recording, plain ones included, so a plain tape can follow the chain
of versions too. It must then name variables the way ``AssignAwareTape`` does,
or its answer would depend on whether the other tape is still open (while it
is, ``v.handle`` is the latest version; after, the variable's own handle):
a variable source means the version current when the plain tape was entered,
a variable target the version current when it was exited (the latest one
while it is still open). This module follows its entry and exit;
``_plain_gradients`` answers its questions (gradient, jacobian, jvp).

The plain tape keeps both snapshots on itself, and holds the patches
(``lease``) until it is done, so that a gradient asked after the other tape
closed still maps them. A plain tape entered before any ``AssignAwareTape``
and still open when one closes gets the versions current then as its latest
(``note_closing``): it recorded the writes made meanwhile.

Such a plain tape, and a ``ForwardAccumulator`` in the same place, also holds
the versions (``_versions.close_scope``): until it closes, reads and writes
go on through them, as if the ``AssignAwareTape`` were still open, so that
what it reads after the other tape closed is the latest version, not the
variable's own handle (which it would take for the value from before).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from assigntape import (
    _branch_writes,
    _branches,
    _forks,
    _leases,
    _recorders,
    _registry,
    _resuming,
    _versions,
)
from assigntape._errors import ControlFlowWriteError
from assigntape._record import Record
from assigntape._tf import ControlFlowFuncGraph, backprop
from assigntape._wrapping import like

__all__ = [
    "GRADIENT_TAPE",
    "accumulator_enter",
    "accumulator_enter_method",
    "accumulator_exit",
    "accumulator_exit_method",
    "enter_method",
    "entered",
    "exit_method",
    "exited",
    "lease",
    "note_closing",
    "open_anywhere",
    "refuse_recorders_outside_body",
    "reset",
]

_START = "_assigntape_start"
_END = "_assigntape_end"
_LATEST = "_assigntape_latest"
# (the graph, the versions it held there, a Record that notes the writes
# made while it is closed), while a recorder that held versions is closed.
_HELD = "_assigntape_held"
# The graph (None: eagerly) an accumulator was made in.
_MADE_IN = "_assigntape_made_in"
# The variables rebase_for_recorder read on a tape that does not watch
# accessed variables (unique ids).
_REBASED = "_assigntape_rebased"

# The plain tapes open in this thread (weak references), innermost last.


# TensorFlow's own class, kept at import (``assigntape.testing.swap_tape``
# may put another in its place): the followers go on it (``_patches``).
GRADIENT_TAPE = backprop.GradientTape


def _is_plain(instance: Any) -> bool:
    # AssignAwareTape marks itself (a class attribute) rather than being
    # imported here: it imports this module. TensorFlow's own class, every
    # Keras train step's, is told without the lookup, which misses (getattr
    # then catches an AttributeError).
    return type(instance) is GRADIENT_TAPE or not getattr(instance, "_assigntape_aware", False)


def _snapshot(recorder: Any = None, unseen: Optional[List[Any]] = None) -> Optional[Dict[str, Any]]:
    """The versions current here, as a cond branch or loop body sees them
    (and, for ``recorder``, those it goes on from, entered again). ``unseen``
    (if given) gets ``_resuming.unseen_writes(recorder)``, from the same pass
    over the scope's writes where the scope is this graph's."""
    found = _branches.call_context()
    if found is None:
        return None
    scope, branch = found
    here = branch is None  # (the scope of this graph, or eager)
    snapshot = _resuming.versions_for(scope, recorder, unseen if here else None)
    if unseen is not None and not here:
        unseen.extend(_resuming.unseen_writes(recorder))
    chain = []
    while branch is not None:
        chain.append(branch)
        branch = branch.parent
    for branch in reversed(chain):
        snapshot.update(branch.versions)
    return snapshot


_open_plain = _registry.open_plain


def _quiet() -> bool:
    """No tape of ours is open in any thread, and none closed is alive (nor a
    recorder that held versions): a plain tape has no version to note, only
    that it is open (every Keras train step enters one, so this is kept short)."""
    return not _all_scopes and not _closed_records and not _forgotten


_all_scopes = _registry._all_scopes
_closed_records = _leases.closed_refs
# (In a forked child: recorders closed by another thread, refused if entered again.)
_forgotten = _forks.forgotten_refs


def enter_method(original: Callable[..., Any]) -> Callable[..., Any]:
    """What goes in place of ``GradientTape.__enter__``: TensorFlow's, then
    ``entered``. The case of every Keras train step (TensorFlow's own class,
    no tape of ours about) is written out here, in the method's one frame:
    its Python runs between TensorFlow's eager ops, where each line costs
    several times what it does in a loop of its own."""
    tls, ref, key = _registry._tls, weakref.ref, _registry.current_key

    def __enter__(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        # All or nothing: an exception from here on (a KeyboardInterrupt)
        # pops the tape TensorFlow pushed and forgets it. (One line: the
        # ``try`` line's own line event is then inside it.)
        try: return note(self, result)  # noqa: E701  # fmt: skip
        except BaseException:
            _undo_entry(self)
            raise

    def note(self: Any, result: Any) -> Any:
        if type(self) is GRADIENT_TAPE and not _all_scopes and not _closed_records and not _forgotten:
            opened = getattr(tls, "plain", None)
            (_open_plain() if opened is None else opened).append((ref(self), key()))
        else:
            entered(self)
        return result

    return like(__enter__, original, entered)


def _undo_entry(instance: Any) -> None:
    """After an interrupted ``__enter__`` of a plain tape: it is not open."""
    _forget_open(instance)
    _resuming.release_holder(instance)
    if getattr(instance, "_recording", False):
        instance._pop_tape()


def exit_method(original: Callable[..., Any]) -> Callable[..., Any]:
    """What goes in place of ``GradientTape.__exit__``: TensorFlow's, then
    ``exited``, with the same case written out as in ``enter_method``."""
    tls = _registry._tls

    def __exit__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Exiting always finishes: after an exception at any point of it (a
        # KeyboardInterrupt), TensorFlow's exit and ``exited`` run again
        # (each can), then it goes on. (One line: see ``enter_method``.)
        try: return close(self, args, kwargs)  # noqa: E701  # fmt: skip
        except BaseException:
            if getattr(self, "_recording", False):
                self._pop_tape()
            exited(self)
            raise

    def close(self: Any, args: Any, kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if type(self) is GRADIENT_TAPE and not _all_scopes and not _closed_records:
            opened = getattr(tls, "plain", None)
            if opened and opened[-1][0]() is self:
                del opened[-1]  # the innermost: the case of a with block
            elif opened:
                _forget_open(self)
        else:
            exited(self)
        return result

    return like(__exit__, original, exited)


def entered(instance: Any) -> None:
    """After ``GradientTape.__enter__``: a plain tape notes the versions current now."""
    if not _is_plain(instance):
        return  # its own __enter__ did the work
    if _quiet():
        _open_plain().append((weakref.ref(instance), _registry.current_key()))
        return
    # All or nothing (``enter_method`` pops the tape and forgets it open).
    before = _entry_state(instance)
    try: _entered_beside(instance)  # noqa: E701  # fmt: skip
    except BaseException:
        _undo_entered(instance, before)
        raise


def _entered_beside(instance: Any) -> None:
    """``entered``, where a tape of ours is (or was) about."""
    _opened(instance)
    if not hasattr(instance, _START):
        snapshot = _snapshot(instance)
        if snapshot is not None:
            setattr(instance, _START, snapshot)
            lease(instance)
    # Inside a compiled body, after the snapshot: see rebase_for_recorder.
    rebased = _branch_writes.rebase_for_recorder(instance)
    if rebased and not instance._watch_accessed_variables:
        # Recorded for it, but it watches only what it is told to.
        instance.__dict__[_REBASED] = set(rebased)


# What ``_opened`` and ``entered`` note on a recorder, which an interrupted
# entry puts back as they were.
_NOTES = (_HELD, _START, _REBASED)


def _entry_state(instance: Any) -> Tuple[Any, ...]:
    """What a plain tape's or accumulator's entry may change (``_opened``),
    for ``_undo_entered``: its notes, whether its record of the writes made
    while it was closed is followed, and, if it held versions (which it goes
    on from, entered again: ``_resuming.resume_holder``), this thread's scope."""
    notes = {name: instance.__dict__[name] for name in _NOTES if name in instance.__dict__}
    held = notes.get(_HELD)
    if held is None:
        return notes, False, None
    return notes, held[2] in _resuming.closed_tapes, _versions.scope_state(_registry.current_key(), True)


def _undo_entered(instance: Any, before: Tuple[Any, ...]) -> None:
    """Puts back what an interrupted entry (``_entry_state``) changed, each
    step whether or not it was reached."""
    notes, closed, scope_before = before
    _forget_open(instance)
    _resuming.release_holder(instance)  # a scope resume_holder made for it goes
    if scope_before is not None:
        scope_before[0].put_back(scope_before[1])
    for name in _NOTES:
        if name in notes:
            instance.__dict__[name] = notes[name]
        else:
            instance.__dict__.pop(name, None)
    if closed:
        _registry.hold_closed(notes[_HELD][2])


def exited(instance: Any) -> None:
    """After ``GradientTape.__exit__``: a plain tape notes the versions current now."""
    if not _is_plain(instance):
        return
    if _quiet():
        _forget_open(instance)
    else:
        unseen: List[Any] = []
        snapshot = _snapshot(instance, unseen)
        if snapshot is not None:
            setattr(instance, _END, snapshot)
            lease(instance)
        _closed(instance, snapshot, unseen)


def reset(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``GradientTape.reset``: for a plain tape, a variable source means its
    version at the reset from now on, as it would for a tape entered there."""
    result = wrapped(*args, **kwargs)
    if _is_plain(instance) and getattr(instance, "_recording", False):
        _resuming.forget_closed_writes(instance)
        snapshot = _snapshot(instance)
        if snapshot is not None:
            setattr(instance, _START, snapshot)
            lease(instance)
        elif hasattr(instance, _START):
            delattr(instance, _START)
    return result


def accumulator_enter(instance: Any) -> None:
    """After ``ForwardAccumulator.__enter__``: followed as a plain tape is, for
    ``note_closing`` (the patch is ``accumulator_enter_method``'s)."""
    # (Its first entry is its construction's: where it was made.)
    instance.__dict__.setdefault(_MADE_IN, _registry.current_key())
    _opened(instance)


def accumulator_enter_method(original: Callable[..., Any]) -> Callable[..., Any]:
    """What goes in place of ``ForwardAccumulator.__enter__``: TensorFlow's,
    then ``accumulator_enter``, all or nothing, as a plain tape's
    (``enter_method``): the ``try`` is in the method's own frame, so that no
    line runs between TensorFlow's entry and it."""

    def __enter__(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = _entry_state(self)
        result = original(self, *args, **kwargs)
        try: return _followed(accumulator_enter, self, result)  # noqa: E701  # fmt: skip
        except BaseException:
            _undo_entered(self, before)
            if getattr(self, "_recording", False):
                self._pop_accumulator()
            raise

    return like(__enter__, original, accumulator_enter)


def _followed(follower: Callable[[Any], None], instance: Any, result: Any) -> Any:
    follower(instance)
    return result


def accumulator_exit(instance: Any) -> None:
    """After ``ForwardAccumulator.__exit__``: notes the versions current now,
    which a variable given to ``jvp`` after the block means
    (``accumulator_jvp``). (The patch is ``accumulator_exit_method``'s.)"""
    # (Taking TensorFlow's accumulator off the set changes no version.) With
    # the versions it went on from and did not read again, as a plain tape's
    # exit keeps them (entered a third time, it goes on from them).
    unseen: List[Any] = []
    snapshot = _snapshot(instance, unseen)
    if snapshot is not None:
        setattr(instance, _END, snapshot)
    _closed(instance, snapshot, unseen)


def accumulator_exit_method(original: Callable[..., Any]) -> Callable[..., Any]:
    """What goes in place of ``ForwardAccumulator.__exit__``: TensorFlow's,
    then ``accumulator_exit``. Exiting always finishes, as a plain tape's
    (``exit_method``)."""

    def __exit__(self: Any, *args: Any, **kwargs: Any) -> Any:
        try: return _followed(accumulator_exit, self, original(self, *args, **kwargs))  # noqa: E701  # fmt: skip
        except BaseException:
            if getattr(self, "_recording", False):
                self._pop_accumulator()
            accumulator_exit(self)
            raise

    return like(__exit__, original, accumulator_exit)


def _opened(instance: Any) -> None:
    # The graph it is open in: only an AssignAwareTape closing in the same
    # graph (or eagerly, both eager) wrote under it.
    key = _registry.current_key()
    held = instance.__dict__.get(_HELD)
    if held is not None:
        _forks.refuse_forgotten(held[2], instance)
    _open_plain().append((weakref.ref(instance), key))
    held = instance.__dict__.pop(_HELD, None)
    if held is not None:
        held_in, versions, record = held
        _resuming.closed_tapes.discard(record)
        if not hasattr(instance, _START):
            # Entered first with no versions about: a variable source means
            # its own handle, not what it is resumed from (``enter`` would
            # otherwise take the versions current at this re-entry).
            setattr(instance, _START, {})
        if held_in is key:
            _resuming.resume_holder(instance, versions, record.written_while_closed, record)


def _forget_open(instance: Any) -> None:
    opened = _open_plain()
    for i in range(len(opened) - 1, -1, -1):
        if opened[i][0]() is instance:
            del opened[i]
            break


def open_anywhere() -> int:
    """How many plain tapes and forward accumulators are open (entered and not
    exited) in any thread."""
    return sum(ref() is not None for opened in list(_registry._plain_by_thread.values()) for ref, _ in list(opened))


def _closed(instance: Any, ends: Optional[Dict[str, Any]], unseen: List[Any]) -> None:
    """It exits: ``ends``, for a plain tape or accumulator exiting where a
    tape of ours is about, the versions current now, and ``unseen`` the
    writes it did not see (``_snapshot``: one pass over the scope's writes
    gives both, and the versions it holds)."""
    _forget_open(instance)
    held = _resuming.held_by(instance, ends)
    if held and ends is None:
        unseen = _resuming.unseen_writes(instance)
    if not held and ends is not None:
        # Exited inside a tape of ours: if entered again after that one closed,
        # it goes on from the versions it last saw, as it would had the other
        # tape stayed open (read through the variable's own handle instead,
        # a variable it wrote would lose its gradient path, and its source
        # version would not be the one read).
        held = _resuming.owned(ends)
    # It may be entered again (a persistent tape, an accumulator): it then
    # goes on from the versions it held, so note the writes made meanwhile,
    # as for a closed AssignAwareTape (``_versions.note_write_while_closed``).
    record = _recorders.record_for(instance) if held or ends is not None else None
    if record is not None:
        _resuming.note_read(_registry._scopes().get(_registry.current_key()), record)
    # What the exit changes comes last, each step of it able to run again:
    # after an exception in it (a KeyboardInterrupt), it runs once more.
    try: _let_go(instance, held, unseen, record)  # noqa: E701  # fmt: skip
    except BaseException:
        _let_go(instance, held, unseen, record)
        raise


def _let_go(instance: Any, held: Dict[str, Any], unseen: List[Any], record: Optional[Record]) -> None:
    _resuming.release_holder(instance)
    if record is not None:
        for own in unseen:
            record.written_while_closed[id(own)] = own
        setattr(instance, _HELD, (_registry.current_key(), held, record))
        _registry.hold_closed(record)
        lease(instance)


def _graphs_around(key: Any) -> List[Any]:
    """For a compiled cond branch or loop body (``key``): the graphs around
    it, up to the tf.function's own (a tape outside that sees only its call);
    else none."""
    around: List[Any] = []
    graph = key.outer_graph if isinstance(key, ControlFlowFuncGraph) else None
    while graph is not None:
        around.append(graph)
        if not isinstance(graph, ControlFlowFuncGraph):
            break
        graph = graph.outer_graph
    return around


def refuse_recorders_outside_body(scope: Any, var: Any, op_name: str) -> None:
    """A write in a compiled cond branch or loop body (``scope.key``) where an
    AssignAwareTape is or was open, with no AssignAwareTape around that body:
    a plain tape or forward accumulator recording in a graph around the body
    would see the write's version only inside it (no tape of ours carries it
    out, as ``_control_flow`` does for an outer AssignAwareTape), and later
    reads outside, or the next iteration, would credit the variable's own
    handle. Refused by name rather than answered wrong."""
    opened = _open_plain()
    around = _graphs_around(scope.key) if opened else []
    for ref, opened_in in opened if around else ():
        instance = ref()
        if instance is not None and any(opened_in is g for g in around) and getattr(instance, "_recording", False):
            kind = type(instance).__name__
            raise ControlFlowWriteError(
                f"{op_name} to variable {var.name!r} in a compiled tf.cond branch or loop body "
                f"where an AssignAwareTape is (or was) open, while a plain {kind} records around "
                "that body: the plain tape cannot follow the new version out of the body, so "
                "its gradient would be wrong. Make the outer tape an AssignAwareTape (it "
                "follows writes out of branches and loop bodies), or use Python if/for there."
            )


def note_closing() -> List[Record]:
    """An ``AssignAwareTape`` is about to close: the plain tapes still open
    in its graph keep the versions current now as their latest. Returns the
    records of the plain tapes and forward accumulators open around it, in its graph or
    around the compiled body it is in: they recorded its writes, so the
    versions must live on for them (and a later write in the body, which
    they could not follow out of it, is refused: see above)."""
    opened = _open_plain()
    if not opened:
        return []
    snapshot = _snapshot()
    if snapshot is None:
        return []
    key = _registry.current_key()
    around = _graphs_around(key)
    holders = []
    for ref, opened_in in opened:
        instance = ref()
        if instance is None:
            continue
        if opened_in is key:
            held = _recorders.holding(instance)
            if not held.forward:
                setattr(instance, _LATEST, snapshot)
                lease(instance)
            holders.append(held)
        elif any(opened_in is g for g in around):
            holders.append(_recorders.holding(instance))
    return holders


def lease(instance: Any) -> None:
    """Keeps the patches installed until ``instance`` is garbage."""
    # The patches are installed: a plain tape has versions to keep only
    # beside a tape of ours.
    _leases.take_plain(instance)
