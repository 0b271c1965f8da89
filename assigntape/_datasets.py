"""``tf.data`` functions that write variables.

A dataset's functions (``map``, ``filter``, ``flat_map``, ``interleave``,
``scan``, ``reduce``, ...) are traced into graphs that TensorFlow's runtime
runs when elements are produced, in its own threads: the tape never sees
their writes. Reads after such a write would credit the version from before
it, a silently wrong gradient. So the points where a dataset's functions run
for the caller (an iterator's next element, ``reduce``,
``get_single_element``) find the variables those functions write, from their
graphs, as ``_functions`` does for a ``tf.function`` call, and refuse (or
cut) before they run.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, List

from assigntape import _functions, _leases, _versions
from assigntape._tf import dataset_ops, executing_eagerly, ops

__all__ = ["next_element", "reduce_dataset", "single_element"]

# What to do instead: the runtime runs these functions, so
# tf.config.run_functions_eagerly does not reach them.
_EAGER_FIXES = (
    "Make the write in the tape's own code instead: take the elements from the dataset "
    "(for e in dataset: ...) and write the variable in the loop body."
)
_GRAPH_FIXES = (
    "Make the write in the tape's own code instead: take the elements from an iterator "
    "(e = next(iterator)) and write the variable after it, or loop with tf.range."
)


def _dataset_writes(dataset: Any) -> List[_functions.Write]:
    """The writes of every function ``dataset`` runs, its own and its input
    datasets' (cached per dataset: a dataset is immutable)."""
    cached = _cache.get(dataset)
    if cached is not None:
        return cached
    writes: List[_functions.Write] = []
    try:
        functions = dataset._functions()
        inputs = dataset._inputs()
    except (AttributeError, NotImplementedError):
        functions, inputs = [], []
    for wrapper in functions:
        function: Any = getattr(wrapper, "function", None)
        graph = getattr(function, "graph", None)
        if graph is None:
            continue
        captured = list(function.captured_inputs)
        # The graph's inputs are the element's components, then the captures.
        handles = [None] * (len(graph.inputs) - len(captured)) + captured
        writes += _functions.function_writes(function, handles)
    for parent in inputs:
        if isinstance(parent, dataset_ops.DatasetV2):
            writes += _dataset_writes(parent)
    try:
        _cache[dataset] = writes
    except TypeError:
        pass  # not weakly referable: found again next time
    return writes


_cache: "weakref.WeakKeyDictionary[Any, List[_functions.Write]]" = weakref.WeakKeyDictionary()

# Per thread, the input datasets' writes of each ``Dataset.reduce`` running,
# for the op that runs its reduce function (``reduce_op``).
_pending = threading.local()


def _idle() -> bool:
    """No tape anywhere, and executing eagerly: nothing to refuse or note.
    (These hooks are always in place: a function traced before the first
    tape must note the writes its graph hides, see ``_guarded``.)"""
    return not _versions._all_scopes and not _leases.closed_refs and executing_eagerly()


def _guarded(writes: List[_functions.Write], context: str, run: Callable[[], Any]) -> Any:
    """Runs ``run`` (which runs dataset functions making ``writes``) as the
    tapes around it allow: refused, or run and then cut."""
    if not executing_eagerly():
        # A dataset made outside the graph being traced and captured: its
        # functions are not among the graph's, so a call of it from an
        # eager tape would not find the writes in its graph.
        _functions.note_hidden_writes(ops.get_default_graph(), writes)
        if not _versions._all_scopes and not _leases.closed_refs:
            return run()
    found = _versions.call_context()
    if found is None:
        _functions.outside_writes(writes, context)
        return run()
    scope, _ = found
    variables = _functions.variables_written(scope, writes)
    _functions.refuse_writes(scope, variables, context, _EAGER_FIXES, _GRAPH_FIXES)
    result = run()
    _functions.cut_writes(scope, variables, context)
    return result


def _context(writes: List[_functions.Write], where: str) -> str:
    """Names the dataset functions that write, and what runs them."""
    names = ", ".join(sorted({repr(str(f.graph.name)) for _, _, f in writes}))
    return f"tf.data function {names} (run by {where})"


def next_element(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``OwnedIterator._next_internal`` and ``get_next_as_optional``: the
    element's functions run now (or ran ahead, prefetched)."""
    if _idle():
        return wrapped(*args, **kwargs)
    dataset = getattr(instance, "_dataset", None)
    writes = _dataset_writes(dataset) if dataset is not None else []
    if not writes:
        return wrapped(*args, **kwargs)
    context = _context(writes, "an iterator's next element")
    return _guarded(writes, context, lambda: wrapped(*args, **kwargs))


def single_element(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``Dataset.get_single_element``: the dataset's functions run now."""
    if _idle():
        return wrapped(*args, **kwargs)
    writes = _dataset_writes(instance)
    if not writes:
        return wrapped(*args, **kwargs)
    context = _context(writes, "Dataset.get_single_element")
    return _guarded(writes, context, lambda: wrapped(*args, **kwargs))


def reduce_dataset(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``Dataset.reduce``: its input's functions and the reduce function run
    now. The reduce function is traced inside ``reduce`` (an autograph
    ``for`` loop over a dataset in a ``tf.function`` is one, its body the
    reduce function), so its writes are found at the op that runs it."""
    if _idle():
        return wrapped(*args, **kwargs)
    writes = _dataset_writes(instance)
    context = _context(writes, "Dataset.reduce") if writes else ""
    token = _pending.__dict__.setdefault("stack", [])
    token.append((writes, context))
    try:
        return wrapped(*args, **kwargs)
    finally:
        token.pop()


def reduce_op(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``gen_dataset_ops.reduce_dataset``: the reduce function's own writes,
    with its input dataset's (noted by ``reduce_dataset``)."""
    if _idle():
        return wrapped(*args, **kwargs)
    stack = getattr(_pending, "stack", None)
    writes, context = stack[-1] if stack else ([], "")
    function = kwargs.get("f")
    handles = kwargs.get("other_arguments", args[2] if len(args) > 2 else None)
    own: List[_functions.Write] = []
    if function is not None and getattr(function, "graph", None) is not None and handles is not None:
        captured = list(handles)
        graph = function.graph
        own = _functions.function_writes(function, [None] * (len(graph.inputs) - len(captured)) + captured)
    if own:
        context = _context(own, "Dataset.reduce")
    writes = writes + own
    if not writes:
        return wrapped(*args, **kwargs)
    return _guarded(writes, context, lambda: wrapped(*args, **kwargs))
