"""The scopes open in every thread, and what is put in place while any is.

A *scope* (``_versions.Scope``) holds one thread's versions in one graph
(``None`` for eager execution). This module keeps, per thread
(``threading.local``), the thread's scopes by graph and the plain tapes and
forward accumulators it has open; across threads, the list of every open scope
(``_all_scopes``, under ``_all_lock``), the one question asked across threads.
While any scope is open the ``served`` class attributes (the handle
descriptor, the eager short paths) are in place; while a tape is open or
closed-but-alive the ``switches`` (the dormant write wrappers) are.

Nothing here knows what a version is: the modules above it do.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

from assigntape import _leases
from assigntape._record import Record
from assigntape._tf import (
    ControlFlowFuncGraph as _CONTROL_FLOW_GRAPH,
)
from assigntape._tf import (
    context as _context,
)
from assigntape._tf import (
    executing_eagerly,
    ops,
)

if TYPE_CHECKING:
    from assigntape._versions import Scope  # (annotations only: the store is above)


_tls: Any = threading.local()  # per thread: scopes, plain, merging, constructing, ...
# Every open scope of every thread, for the one question asked across threads:
# is a variable tracked by a tape in another thread (see ``tracked_in_other_thread``)?
_all_scopes: List["Scope"] = []
_all_lock = threading.Lock()


def _scopes() -> Dict[Any, Scope]:
    scopes = getattr(_tls, "scopes", None)
    if scopes is None:
        scopes = _tls.scopes = {}
    return scopes


def current_key() -> Any:
    return None if executing_eagerly() else ops.get_default_graph()


# The lock regions on a tape's way in and out are one-line ``with``
# statements around a function: an exception (a KeyboardInterrupt) can then
# land before the lock is taken, or in the function, whose exit releases it,
# but not between the block's last line and the release (a line event of the
# ``with`` line itself), which would leave it held for good.


def _list(scope: Scope) -> None:
    if getattr(_tls, "ending", None) is None:
        _tls.ending = _ThreadEnd()
    with _all_lock: _list_locked(scope)  # noqa: E701 - see above  # fmt: skip


# Called with a thread's ident when the thread ends (``_ThreadEnd``): a
# module above this one forgets the tapes it left open (``_threads``).
thread_end_hooks: List[Callable[[int], None]] = []


class _ThreadEnd:
    """Kept in the locals of each thread that opened a tape of ours: it goes
    with them when the thread ends, and calls the ``thread_end_hooks``."""

    __slots__ = ("ident",)

    def __init__(self) -> None:
        self.ident = threading.get_ident()

    def __del__(self) -> None:
        try:
            for hook in thread_end_hooks:
                hook(self.ident)
        except Exception:  # noqa: S110
            pass  # (at the interpreter's exit, the modules may be half gone)


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
    with _all_lock: _serve_handles_locked(on)  # noqa: E701 - see _list  # fmt: skip


def _serve_handles_locked(on: bool) -> None:
    global _serving, _switched, _active_at
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
        if not on:
            # First: interrupted part way (a KeyboardInterrupt), some stay on,
            # dormant and harmless, and the next tape puts them all on
            # (``put`` is idempotent); never the flag on with some off.
            _switched = False
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
    if time.monotonic() - _active_at < (IDLE_SECONDS if wait is None else wait):
        return
    with _all_lock: _idle_locked()  # noqa: E701 - see _list  # fmt: skip


def _idle_locked() -> None:
    global _active_at
    if _switched and not _all_scopes and not _leases.closed_refs:
        if _leases.plain:
            # A plain tape that ran beside one of ours keeps versions: its
            # gradient must still map them (``_plain_gradients.gradient``).
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
    # (References to records gone that an interrupt left: ``_leases.prune``.)
    _leases.prune()
    _leases.closed.add(tape_record)
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


def _unlist_unnamed_locked(scope: Scope) -> None:
    _with_unnamed.discard(id(scope))
    if not _with_unnamed:
        _check_reads(False)


def _unlist_locked(scope: Scope) -> None:
    if scope.seen and scope.key is not None:
        _note_tape_graph(scope)
    _unlist_listed_locked(scope)


def unlist(scope: Scope) -> None:
    """Unlists ``scope`` (a call's, ``_compiled_tapes``), noting nothing."""
    with _all_lock: _unlist_call_locked(scope)  # noqa: E701 - see _list  # fmt: skip


def _unlist_call_locked(scope: Scope) -> None:
    _unlist_listed_locked(scope)
    if id(scope) in _with_unnamed:  # (an iterator made meanwhile noted it: ``_datasets.note_ahead``)
        _unlist_unnamed_locked(scope)


def _unlist_listed_locked(scope: Scope) -> None:
    global _active_at
    if any(s is scope for s in _all_scopes):
        _all_scopes.remove(scope)
    if not _all_scopes:
        _serve_versions(False)
        _leases.prune()
        _active_at = time.monotonic()


# A tape opened in a ``tf.function``'s trace has a scope only while the
# function is traced; its graph runs later, with no scope open. Each function
# graph (and each graph it is traced in, which calls it) that held such a
# scope, with the variables its tapes read or wrote: their ``_unique_id`` ->
# a weak reference to the variable (None: only its id is known). A call of
# such a graph holds them against other threads (``_compiled_tapes``).
tape_graphs: "weakref.WeakKeyDictionary[Any, Dict[str, Any]]" = weakref.WeakKeyDictionary()
# Per function graph, the names of the ops a variable's construction made
# there (its initialization: ``_serving.constructing``), which are no writes
# of the function's (``_functions``).
initializer_ops: "weakref.WeakKeyDictionary[Any, Set[str]]" = weakref.WeakKeyDictionary()


def _note_tape_graph(scope: Scope) -> None:
    """``scope``, in a function's graph, goes: its graph, and those it is
    traced in, note the variables it saw. (Run again, by an interrupted
    tape's exit finished later, it notes the same.)"""
    known = {v._unique_id: v for v in (*scope.owners.values(), *scope.canonical.values())}
    _note_locked(scope.key, {uid: _weak(known.get(uid)) for uid in scope.seen})


def note_calls_in(graph: Any, held: Dict[str, Any]) -> None:
    """A function whose graph held ``held`` is called in ``graph`` (being
    traced): ``graph``, and those it is traced in, hold them too."""
    with _all_lock: _note_locked(graph, held)  # noqa: E701 - see _list  # fmt: skip


def _note_locked(graph: Any, held: Dict[str, Any]) -> None:
    # (A cond branch's or loop body's graph is traced in its function's.)
    while getattr(graph, "building_function", False):
        tape_graphs.setdefault(graph, {}).update(held)
        graph = getattr(graph, "outer_graph", None)


def _weak(var: Any) -> Any:
    try:
        return None if var is None else weakref.ref(var)
    except TypeError:
        return None  # not weakly referable: known by its id


def open_here() -> bool:
    """Whether this thread has a scope (an open tape, or versions held for a
    plain one): else ``v._handle`` is the variable's own handle, served with
    no side effect."""
    return bool(getattr(_tls, "scopes", None))


def any_scopes() -> bool:
    """Whether a tape is open in any thread."""
    return bool(_all_scopes)


def _count_acting(step: int) -> None:
    """One more (``step`` 1) or one fewer (-1) thread acting for a replica:
    the ``acting_checks`` are in place while any does (the replica threads a
    merge_call starts act at once)."""
    with _all_lock: _count_acting_locked(step)  # noqa: E701 - see _list  # fmt: skip


def _count_acting_locked(step: int) -> None:
    global _acting
    _acting += step
    if _serving and _acting == (1 if step > 0 else 0):
        for place in acting_checks:
            place.put(step > 0)


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


# id() of every scope with a write noted by ``unknown_variable_write``: while
# it is not empty every read asks ``accessed`` (``read_checks``).
_with_unnamed: Set[int] = set()


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
