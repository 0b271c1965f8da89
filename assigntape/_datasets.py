"""``tf.data`` functions that write variables.

A dataset's functions (``map``, ``filter``, ``flat_map``, ``interleave``,
``scan``, ``reduce``, ...) are traced into graphs that TensorFlow's runtime
runs when elements are produced, in its own threads: the tape never sees
their writes. Reads after such a write would credit the version from before
it, a silently wrong gradient. So the points where a dataset's functions run
for the caller (an iterator's next element, ``reduce``,
``get_single_element``, ``save``, a ``tf.function`` given the dataset or an
iterator as an argument) find the variables those functions write, from
their graphs, as ``_functions`` does for a ``tf.function`` call, and refuse
(or cut) before they run.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any, Callable, List, Set, Tuple

import tensorflow as tf

from assigntape import _branches, _dataset_graphs, _functions, _leases, _py_functions, _refusals, _registry, _versions
from assigntape._tf import composite_tensor, dataset_ops, dtypes, executing_eagerly, iterator_ops, nest, ops

__all__ = [
    "function_call",
    "given_writes",
    "graph_iterator",
    "graph_next_element",
    "multi_device_iterator",
    "next_element",
    "reduce_dataset",
    "save_dataset",
    "single_element",
]

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
    datasets', and those of the dataset argument it stands for, inside a
    ``tf.function``'s graph (``_passed_writes``)."""
    return _walk(dataset)[0]


def _walk(dataset: Any) -> Tuple[List[_functions.Write], bool]:
    """``_dataset_writes``, and whether they may be cached: a dataset is
    immutable, but one built on a dataset argument inside a trace stands for
    whatever dataset the call passes."""
    cached = _cache.get(dataset)
    if cached is not None:
        return cached, True
    if isinstance(dataset, dataset_ops._VariantDataset):
        # A dataset argument inside a trace, or one rebuilt from a variant.
        variant = dataset._variant_tensor
        passed = _passed_writes(variant, dataset.element_spec, iterator=False)
        return passed + _dataset_graphs.unlisted_writes(variant), False
    writes: List[_functions.Write] = []
    cacheable = True
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
            found, fixed = _walk(parent)
            writes += found
            cacheable = cacheable and fixed
    if cacheable:
        try:
            _cache[dataset] = writes
        except TypeError:
            pass  # not weakly referable: found again next time
    return writes, cacheable


def _iterator_writes(iterator: Any) -> List[_functions.Write]:
    """The writes of the functions an ``OwnedIterator`` runs: its dataset's
    (for an iterator argument inside a ``tf.function``'s graph, made from
    its resource without its dataset, the iterator passed's), and, for a
    per-device iterator of ``tf.distribute``, its source dataset's."""
    dataset = getattr(iterator, "_dataset", None)
    if dataset is not None:
        writes = _dataset_writes(dataset)
    else:
        resource = getattr(iterator, "_iterator_resource", None)
        writes = _passed_writes(resource, iterator.element_spec, iterator=True) if resource is not None else []
    source = _sources.get(iterator)
    return writes + _dataset_writes(source) if source is not None else writes


def multi_device_iterator(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``OwnedMultiDeviceIterator.__init__`` (MirroredStrategy's distributed
    datasets): each device's iterator runs a dataset of its own that takes
    its elements from the source dataset's iterator, on the host, whose
    functions run as a device's next element is asked for. Each device's
    iterator is noted with the source dataset. Always on: the iterator may
    be made before the tape opens."""
    result = wrapped(*args, **kwargs)
    dataset = kwargs.get("dataset", args[0] if args else None)
    if isinstance(dataset, dataset_ops.DatasetV2):
        for iterator in getattr(instance, "_device_iterators", ()):
            try:
                _sources[iterator] = dataset
            except TypeError:
                pass  # not weakly referable
    return result


_sources: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


_cache: "weakref.WeakKeyDictionary[Any, List[_functions.Write]]" = weakref.WeakKeyDictionary()

# Per thread, the input datasets' writes of each ``Dataset.reduce`` running,
# for the op that runs its reduce function (``reduce_op``).
_pending = threading.local()


def _idle() -> bool:
    """No tape anywhere, and executing eagerly: nothing to refuse or note.
    (These hooks are always in place: a function traced before the first
    tape must note the writes its graph hides, see ``_guarded``.)"""
    return not _registry._all_scopes and not _leases.closed_refs and executing_eagerly()


def _run(writes: List[_functions.Write], where: str, wrapped: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``wrapped(*args, **kwargs)``, which runs dataset functions making
    ``writes`` (if any), for ``where``: ``_guarded``."""
    if not writes:
        return wrapped(*args, **kwargs)
    return _guarded(writes, where, lambda: wrapped(*args, **kwargs))


def _guarded(writes: List[_functions.Write], where: str, run: Callable[[], Any]) -> Any:
    """Runs ``run`` (which runs dataset functions making ``writes``, for
    ``where``) as the tapes around it allow: refused, or run and then cut."""
    context = _context(writes, where)
    hidden = writes
    if not executing_eagerly():
        _refuse_in_unordered_graph(writes, context)
        # A dataset made outside the graph being traced and captured: its
        # functions are not among the graph's, so a call of it from an
        # eager tape would not find the writes in its graph. (Not a dataset
        # argument's: the next call may pass another; ``function_call``
        # finds those at each call.)
        passed = {id(w) for entry in getattr(_calls, "stack", ()) for _, _, found in entry for w in found}
        hidden = [w for w in writes if id(w) not in passed]
        _functions.note_hidden_writes(ops.get_default_graph(), hidden)
        if not _registry._all_scopes and not _leases.closed_refs:
            return run()
    found = _branches.call_context()
    if not hidden and (found is None or found[0].key is None):
        # Only a dataset argument's writes (in a trace): refused here if a
        # tape is open in this graph; for a tape outside it, at each call.
        return run()
    if found is None:
        _functions.outside_writes(writes, context)
        return run()
    scope, _ = found
    _dataset_graphs.refuse_unlisted(scope.key is not None, [w for w in writes if w[0] is None], where)
    variables = _functions.variables_written(scope, writes)
    _functions.refuse_writes(scope, variables, context, _EAGER_FIXES, _GRAPH_FIXES)
    result = run()
    _functions.cut_writes(scope, variables, context)
    return result


def _refuse_in_unordered_graph(writes: List[_functions.Write], context: str) -> None:
    """In a TF1 graph (no automatic control dependencies) with a tape open in
    this thread, a dataset function's write is refused as a write made there
    directly is (``_refusals.refuse_unordered_graph``): the graph runs the
    functions in no order the tape knows."""
    for handle, op_type, _ in writes:
        if handle is not None:
            _refusals.refuse_unordered_graph([handle], f"{op_type} in {context}")


def graph_iterator(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``DatasetV1._make_initializable_iterator`` and ``_make_one_shot_iterator``
    (the TF1 iterator made), and ``Iterator.make_initializer`` (the TF1
    iterator ``instance``, which may be initialized with several datasets):
    the iterator is noted with its dataset, whose functions its ``get_next``
    runs (``graph_next_element``). Always on: the iterator may be made before
    the tape opens."""
    result = wrapped(*args, **kwargs)
    if isinstance(instance, iterator_ops.Iterator):
        iterator, dataset = instance, kwargs.get("dataset", args[0] if args else None)
    else:
        iterator, dataset = result, instance
    if isinstance(iterator, iterator_ops.Iterator) and isinstance(dataset, dataset_ops.DatasetV2):
        try:
            _graph_sources.setdefault(iterator, []).append(dataset)
            # (Kept with the graph: a feedable iterator may be fed the handle of
            # an iterator whose Python object is gone.)
            _graph_datasets.setdefault(_graph_of(iterator), []).append(dataset)
        except TypeError:
            pass  # not weakly referable
        if _graph_of(iterator) in _feedable and not _idle():
            # A feedable iterator's get_next in this graph may be fed its handle.
            writes = _dataset_writes(dataset)
            if writes:
                _refuse_in_unordered_graph(writes, _context(writes, _FEEDABLE))
    return result


_graph_sources: "weakref.WeakKeyDictionary[Any, List[Any]]" = weakref.WeakKeyDictionary()
_graph_datasets: "weakref.WeakKeyDictionary[Any, List[Any]]" = weakref.WeakKeyDictionary()
# The graphs in which a feedable iterator's (``Iterator.from_string_handle``)
# get_next was built: it runs the functions of whichever iterator's handle is
# fed, any of the graph's.
_feedable: "weakref.WeakSet[Any]" = weakref.WeakSet()
_FEEDABLE = "a feedable iterator's get_next (Iterator.from_string_handle), which may be fed this iterator's handle"
_FROM_HANDLE = ("IteratorFromStringHandle", "IteratorFromStringHandleV2")


def _graph_of(iterator: Any) -> Any:
    return getattr(getattr(iterator, "_iterator_resource", None), "graph", None)


def _feedable_writes(iterator: Any) -> List[_functions.Write]:
    """For a feedable TF1 iterator (``from_string_handle``), the writes of
    every dataset of the TF1 iterators made in its graph (it may be fed any
    one's handle; one made later is refused when made: ``graph_iterator``)."""
    resource: Any = getattr(iterator, "_iterator_resource", None)
    if getattr(getattr(resource, "op", None), "type", None) not in _FROM_HANDLE:
        return []
    _feedable.add(resource.graph)
    return [w for dataset in _graph_datasets.get(resource.graph, ()) for w in _dataset_writes(dataset)]


def graph_next_element(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``Iterator.get_next`` and ``get_next_as_optional`` of a TF1 iterator:
    the op built runs its datasets' functions, refused (in a TF1 graph, with a
    tape open in this thread) where they write."""
    if _idle():
        return wrapped(*args, **kwargs)
    writes = [w for dataset in _graph_sources.get(instance, ()) for w in _dataset_writes(dataset)]
    if writes:
        _refuse_in_unordered_graph(writes, _context(writes, "a TF1 iterator's get_next"))
    feedable = _feedable_writes(instance)
    if feedable:
        _refuse_in_unordered_graph(feedable, _context(feedable, _FEEDABLE.split(",")[0]))
    return wrapped(*args, **kwargs)


# Per thread, for each ``tf.function`` call running (its trace included), the
# datasets and iterators among its arguments whose functions write: whether
# each is an iterator, its element spec, and the writes.
_calls = threading.local()
Passed = Tuple[bool, Any, List[_functions.Write]]


def given_writes() -> List[_functions.Write]:
    """The writes of the datasets and iterators given to the ``tf.function``
    call running now in this thread (``function_call``): the call's, not its
    graph's (one concrete function serves every dataset of an element spec)."""
    stack = getattr(_calls, "stack", None)
    return [w for _, _, writes in stack[-1] for w in writes] if stack else []


def _passed_writes(component: Any, spec: Any, iterator: bool) -> List[_functions.Write]:
    """Inside the trace of a ``tf.function`` call, the writes of the dataset
    (or iterator) argument whose placeholder ``component`` is. The trace
    does not say which argument a placeholder stands for: any argument of
    the same kind and element spec may be it, so the writes of all such."""
    if executing_eagerly() or getattr(getattr(component, "op", None), "type", None) != "Placeholder":
        return []
    stack = getattr(_calls, "stack", None)
    if not stack:
        return []
    # (A raw variant argument's spec is unknown (None): it may be any.)
    found = stack[-1]
    return [w for kind, passed, writes in found if kind == iterator and passed in (spec, None) for w in writes]


def _arguments_writes(arguments: Any, depth: int = 0) -> List[Passed]:
    """The datasets and iterators among a call's arguments (nested in
    lists, tuples, dicts, and in composite tensors: ``tf.distribute``'s
    distributed datasets and iterators hold them), each whose functions
    write, with those writes."""
    found: List[Passed] = []
    try:
        leaves = nest.flatten(arguments)
    except (TypeError, ValueError):
        return found  # TensorFlow's own binding of the call raises
    for leaf in leaves:
        if isinstance(leaf, dataset_ops.DatasetV2):
            writes, iterator = _dataset_writes(leaf), False
        elif isinstance(leaf, iterator_ops.OwnedIterator):
            writes, iterator = _iterator_writes(leaf), True
        elif isinstance(leaf, ops.EagerTensor):
            # A dataset's raw variant, rebuilt inside with from_variant. (No
            # eager tensor is a composite: the costly check below is skipped.)
            writes = _dataset_graphs.unlisted_writes(leaf) if leaf.dtype is dtypes.variant else []
            if writes:
                found.append((False, None, writes))
            continue
        else:
            if isinstance(leaf, composite_tensor.CompositeTensor) and depth < _DEPTH:
                found += _composite_writes(leaf, depth)
            continue
        if writes:
            found.append((iterator, leaf.element_spec, writes))
    return found


def _composite_writes(leaf: Any, depth: int) -> List[Passed]:
    """``_arguments_writes`` of a composite tensor's components: only of
    tf.data's and tf.distribute's own (a ragged or sparse tensor holds no
    dataset, and building its type spec at each call would cost), cached
    per object (what it holds does not change)."""
    if not type(leaf).__module__.startswith(_HOLDERS):
        return []
    cached = _composites.get(leaf)
    if cached is not None:
        return cached
    try:
        components = leaf._type_spec._to_components(leaf)
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return []
    found = _arguments_writes(components, depth + 1)
    if executing_eagerly():  # (a graph's placeholders stand for any argument)
        try:
            _composites[leaf] = found
        except TypeError:
            pass  # not weakly referable
    return found


_HOLDERS = ("tensorflow.python.distribute.", "tensorflow.python.data.")
_composites: "weakref.WeakKeyDictionary[Any, List[Passed]]" = weakref.WeakKeyDictionary()

# How deep composite arguments are searched for datasets (a distributed
# iterator: its workers' iterators, their multi-device iterator, its devices').
_DEPTH = 4


def function_call(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``Function._call`` and ``ConcreteFunction.__call__``: a
    ``tf.function`` called with its Python arguments. A dataset or iterator passed runs its functions inside the
    function's graph, where they are not among the graph's own (the graph
    sees a placeholder): their writes are the function's writes, refused or
    cut at the call as those of a function that writes, and, in the trace,
    where an iterator or reduce runs them (``_passed_writes``). Always on:
    the tape may open inside the function. (In a tape's graph, a function
    that writes is traced inline: ``_functions.inline``.)"""
    found = _arguments_writes((args, kwargs))
    stack = _calls.__dict__.setdefault("stack", [])
    stack.append(found)
    try:
        if not found or _idle():
            return _functions.inline(wrapped, instance, args, kwargs)
        writes = [w for _, _, passed in found for w in passed]
        name = getattr(instance, "_name", None) or getattr(instance.graph, "name", "function")
        where = f"tf.function {name!r}, which was given the dataset or iterator as an argument"
        return _guarded(writes, where, lambda: _functions.inline(wrapped, instance, args, kwargs))
    finally:
        stack.pop()


_context = _dataset_graphs.context


def _probe_bodies(dataset: Any) -> None:
    """Pulled in a tape's graph (traced now): the py_function bodies of the
    dataset's functions, traced where it was made, run for that graph from
    now on, and no tape is open when it runs: probed at every run
    (``_py_functions.probe_always``)."""
    if dataset is None or executing_eagerly():
        return
    found = _branches.call_context()
    if found is None or found[0].key is None:
        return
    for graph in _function_graphs(dataset, set()):
        _py_functions.probe_always(graph)


def _function_graphs(dataset: Any, seen: Set[int]) -> List[Any]:
    """The graphs of the functions ``dataset`` and its inputs run, and of
    the functions those call, each once."""
    graphs: List[Any] = []
    try:
        functions, inputs = dataset._functions(), dataset._inputs()
    except (AttributeError, NotImplementedError):
        return graphs
    pending = [getattr(getattr(w, "function", None), "graph", None) for w in functions]
    while pending:
        graph = pending.pop()
        if graph is None or id(graph) in seen:
            continue
        seen.add(id(graph))
        graphs.append(graph)
        pending += [g for op in graph.get_operations() for g in _functions._called_graphs(op, graph)]
    for parent in inputs:
        if isinstance(parent, dataset_ops.DatasetV2):
            graphs += _function_graphs(parent, seen)
    return graphs


def next_element(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``OwnedIterator._next_internal`` and ``get_next_as_optional``: the
    element's functions run now (or ran ahead, prefetched)."""
    if _idle():
        return wrapped(*args, **kwargs)
    _probe_bodies(getattr(instance, "_dataset", None))
    try:
        return _run(_iterator_writes(instance), "an iterator's next element", wrapped, args, kwargs)
    except tf.errors.UnknownError as error:
        # A py_function body (from_generator's generator) refused (_py_functions).
        refusal = _py_functions.refusal_in(error)
        if refusal is None:
            raise
        raise refusal from error


Hook = Callable[[Callable[..., Any], Any, Any, Any], Any]


def _runs_dataset(where: str) -> Hook:
    """The hook of a ``Dataset`` method that runs the dataset's functions now
    (all its elements, or its one): ``where`` names it in refusals."""

    def hook(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        if _idle():
            return wrapped(*args, **kwargs)
        _probe_bodies(instance)
        writes = _dataset_writes(instance)
        return _run(writes, where, wrapped, args, kwargs)

    hook.__name__ = hook.__qualname__ = f"runs_{where.rsplit('.', 1)[-1]}"
    hook.__doc__ = f"``{where}``: the dataset's functions run now."
    return hook


single_element = _runs_dataset("Dataset.get_single_element")
# (Its shard_func, traced inside, is found at the op: ``save_op``.)
save_dataset = _runs_dataset("Dataset.save")


def reduce_dataset(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``Dataset.reduce``: its input's functions and the reduce function run
    now. The reduce function is traced inside ``reduce`` (an autograph
    ``for`` loop over a dataset in a ``tf.function`` is one, its body the
    reduce function), so its writes are found at the op that runs it."""
    if _idle():
        return wrapped(*args, **kwargs)
    _probe_bodies(instance)
    token = _pending.__dict__.setdefault("stack", [])
    token.append(_dataset_writes(instance))
    try:
        return wrapped(*args, **kwargs)
    finally:
        token.pop()


def _op_function(function_arg: str, handles_arg: str, position: int, where: str, pending: bool) -> Hook:
    """The hook of a dataset op that runs one function, traced just before
    by the Python method that builds the op (``reduce``'s reduce function,
    ``save``'s shard_func): its writes, from its graph given the op's list
    ``handles_arg`` (argument ``position``) as its last inputs, and, if
    ``pending``, the input dataset's (noted by ``reduce_dataset``)."""

    def hook(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        if _idle():
            return wrapped(*args, **kwargs)
        stack = getattr(_pending, "stack", None)
        writes = list(stack[-1]) if pending and stack else []
        function = kwargs.get(function_arg)
        handles = kwargs.get(handles_arg, args[position] if len(args) > position else None)
        if function is not None and getattr(function, "graph", None) is not None and handles is not None:
            captured = list(handles)
            graph = function.graph
            writes += _functions.function_writes(function, [None] * (len(graph.inputs) - len(captured)) + captured)
        return _run(writes, where, wrapped, args, kwargs)

    hook.__name__ = hook.__qualname__ = f"{function_arg}_op"
    hook.__doc__ = f"The op of ``{where}``: its function's writes."
    return hook


# ``gen_dataset_ops.reduce_dataset``: the reduce function, after its input's.
reduce_op = _op_function("f", "other_arguments", 2, "Dataset.reduce", pending=True)
# ``gen_experimental_dataset_ops.save_dataset``: ``Dataset.save``'s shard_func.
save_op = _op_function("shard_func", "shard_func_other_args", 2, "Dataset.save's shard_func", pending=False)


# -- datasets that run ahead ---------------------------------------------------
# From an iterator's making on, tf.data may run a dataset's functions ahead of
# the elements asked for, in its own threads (a prefetch, autotune's injected
# one, a parallel map or interleave): a write there may land at any time while
# the iterator lives, with no call here to refuse it at. So every tape open
# meanwhile refuses its first read of a variable such an iterator writes
# (``_versions.note_unseen_writer``): the tape has not read it yet, and must
# not, since it could not tell which version it reads.

# The live iterators whose datasets write and run ahead, each with the writes.
_ahead: "weakref.WeakKeyDictionary[Any, List[_functions.Write]]" = weakref.WeakKeyDictionary()

_AHEAD_FIXES = (
    "Make the write in the tape's own code instead of the dataset's functions, delete the "
    "iterator before the tape opens, or keep tf.data from running ahead: no prefetch and no "
    "num_parallel_calls, and options.autotune.enabled = False with "
    "options.experimental_optimization.inject_prefetch = False (dataset.with_options(options))."
)


def _runs_ahead(dataset: Any) -> bool:
    """Whether tf.data may run ``dataset``'s functions ahead, in the
    background: autotune (on unless the options, the whole pipeline's, turn
    it off) injects a prefetch; or a prefetch or parallel transformation in
    it or its inputs."""
    try:
        options = dataset.options()
        if options.autotune.enabled is not False and options.experimental_optimization.inject_prefetch is not False:
            return True
    except (AttributeError, NotImplementedError):
        pass
    return _ahead_stage(dataset)


def _ahead_stage(dataset: Any) -> bool:
    name = type(dataset).__name__
    if "Prefetch" in name or "Parallel" in name:
        return True
    try:
        inputs = dataset._inputs()
    except (AttributeError, NotImplementedError):
        return False
    return any(_ahead_stage(d) for d in inputs if isinstance(d, dataset_ops.DatasetV2))


def made_iterator(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``OwnedIterator.__init__``: made while a tape is open here, an iterator
    whose dataset writes and runs ahead is refused (its functions would start
    at once, unseen); made eagerly, it is noted for every tape open while it
    lives (``note_ahead``). Always on: the iterator is often made before the
    tape (a training loop's)."""
    dataset = kwargs.get("dataset", args[0] if args else None)
    if not isinstance(dataset, dataset_ops.DatasetV2) or not executing_eagerly():
        return wrapped(*args, **kwargs)  # (in a graph, its next element is refused)
    writes = [w for w in _dataset_writes(dataset) if w[0] is not None]
    if not writes or not _runs_ahead(dataset):
        wrapped(*args, **kwargs)
        _note_made(instance)
        return None
    if not _idle():
        where = "the making of an iterator, from which tf.data runs them ahead, in the background"
        _guarded(writes, where, lambda: wrapped(*args, **kwargs))
    else:
        wrapped(*args, **kwargs)
    _note_made(instance)
    try:
        _ahead[instance] = writes
    except TypeError:
        return None  # not weakly referable
    for scope in list(_registry._all_scopes):
        note_ahead(scope)
    return None


def note_ahead(scope: Any) -> None:
    """A tape open in ``scope`` (entered, or open when the iterator was
    made): its first read of a variable a live iterator's dataset writes
    ahead is refused."""
    for iterator, writes in list(_ahead.items()):
        for var, op_type in _functions.variables_written(scope, writes):
            own = _versions.canonical_handle(var)
            if id(own) in scope.unnamed:
                continue
            refusal = (
                f"Variable {var.name!r} is written ({op_type}) by {_context(writes, 'an iterator made before')}, "
                "which tf.data runs ahead of the elements asked for, in its own threads, while this "
                "AssignAwareTape is open: the tape cannot see those writes, so a read here could "
                "credit the version from before one, a silently wrong gradient. " + _AHEAD_FIXES
            )
            _refusals.note_unseen_writer(scope, own, op_type, refusal)
        del iterator


# -- iterators captured by functions traced before import ------------------------
# A function that pulls from an iterator it captured notes the iterator's
# writes when traced (``_guarded``, from the iterator's next element); one
# traced before ``import assigntape`` noted nothing, and its graph holds only
# the iterator's resource. The iterator's Python object still holds its
# dataset: found from the resource, among the iterators made since import
# (``_made``) or, for one made before, among the resource's referrers.

# id(an eager iterator's resource) -> the iterator, for those made since import.
_made: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def _note_made(iterator: Any) -> None:
    resource = getattr(iterator, "_iterator_resource", None)
    if resource is not None:
        try:
            _made[id(resource)] = iterator
        except TypeError:
            pass  # not weakly referable: found among the referrers


def captured_iterator_writes(function: Any, captured: List[Any]) -> List[_functions.Write]:
    """The writes of the datasets of the iterators a concrete function
    captured and pulls from (``captured``: its captured inputs), cached per
    function (its captures do not change)."""
    return _dataset_graphs.per_function(_captured, function, lambda: _find_captured(function, captured))


def _find_captured(function: Any, captured: List[Any]) -> List[_functions.Write]:
    inputs = list(function.graph.inputs)
    offset = len(inputs) - len(captured)
    found: List[_functions.Write] = []
    for i, handle in enumerate(captured):
        if offset + i >= 0 and _pulled(inputs[offset + i], function.graph):
            iterator = _iterator_of(handle)
            if iterator is not None:
                found += _iterator_writes(iterator)
    return found


_captured: "weakref.WeakKeyDictionary[Any, List[_functions.Write]]" = weakref.WeakKeyDictionary()


def _pulled(placeholder: Any, graph: Any) -> bool:
    """Whether a resource input of ``graph`` is used by an iterator op, or
    passed to a function (a loop body, a nested call) that may be one: not a
    variable's, a table's, ... (only read or written in the graph itself)."""
    if placeholder.dtype != dtypes.resource:
        return False
    return any(
        "Iterator" in op.type or (op.type not in _functions._PLAIN_OPS and _functions._called_graphs(op, graph))
        for op in placeholder.consumers()
    )


def _not_an_iterator(handle: Any) -> bool:
    """Whether ``handle`` is known not to be an iterator's resource without
    searching the heap (``gc.get_referrers`` walks every object: in a large
    process, seconds per function): a variable's handle, which carries its
    value's dtype as handle data (an iterator's carries none)."""
    if _versions.variable_of_handle(handle) is not None:
        return True
    data = getattr(handle, "_handle_data", None)
    return bool(
        data is not None
        and data.is_set
        and data.shape_and_type
        and all(s.dtype != dtypes.variant.as_datatype_enum for s in data.shape_and_type)
    )


def _iterator_of(handle: Any) -> Any:
    """The ``OwnedIterator`` whose resource ``handle`` is, if one lives."""
    if not isinstance(handle, ops.EagerTensor):
        return None
    found = _made.get(id(handle))
    if found is not None and getattr(found, "_iterator_resource", None) is handle:
        return found
    if _not_an_iterator(handle):
        return None
    # Made before import: its object refers to the resource (directly, or
    # through its ``__dict__``). Searched once per function (cached above).
    referrers = gc.get_referrers(handle)
    for holder in referrers + [h for r in referrers if type(r) is dict for h in gc.get_referrers(r)]:
        if isinstance(holder, iterator_ops.OwnedIterator) and holder.__dict__.get("_iterator_resource") is handle:
            return holder
    return None


_functions.captured_iterators = captured_iterator_writes
