"""A tape's record: its own account of the versions it saw.

An ``AssignAwareTape`` keeps one ``Record``. The scopes (``_versions``) keep
the records of the tapes open in them and append each write to every one;
``explain`` and ``history`` (``_diagnostics``) read them; the tape answers
``gradient`` and ``versions`` from its own. So no module below the tape
touches the tape: what they need of its TensorFlow side (is it recording,
pause it for one op) goes through the record, which holds the tape weakly
(a record lives as long as its tape, and must not keep it alive).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

__all__ = ["CLOSED_WRITE", "Record", "WriteRecord"]


class WriteRecord(NamedTuple):
    """What made a version: the op, and whether a gradient can flow through it."""

    op: str
    # The untracked-writes option made it a new version with no gradient path.
    cut: bool = False
    # False when the write ran under stop_recording: no tape recorded it.
    recorded: bool = True
    # The previous version's shape, where the variable's shape is not fully
    # defined (a write may change it): zeros for that version need it.
    old_shape: Any = None


# What made a version written while a tape was closed, as that tape sees it.
CLOSED_WRITE = WriteRecord("a write while the tape was closed", cut=True)


class Record:
    """The versions one tape saw, by variable, and what made each.

    Attributes:
      untracked_writes: the tape's option, ``"raise"`` or ``"cut"``.
      keeps_history: False for a tape nothing asks for gradients or versions
        (``assigntape.ForwardAccumulator``'s): it notes no write, so every
        version but the current one can go.
      start: unique id -> the version current when the tape was entered
        (written by an outer tape); ``start_owners`` the variables.
      versions: unique id -> [the version the first write here replaced,
        then one per write]; ``writes`` the ``WriteRecord`` of each write.
      owners: id(version handle) -> its variable, for every handle above.
      escapes: where a recorded value left TensorFlow (``_diagnostics``).
      written_while_closed: id(a variable's own handle) -> that handle, for
        the writes made while the tape was closed (``_versions``).
      suspects: id -> (a weak reference to a cond, case or loop op the tape
        recorded bare, its number of outputs the record knows), for each such
        op whose gradient was built while the tape recorded, which may have
        added outputs the record lacks (``_control_gradients._note_gradient``,
        ``complete_record``).
    """

    # The recorder protocol's two kind questions (``_recorders.Recorder``):
    # a tape of ours (an AssignAwareTape, or assigntape.ForwardAccumulator's
    # internal one), and a forward accumulator (in TensorFlow's set of them).
    ours = True
    forward = False
    # A recorder paused with this one where a first read after its re-entry
    # records an identity (``_resuming.cut_on_first_read``): the record of
    # the accumulator whose internal tape this is (``_forward``).
    paired: Optional["Record"] = None

    def __init__(self, tape: Any, untracked_writes: str = "raise", keeps_history: bool = True) -> None:
        self._tape = weakref.ref(tape)
        self.untracked_writes = untracked_writes
        self.keeps_history = keeps_history
        self.start: Dict[str, Any] = {}
        self.start_owners: Dict[str, Any] = {}
        self.versions: Dict[str, List[Any]] = {}
        self.owners: Dict[int, Any] = {}
        self.writes: Dict[str, List[WriteRecord]] = {}
        self.escapes: List[str] = []
        self.written_while_closed: Dict[int, Any] = {}
        # id(a variable's own handle), for the variables written while the
        # tape was closed before its last entry and not read in it: at its
        # last exit, their latest version was one it did not see made.
        self.unseen_at_exit: Set[int] = set()
        # Unique ids of the variables read or written in the scope it last
        # closed in (its ``seen`` then): what another thread must not write
        # behind it when it is entered again (``_resuming.note_read``).
        self.read_ids: Set[str] = set()
        self.suspects: Dict[int, Tuple[Any, int]] = {}
        # Whether some variable's first version here is not its own handle
        # (``versions_start_own``).
        self.foreign_first = False
        # The thread that closed the tape last (a forked child forgets the
        # records other threads closed).
        self.closed_in: Optional[int] = None

    # -- the tape's TensorFlow side --------------------------------------------

    @property
    def tape(self) -> Optional[Any]:
        return self._tape()

    def recording(self) -> bool:
        """Whether the tape records now (open, and not in ``stop_recording``)."""
        tape = self._tape()
        return tape is not None and bool(tape._recording)

    def recording_tape(self) -> Optional[Any]:
        """TensorFlow's tape object of a recording tape, else None."""
        tape = self._tape()
        return tape._tape if tape is not None and tape._recording else None

    def pause(self) -> None:
        """Stops recording on this tape only (``resume`` undoes it); nothing
        for a tape that is gone."""
        tape = self._tape()
        if tape is not None:
            tape._pop_tape()

    def resume(self) -> None:
        tape = self._tape()
        if tape is not None:
            tape._push_tape()

    def stands_for(self, recorder: Any) -> bool:
        """Whether this is ``recorder``'s record, or ``recorder`` itself."""
        return self is recorder or self._tape() is recorder

    # -- versions -----------------------------------------------------------------

    def note_write(self, var: Any, old: Any, new: Any, write: WriteRecord) -> None:
        """A write made ``new`` the variable's version after ``old``."""
        if not self.keeps_history:
            return
        if not self.recording() and write is not CLOSED_WRITE:  # inside this tape's stop_recording()
            # (A write made while it was closed is noted at the variable's
            # first read after it, which may be under stop_recording: the
            # write was not.)
            write = write._replace(recorded=False)
        uid = var._unique_id
        versions = self.versions.get(uid)
        # The new version goes in last: an interrupted exit runs ``settle``
        # again, which notes the write only if the version is not there yet
        # (so its owner must be by then, and its write not noted twice).
        self.owners[id(new)] = var
        if versions is None:
            self.owners[id(old)] = var
            if old is not var.__dict__.get("_handle"):
                self.foreign_first = True
            self.writes[uid], self.versions[uid] = [write], [old, new]
        else:
            writes = self.writes[uid]
            if len(writes) < len(versions):
                writes.append(write)
            versions.append(new)

    def note_escape(self, where: str) -> None:
        self.escapes.append(where)

    def versions_of(self, var: Any, own_handle: Any) -> Tuple[Any, ...]:
        """The variable's versions here; ``own_handle`` if the tape never saw
        it written (neither here nor by an outer tape before it started)."""
        versions = self.versions.get(var._unique_id)
        if versions is not None:
            return tuple(versions)
        return (self.start.get(var._unique_id, own_handle),)

    def first_version(self, uid: str, own_handle: Any) -> Any:
        """``versions_of(var, own_handle)[0]``, by the variable's unique id,
        without building the tuple (``gradient`` asks it of every source)."""
        versions = self.versions.get(uid)
        return self.start.get(uid, own_handle) if versions is None else versions[0]

    def versions_start_own(self) -> bool:
        """Whether every variable's first version here (at the tape's start,
        or before its first write here) is the variable's own handle."""
        return not self.start and not self.foreign_first

    def latest(self) -> Dict[str, Any]:
        """Unique id -> the latest version this tape knows, start included."""
        found = {uid: versions[-1] for uid, versions in self.versions.items()}
        for uid, handle in self.start.items():
            found.setdefault(uid, handle)
        return found

    def latest_of(self, uid: str, default: Any) -> Any:
        """The latest version of ``uid`` this tape knows (start included), else ``default``."""
        versions = self.versions.get(uid)
        return self.start.get(uid, default) if versions is None else versions[-1]

    def replace_latest(self, var: Any, new: Any) -> None:
        """``new`` is the variable's latest version here, in place of a version
        made for a write the tape did not see that another version of it
        replaced (``_resuming.cut_on_first_read``); nothing if no write of
        the variable is noted here."""
        versions = self.versions.get(var._unique_id)
        if versions and versions[-1] is not new:
            versions[-1] = new
            self.owners[id(new)] = var

    def owner_of(self, uid: str, handle: Any) -> Any:
        """The variable behind ``handle``, a version here or the start one of ``uid``."""
        found = self.owners.get(id(handle))
        return self.start_owners[uid] if found is None else found

    def state(self) -> Tuple[Any, ...]:
        """A copy of what the tape's entry may change, for ``put_back``."""
        return (
            dict(self.start),
            dict(self.start_owners),
            {k: list(v) for k, v in self.versions.items()},
            dict(self.owners),
            {k: list(v) for k, v in self.writes.items()},
            list(self.escapes),
            dict(self.written_while_closed),
            set(self.unseen_at_exit),
            dict(self.suspects),
            self.foreign_first,
        )

    def put_back(self, state: Tuple[Any, ...]) -> None:
        """The record as ``state`` had it (an interrupted entry undone)."""
        (
            self.start,
            self.start_owners,
            self.versions,
            self.owners,
            self.writes,
            self.escapes,
            self.written_while_closed,
            self.unseen_at_exit,
            self.suspects,
            self.foreign_first,
        ) = state

    def restart(self, current: Dict[str, Any], owners: Dict[int, Any]) -> None:
        """Forgets every version (``reset()``); ``current`` (unique id ->
        handle, ``owners`` id(handle) -> variable) starts the tape anew."""
        self.versions.clear()
        self.owners.clear()
        self.writes.clear()
        self.escapes.clear()
        self.written_while_closed.clear()
        self.suspects.clear()
        self.foreign_first = False
        self.start = dict(current)
        self.start_owners = {uid: owners[id(h)] for uid, h in self.start.items()}
