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
lookup.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict

from assigntape import _registry
from assigntape._tf import executing_eagerly, ops
from assigntape._versions import Scope, canonical_handle

__all__ = ["CallScope", "leased"]

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


def leased(call: Hook) -> Hook:
    """The hook of ``ConcreteFunction._call_flat``: ``call`` (the hook of
    ``_functions``), run, for a graph in which a tape was open, with the
    variables that tape saw held by this thread (a ``CallScope``, listed for
    the call and unlisted however it ends). In a graph being traced, the
    graph calling it is noted as holding them too."""

    def hook(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        held = _registry.tape_graphs.get(instance._func_graph)
        if held is None:
            return call(wrapped, instance, args, kwargs)
        if not executing_eagerly():
            _registry.note_calls_in(ops.get_default_graph(), held)
            return call(wrapped, instance, args, kwargs)
        scope = CallScope(instance._func_graph, held)
        # Unlisting is idempotent: an exception (a KeyboardInterrupt) before
        # the listing or in it leaves nothing behind, and one in the unlisting
        # unlists once more.
        try:
            _registry._list(scope)
            return call(wrapped, instance, args, kwargs)
        finally:
            try: _registry.unlist(scope)  # noqa: E701 - see _registry._list  # fmt: skip
            except BaseException:
                _registry.unlist(scope)
                raise

    return hook
