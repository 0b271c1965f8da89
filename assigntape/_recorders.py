"""The recorders, side by side, and the one protocol the version store asks of them.

Four kinds of recorder follow the versions of the variables written while
they record:

==========================================  ===========================================
recorder                                    its record (what the store holds)
==========================================  ===========================================
``AssignAwareTape``                         ``Record`` (``_record``), made by the tape
``assigntape.ForwardAccumulator``           the ``Record`` of its internal tape, an
                                            ``AssignAwareTape`` that keeps no history
a plain ``tf.GradientTape`` beside ours     ``PlainTapeRecord``, made at its exit
TensorFlow's ``ForwardAccumulator``         ``AccumulatorRecord``, made at its exit
==========================================  ===========================================

Whatever the kind, the scopes (``_versions``), closed records and resuming
(``_resuming``) ask a record only what ``Recorder`` names: whether its recorder
records, to pause and resume it (for one op: a tape is popped, an accumulator
set aside with the ones entered after it put back around it, so that every
accumulator keeps its nesting order), which recorder it stands for, and the
writes made while it was closed. The other questions of the protocol are the
store's, asked with the record: "go on from my versions" (``_resuming.enter_again``,
the one entry path of every kind, lazily, at each variable's first read) and "my current version of v"
(``_resuming.latest_version``). Entering and exiting are each recorder's own
methods (``_tape``, ``_forward``; TensorFlow's, followed by ``_plain_tapes``).
While a plain tape or accumulator is open, one record stands for it
(``holding``): the scopes it holds keep it, and ``recording_now`` gives it, so
that no caller tests a recorder's class: its kind is the record's (``ours``,
``forward``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence

from assigntape._record import Record
from assigntape._registry import _tls, open_plain
from assigntape._tf import forwardprop, pywrap_tfe

__all__ = [
    "AccumulatorRecord",
    "PlainTapeRecord",
    "Recorder",
    "among",
    "holding",
    "is_accumulator",
    "record_for",
    "recording_now",
    "records",
    "set_aside",
]


class Recorder(Protocol):
    """What the store asks of any recorder's record."""

    # id(a variable's own handle) -> that handle, for each variable written
    # while the recorder was closed (``_versions.note_write_while_closed``).
    written_while_closed: Dict[int, Any]
    # A tape of ours (its record notes writes, and our gradient completes it).
    ours: bool
    # A forward accumulator: where TensorFlow's forward mode, not ours, is
    # what a caller asks about (``_control_gradients``).
    forward: bool

    @property
    def paired(self) -> Optional["Recorder"]:
        """Paused with it where a first read after its re-entry records an
        identity: assigntape.ForwardAccumulator's record, for its internal tape's."""

    def recording(self) -> bool:
        """Whether the recorder records now."""

    def pause(self) -> None:
        """Stops its recording, for one op (``resume`` undoes it)."""

    def resume(self) -> None: ...

    def stands_for(self, recorder: Any) -> bool:
        """Whether this is ``recorder``'s record (or ``recorder`` itself)."""


# 1 and 2: ``AssignAwareTape`` and ``assigntape.ForwardAccumulator``: ``Record``.


class PlainTapeRecord(Record):
    """3: a plain ``tf.GradientTape`` that recorded beside a tape of ours and
    may be entered again. Paused as a tape of ours is: popped."""

    ours = False


class AccumulatorRecord(Record):
    """4: TensorFlow's ``ForwardAccumulator``, that recorded beside a tape of
    ours and may be entered again. Paused by being set aside (``set_aside``)."""

    ours = False
    forward = True

    def __init__(self, accumulator: Any) -> None:
        super().__init__(accumulator)
        self._paused = False

    def recording_tape(self) -> Optional[Any]:
        return None  # (an accumulator is on no tape stack)

    def pause(self) -> None:
        accumulator = self._tape()
        if accumulator is not None and accumulator._recording:
            _place(accumulator, False)
            self._paused = True

    def resume(self) -> None:
        accumulator = self._tape()
        if self._paused and accumulator is not None:
            _place(accumulator, True)
        self._paused = False


def is_accumulator(recorder: Any) -> bool:
    """Whether ``recorder`` (not a record) is a forward accumulator, TensorFlow's or ours."""
    return isinstance(recorder, forwardprop.ForwardAccumulator)


def record_for(recorder: Any) -> Record:
    """The record of a plain tape or forward accumulator that may be entered
    again: the one place the kind of a recorder beside ours is told."""
    if is_accumulator(recorder):
        return AccumulatorRecord(recorder)
    return PlainTapeRecord(recorder)


# Where ``holding`` keeps a plain recorder's record, on the recorder.
_HOLDING = "_assigntape_holding"


def holding(recorder: Any) -> Record:
    """The record that stands for a plain tape or forward accumulator while
    it is open (in ``Scope.holders``, in ``recording_now``): made once per
    recorder, and asked only the protocol's questions that need no history
    (recording, pause and resume, stands for, kind)."""
    notes = recorder.__dict__
    found: Optional[Record] = notes.get(_HOLDING)
    if found is None:
        found = notes[_HOLDING] = record_for(recorder)
    return found


def recording_now() -> List[Record]:
    """What records in this thread now, each as its record: the tapes of ours
    recording, and the plain tapes and forward accumulators recording."""
    found = [r for s in getattr(_tls, "scopes", {}).values() for r in s.records if r.recording()]
    for ref, _ in open_plain():
        recorder = ref()
        if recorder is not None and getattr(recorder, "_recording", False):
            found.append(holding(recorder))
    return found


def records(recorder: Recorder) -> bool:
    """Whether ``recorder`` records now (and TensorFlow's tapes are not stopped)."""
    return not pywrap_tfe.TFE_Py_TapeSetIsStopped() and recorder.recording()


def among(records: Sequence[Recorder], recorder: Any) -> bool:
    """Whether ``recorder`` (a recorder, or its record) is one of ``records``."""
    return any(r.stands_for(recorder) for r in records)


@contextlib.contextmanager
def set_aside(accumulator: Any) -> Iterator[None]:
    """Runs the block with ``accumulator`` (recording) out of TensorFlow's
    set of accumulators, as a tape popped (``_recording`` False), and puts
    it back where it was: the accumulators entered after it are taken out
    and put back around it, so that every accumulator keeps its nesting order
    (an outer one records what an inner one computes)."""
    if not accumulator._recording:
        yield
        return
    # (An exception at any line, a KeyboardInterrupt, puts it back if it was
    # taken out: ``_place`` notes it in the line that does it, and the putting
    # back runs once more if interrupted.)
    try:
        _place(accumulator, False)
        yield
    finally:
        try: _put_back(accumulator)  # noqa: E701  # fmt: skip
        except BaseException:
            _put_back(accumulator)
            raise


def _put_back(accumulator: Any) -> None:
    if not accumulator._recording:
        _place(accumulator, True)


def _place(accumulator: Any, recording: bool) -> None:
    """Puts ``accumulator`` in (``recording``) or takes it out of TensorFlow's
    set of accumulators, where it was entered: the ones entered after it are
    taken out first and put back after it."""
    after = _entered_after(accumulator)
    # Each change and its note on one line, the note erring on the side of
    # an accumulator in the set (an exception, a KeyboardInterrupt, may land
    # between the two, even on one line): TensorFlow's set refuses an
    # accumulator added twice (``_add`` lets it be) but crashes on one removed
    # twice. So a removal is noted before it is made, an addition after. The
    # ones taken out are put back whatever happens.
    removed: List[Any] = []
    try:
        for other in reversed(after): removed.append(other); pywrap_tfe.TFE_Py_ForwardAccumulatorSetRemove(other._accumulator)  # noqa: E701, E702, E501  # fmt: skip
        if recording and not accumulator._recording: _add(accumulator._accumulator); accumulator._recording = True  # noqa: E701, E702, E501  # fmt: skip
        if not recording and accumulator._recording: accumulator._recording = False; pywrap_tfe.TFE_Py_ForwardAccumulatorSetRemove(accumulator._accumulator)  # noqa: E701, E702, E501  # fmt: skip
    finally:
        while removed: _add(removed[-1]._accumulator); removed.pop()  # noqa: E701, E702  # fmt: skip


def _add(accumulator: Any) -> None:
    """Adds ``accumulator`` (TensorFlow's C object) to this thread's set; one
    in it already (an interrupt landed between the note of its removal and
    the removal) stays as it is."""
    try:
        pywrap_tfe.TFE_Py_ForwardAccumulatorSetAdd(accumulator)
    except Exception as error:  # noqa: BLE001 - TensorFlow's status exception has no public type
        if "twice" not in str(error):
            raise


def _entered_after(accumulator: Any) -> List[Any]:
    """The accumulators recording in this thread that were entered after
    ``accumulator``, innermost last (``_registry.open_plain``)."""
    found: List[Any] = []
    seen = False
    for ref, _ in open_plain():
        other = ref()
        if other is accumulator:
            seen = True
        elif seen and is_accumulator(other) and other._recording:
            found.append(other)
    return found
