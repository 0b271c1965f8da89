"""Calls of functions in whose graph a tape was open: its variables held
against other threads while the graph runs.

Another thread's write to a variable that a tape open in this thread read or
wrote is refused (``_threads.refuse_other_thread``), by the scopes listed in
``_registry``. A tape opened inside a ``tf.function`` has a scope only while
the function is traced: its graph runs at each call, when no scope is open,
and another thread's write made then would land between the tape's reads and
writes and be credited to its version. So the scope, when it goes, notes its
graph with the variables it saw (``_registry.tape_graphs``), and every call
of such a graph lists, for the call, a scope of the calling thread that
holds them (``CallScope``): the other-thread rule refuses what it would
refuse with the tape open eagerly. A call of an unnoted graph costs one
lookup (while no graph is noted in the process).

The other way round: a function that writes, called in another thread before
such a call, may write while it runs; its call checked the holds when it
started. So, while any graph is noted, a call of a function that writes
notes its variables for the call (``_writing``), and a call that holds one of
them meanwhile is refused before it runs. A function whose graph was found to
write nothing is remembered (``_writes_nothing``): its later calls cost a set
lookup, unless the call is given a dataset or iterator whose functions write
(they are the call's writes, not the graph's).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, List, Tuple

from assigntape import _registry
from assigntape._errors import UntrackedWriteError
from assigntape._tf import executing_eagerly, ops
from assigntape._versions import Scope, canonical_handle, differentiable, variable_of_handle
from assigntape._wrapping import bind

__all__ = ["CallScope", "forget_threads", "leased"]

Hook = Callable[[Callable[..., Any], Any, Any, Any], Any]


class CallScope(Scope):
    """The variables a running function's graph's tapes read or wrote, held
    in the calling thread for the call (no versions: the graph has its own)."""

    __slots__ = ("function", "thread_name")

    def __init__(self, graph: Any, held: Dict[str, Any]) -> None:
        super().__init__(graph)
        self.function = f"tf.function {str(graph.name)!r}"
        self.thread_name = threading.current_thread().name
        self.seen.update(held)
        for ref in held.values():
            var = None if ref is None else ref()
            if var is not None:
                # Its own handle names it to a write here through a raw op,
                # also for a variable made before ``import assigntape``.
                self.owners[id(canonical_handle(var))] = var


def leased(call: Hook, writes_of: Callable[[Any, List[Any]], List[Any]], passed: Callable[[], List[Any]]) -> Hook:
    """The hook of ``ConcreteFunction._call_flat``: ``call`` (the hook of
    ``_functions``), run, for a graph in which a tape was open, with the
    variables that tape saw held by this thread (a ``CallScope``, listed for
    the call and unlisted however it ends). In a graph being traced, the
    graph calling it is noted as holding them too. ``writes_of(function,
    handles)``: the writes of a function's graph given its inputs
    (``_functions.function_writes``); ``passed()``: those of the datasets
    and iterators given to the call running now (``_datasets.given_writes``)."""

    def hook(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        held = _registry.tape_graphs.get(instance._func_graph)
        if held is None:
            if not _registry.tape_graphs or not executing_eagerly():
                return call(wrapped, instance, args, kwargs)
            given = passed()
            if instance in _writes_nothing and not given:
                return call(wrapped, instance, args, kwargs)
            return _writing(call, writes_of, given, wrapped, instance, args, kwargs)
        if not executing_eagerly():
            _registry.note_calls_in(ops.get_default_graph(), held)
            return call(wrapped, instance, args, kwargs)
        scope = CallScope(instance._func_graph, held)
        # Unlisting is idempotent: an exception (a KeyboardInterrupt) before
        # the listing or in it leaves nothing behind, and one in the unlisting
        # unlists once more.
        try:
            _registry._list(scope)
            # (Listed first: a writing call starting now sees the hold, or is seen here.)
            _refuse_running_writers(scope)
            return call(wrapped, instance, args, kwargs)
        finally:
            try: _registry.unlist(scope)  # noqa: E701 - see _registry._list  # fmt: skip
            except BaseException:
                _registry.unlist(scope)
                raise

    return hook


# The functions whose graphs write nothing, for any inputs (``writes_of``
# gave none: it lists each written input of the graph and the writes the graph
# runs without showing them, and a called function's graph is built, no longer
# traced). Their calls skip ``_writing`` (binding the arguments and a lookup
# per written handle), which every eager call of every function paid while
# any tape's graph is noted, unless given a dataset or iterator that writes.
# Weak: a function that goes takes its entry along.
_writes_nothing: "weakref.WeakSet[Any]" = weakref.WeakSet()


# The calls running now of functions that write variables (while some graph
# is noted): a key of each call's own -> (its thread, the differentiable
# variables it writes, ``_unique_id`` -> name, the function's name).
_running: Dict[object, Tuple[int, Dict[str, str], str]] = {}


def _writing(
    call: Hook,
    writes_of: Callable[[Any, List[Any]], List[Any]],
    given: List[Any],
    wrapped: Callable[..., Any],
    instance: Any,
    args: Any,
    kwargs: Any,
) -> Any:
    """``call``, noted in ``_running`` for the call if the function writes
    (its graph, or the datasets and iterators it is ``given``)."""
    arguments = bind(("tensor_inputs", "captured_inputs"), args, kwargs)
    handles = list(arguments["tensor_inputs"]) + list(arguments["captured_inputs"])
    writes = writes_of(instance, handles)
    if not writes:
        _never_writes(instance)
        if not given:
            return call(wrapped, instance, args, kwargs)
    written: Dict[str, str] = {}
    for handle, _, _ in writes + given:
        # (A dataset known only by its variant names no variable: None.)
        var = None if handle is None else variable_of_handle(handle)
        if var is not None and differentiable(var):
            written[var._unique_id] = var.name
    if not written:
        return call(wrapped, instance, args, kwargs)
    key = object()
    try:
        _running[key] = (threading.get_ident(), written, str(instance._func_graph.name))
        return call(wrapped, instance, args, kwargs)
    finally:
        _running.pop(key, None)


def _never_writes(function: Any) -> None:
    try:
        _writes_nothing.add(function)
    except TypeError:
        pass  # not weakly referable: asked again at each call


def forget_threads(gone: Callable[[int], bool]) -> None:
    """The writing calls of the threads ``gone`` names, which do not exist
    any more (``_leases.forget_threads``), will never end, and must not
    refuse other calls."""
    for key, (thread, _, _) in list(_running.items()):
        if gone(thread):
            _running.pop(key, None)


def _refuse_running_writers(scope: CallScope) -> None:
    """Refuses the call of ``scope`` if a function running in another thread
    writes a variable it holds: its writes would land while the call's tape
    reads and writes it, credited to the tape's version."""
    me = threading.get_ident()
    for thread, written, name in list(_running.values()):
        both = sorted(written[uid] for uid in written if uid in scope.seen)
        if thread != me and both:
            raise UntrackedWriteError(
                f"{scope.function} called in thread {scope.thread_name!r} while tf.function {name!r}, "
                f"running in another thread, writes variable {both[0]!r}, which an AssignAwareTape open "
                "in the called function's graph reads or writes: that tape would "
                "credit the other thread's write to its own version, a silently wrong gradient. Call it "
                "after the other call returns (synchronize the threads), or give each thread its own variables."
            )
