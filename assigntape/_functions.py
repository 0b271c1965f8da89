"""``tf.function``s called from a tape.

A function keeps the handles it captured when it was traced: the variables' own,
not their current versions. At call time those captures are mapped to the
current versions, so the function reads, and the gradient reaches, what the tape
wrote. Writes inside the function (or in functions it calls, or in its
control-flow bodies) happen out of the tape's sight: they are found from the
graph, once per function. Called from an eager tape, such a function is refused
(or cut) before it runs. Called in the graph where a tape is open (a library's
step function inside the user's compiled step), its Python body is traced there
instead, inline, as if undecorated, so that the tape follows its writes
(``inline``).
"""

from __future__ import annotations

import re
import threading
import weakref
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from assigntape import (
    _branches,
    _control_gradients,
    _dataset_graphs,
    _refusals,
    _registry,
    _resuming,
    _rules,
    _segment_checks,
    _threads,
    _versions,
)
from assigntape._errors import ControlFlowWriteError
from assigntape._tf import (
    Function,
    autograph_api,
    autograph_converter,
    dtypes,
    executing_eagerly,
    nest,
    ops,
    resource_variable_ops,
    tensor_array_ops,
    tensor_lib,
    variable_utils,
)
from assigntape._wrapping import bind

__all__ = [
    "call_function",
    "inline",
    "vectorized",
    "cut_writes",
    "function_writes",
    "note_hidden_writes",
    "outside_writes",
    "refuse_writes",
    "running_under_tape",
    "variables_written",
]


def _written_inputs(function: Any) -> Dict[int, str]:
    """Positions of the function's inputs that ops in its graph write, each with
    the type of one op that writes it (cached)."""
    cached = _function_writes.get(function)
    if cached is None:
        cached = _function_writes[function] = _graph_writes(function.graph)
    return cached


def _writes_anything(op_type: str) -> bool:
    # Refused writes include ops with no Python wrapper (XlaLaunch, TPU
    # launches): a graph is the only place the tape can meet them.
    return op_type in _rules.RULES or _rules.refused(op_type)


def _called_graphs(op: Any, graph: Any) -> List[Any]:
    """The graphs of the functions an op runs: a call's callee, cond branches,
    loop bodies (attributes holding a function or a list of them)."""
    names = []
    for value in op.node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names += [f.name for f in value.list.func]
    found = (_function_named(graph, name) for name in names)
    return [f.graph for f in found if f is not None and getattr(f, "graph", None) is not None]


def _function_named(graph: Any, name: str) -> Optional[Any]:
    """The function ``name`` that an op of ``graph`` calls: registered in
    ``graph`` or in a graph around it. (A cond or loop traced while two
    recorders watch its inputs is wrapped in a function of its own,
    ``cflow_gradient_wrapper``, whose graph keeps no functions: its branches
    or bodies are registered in the graph the wrapper was traced in.)"""
    while graph is not None:
        found = graph._get_function(name) if hasattr(graph, "_get_function") else None
        if found is not None:
            return found
        graph = getattr(graph, "outer_graph", None)
    return None


def _graph_writes(graph: Any) -> Dict[int, str]:
    """Positions of ``graph.inputs`` written by its ops, or by the functions
    they call, however deeply, each with a writing op's type (cached per graph)."""
    cached = _graph_writes_cache.get(graph)
    if cached is not None:
        return cached
    position = {id(t): i for i, t in enumerate(graph.inputs)}
    written: Dict[int, str] = {}
    # (A variable's initialization, made with it in the trace: not a write.)
    initializing = _registry.initializer_ops.get(graph, ())
    for op in graph.get_operations():
        if op.name in initializing:
            continue
        if op.type in _PASSES_HANDLES:
            # A handle passed on stands for its input: what writes it writes that.
            for t, out in zip(op.inputs, op.outputs):
                if id(t) in position and t.dtype == dtypes.resource:
                    position[id(out)] = position[id(t)]
            continue
        if _writes_anything(op.type):
            for t in op.inputs:
                # (Only a resource is written: the written value may be an input too.)
                if id(t) in position and t.dtype == dtypes.resource:
                    written.setdefault(position[id(t)], op.type)
            continue
        callees = _called_graphs(op, graph) if op.type not in _PLAIN_OPS else []
        if not callees:
            continue
        if op.type in ("PartitionedCall", "StatefulPartitionedCall") and len(callees) == 1:
            # A call passes its inputs to the callee's, one for one.
            for i, op_type in _graph_writes(callees[0]).items():
                if i < len(op.inputs) and id(op.inputs[i]) in position:
                    written.setdefault(position[id(op.inputs[i])], op_type)
        elif len(callees) == 1 and _passes_last(op, callees[0], "other_arguments", position, written):
            pass
        elif op.type in _CONTROL_FLOW_OPS and all(_passes_last(op, g, "input", position, written) for g in callees):
            # Each branch, or the loop's condition and body, takes the op's
            # inputs one for one: an input only read there is not written
            # (named in a refusal, or cut, in place of the one written).
            pass
        else:
            inner = [w for g in callees for w in _graph_writes(g).values()]
            if inner:
                # Control flow maps inputs to bodies in op-specific ways: count every
                # resource it is given as written.
                for t in op.inputs:
                    if t.dtype == dtypes.resource and id(t) in position:
                        written.setdefault(position[id(t)], inner[0])
    _graph_writes_cache[graph] = written
    return written


def _passes_last(op: Any, callee: Any, arg_name: str, position: Dict[int, int], written: Dict[int, str]) -> bool:
    """For an op that gives a function of its own the input list ``arg_name`` as
    that function's last inputs (a tf.data dataset op's captured arguments, a
    cond's or loop's inputs):
    notes, as written, the inputs the function writes there, and only those
    (a variable the function only reads is not written). False if the op
    has no such input list."""
    start = 0
    for arg in op.op_def.input_arg:
        if arg.number_attr:
            count = op.get_attr(arg.number_attr)
        elif arg.type_list_attr:
            count = len(op.get_attr(arg.type_list_attr))
        else:
            count = 1
        if arg.name == arg_name:
            passed = op.inputs[start : start + count]
            offset = len(callee.inputs) - count
            if offset < 0:
                return False
            for i, op_type in _graph_writes(callee).items():
                if i >= offset and id(passed[i - offset]) in position:
                    written.setdefault(position[id(passed[i - offset])], op_type)
            return True
        start += count
    return False


# Ops that give each of their functions their input list ``input`` as its inputs.
_CONTROL_FLOW_OPS = frozenset({"If", "StatelessIf", "Case", "StatelessCase", "While", "StatelessWhile"})

# Ops whose outputs are their inputs (a handle among them names the same resource).
_PASSES_HANDLES = frozenset({"Identity", "IdentityN"})

# Ops that are common in function graphs and never call functions: skipping them
# saves parsing their attributes.
_PLAIN_OPS = frozenset({"Placeholder", "Const", "Identity", "NoOp", "ReadVariableOp", "MatMul", "Mul", "AddV2", "Sub"})
_graph_writes_cache: "weakref.WeakKeyDictionary[Any, Dict[int, str]]" = weakref.WeakKeyDictionary()
_function_writes: "weakref.WeakKeyDictionary[Any, Dict[int, str]]" = weakref.WeakKeyDictionary()


def _variable_behind(instance: Any, handle: Any, scope: Any) -> Optional[Any]:
    """The variable whose handle a function was given or captured, if known."""
    if scope is not None:
        var = scope.canonical.get(id(handle))
        if var is None:
            var = scope.owners.get(id(handle))
        if var is not None:
            return var
    try:
        variables = instance.graph.variables
    except AssertionError:
        # A captured variable's Python object is gone; TensorFlow's own call
        # raises the same error under any tape.
        return None
    for v in variables:
        if isinstance(v, resource_variable_ops.BaseResourceVariable) and _versions.canonical_handle(v) is handle:
            return v
    # A graph that did not list it (a tf.data function's): the variable whose
    # own handle it is.
    return _versions.variable_of_handle(handle)


def _name(instance: Any) -> str:
    # The graph is named after the Python function; the function itself after
    # the graph, with TensorFlow's prefix and a counter.
    return str(instance.graph.name)


# What to do instead, for a function whose writes the tape cannot follow. The
# last resort works for a function the user does not own (a library's step
# function, as in ``tfp.math.minimize``): run_functions_eagerly makes every
# tf.function run its Python body, whose writes the tape follows.
_EAGERLY = (
    "or, for a function you cannot edit (a library's), run tf.functions eagerly: tf.config.run_functions_eagerly(True)."
)
FUNCTION_FIXES_EAGER = "Open the tape inside the function, call the function outside the tape, " + _EAGERLY
FUNCTION_FIXES_GRAPH = (
    "Inline the write (call the Python function undecorated), write in tf.cond branches or "
    "tf.while_loop bodies, which the tape follows, open the tape inside the body, " + _EAGERLY
)

# A function restored from a SavedModel runs its saved graph even with
# run_functions_eagerly(True) and has no Python body to inline.
RESTORED_FIXES = (
    "It is restored from a SavedModel: it has no Python body to inline and runs its saved graph even "
    "with tf.config.run_functions_eagerly(True). Call it outside the tape (its write then has no "
    "gradient path), or re-create the model from its Python code to differentiate through the write."
)


def _restored(instance: Any) -> bool:
    """Whether ``instance`` was loaded from a SavedModel (``tf.saved_model.load``'s
    concrete functions, or the trace of its restored function's body)."""
    return type(instance).__name__ == "_WrapperFunction" or _name(instance) == "restored_function_body"


def call_function(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``ConcreteFunction._call_flat``, in an eager tape or in a tape's graph.

    A function keeps the handles it captured when it was traced: the variables'
    own (a function traced inside a tape's graph captures them too, see
    ``_registry._enclosing_scope``). Map each to the variable's current
    version, so that the function reads it and the gradient reaches it. A
    function that writes a variable is refused (or, eagerly, cut): its writes
    happen inside its graph, out of the tape's sight.
    """
    found = _branches.call_context()
    if found is None and not (_resuming.closed_tapes or _registry.any_scopes()):
        return wrapped(*args, **kwargs)
    arguments = bind(("tensor_inputs", "captured_inputs"), args, kwargs)
    tensor_inputs = list(arguments["tensor_inputs"])
    captured_in = list(arguments["captured_inputs"])
    if found is None:
        outside = _not_initializing(
            function_writes(instance, tensor_inputs + captured_in) + captured_iterators(instance, captured_in)
        )
        if outside:
            outside_writes(outside, _context(instance))
        return wrapped(*args, **kwargs)
    scope, branch = found
    if scope.unnamed:
        # A function reads its captures directly, not through v.handle.
        for h in captured_in:
            if id(h) in scope.unnamed:
                _refusals.refuse_unnamed(scope, _variable_behind(instance, h, scope), h)
    if scope.dirty:
        # A variable written while this tape was closed, first read here (the
        # function reads its capture, not v.handle): its version now.
        for h in captured_in:
            if id(h) in scope.dirty:
                var = _variable_behind(instance, h, scope)
                if var is not None:
                    _resuming.cut_on_first_read(scope, var, h)
    if isinstance(scope.owners, _segment_checks.TouchLog):
        # In a checkpointed step: what the function captures is copied before it runs.
        scope.owners.note_captures(captured_in)
    captured = [
        h if v is None else _branches.version_in(scope, branch, v)
        for h, v in ((h, scope.canonical.get(id(h))) for h in captured_in)
    ]
    found_writes = _not_initializing(
        function_writes(instance, tensor_inputs + captured_in) + captured_iterators(instance, captured_in)
    )
    unlisted = [w for w in found_writes if w[0] is None]
    if len(unlisted) == len(found_writes):
        # Datasets known only by their variant: noted by the trace, or captured
        # by a function whose trace noted nothing (traced before import assigntape).
        unlisted += _dataset_graphs.captured_writes(instance, captured_in)
        _dataset_graphs.refuse_unlisted(scope.key is not None, unlisted, _context(instance))
    writes = [] if _wrapping_a_cond_being_built(instance) else variables_written(scope, found_writes)
    if not writes:
        return _run_under_tape(instance, wrapped, tensor_inputs, captured)
    if scope.key is not None and _inlining():
        raise _Inline()
    context = _context(instance)
    fixes = (RESTORED_FIXES,) * 2 if _restored(instance) else (FUNCTION_FIXES_EAGER, FUNCTION_FIXES_GRAPH)
    refuse_writes(scope, writes, context, *fixes)
    result = _run_under_tape(instance, wrapped, tensor_inputs, captured)
    cut_writes(scope, writes, context)
    return result


def initializing(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``Function._initialize_uninitialized_variables``: after the first trace
    of a ``tf.function`` that made variables, TensorFlow calls a function of
    its own (``initialize_variables``) that gives them their first values,
    lifted out of the trace. That is creation, not a write a tape
    differentiates (semantics, rule 5; ``_serving.constructing`` for the
    same write left in the trace): its writes of those variables are not
    the function's writes (they were refused, and the variables stayed
    uninitialized for good). Any other write it makes (an initial value
    computed by writing another variable) is, as anywhere."""
    initializers = args[0] if args else kwargs.get("initializers", ())
    handles = {id(v.__dict__.get("_handle")) for v, _ in initializers or ()}
    saved: FrozenSet[int] = getattr(_initializing, "handles", frozenset())
    _initializing.handles = saved | frozenset(handles)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _initializing.handles = saved


_initializing = threading.local()


def _not_initializing(writes: List[Write]) -> List[Write]:
    """``writes`` but those of variables TensorFlow is giving their first
    values (``initializing``)."""
    handles = getattr(_initializing, "handles", None)
    if not handles:
        return writes
    return [w for w in writes if id(w[0]) not in handles]


def _wrapping_a_cond_being_built(instance: Any) -> bool:
    """Whether ``instance`` is the function call TensorFlow puts around a cond,
    case or loop (``cflow_gradient_wrapper``) that ``_control_flow`` is
    building now in a tape's graph: its branches' writes leave it as the
    values the cond returns, which make the variables' next versions after it
    (followed, not out of the tape's sight)."""
    graph = instance.graph
    if not str(graph.name).startswith(_control_gradients._WRAPPER):
        return False
    building = {id(b.graph) for branches in _control_gradients._pending for b in branches}
    if getattr(_control_gradients._carrying_now, "depth", 0):
        building.update(id(g) for g in _control_gradients._writing_bodies)
    return any(
        id(g) in building
        for op in graph.get_operations()
        if op.type in _CONTROL_FLOW_OPS
        for g in _called_graphs(op, graph)
    )


# The graphs of the functions running now for a thread with a tape open, and
# of those they call, each with how many such calls run: a ``tf.py_function``
# traced in one of them probes its body for writes only then (``_py_functions``),
# not while some other thread has a tape open.
_running: Dict[int, int] = {}
_running_lock = threading.Lock()
_graphs_below: "weakref.WeakKeyDictionary[Any, Tuple[int, ...]]" = weakref.WeakKeyDictionary()


def _run_under_tape(instance: Any, wrapped: Callable[..., Any], tensor_inputs: Any, captured: Any) -> Any:
    if not executing_eagerly():
        return wrapped(tensor_inputs, captured)  # a call op: nothing runs now
    keys = _below(instance.graph)
    with _running_lock:
        for key in keys:
            _running[key] = _running.get(key, 0) + 1
    try:
        return wrapped(tensor_inputs, captured)
    finally:
        with _running_lock:
            for key in keys:
                left = _running.pop(key, 1) - 1
                if left:
                    _running[key] = left


def _below(graph: Any) -> Tuple[int, ...]:
    """The ids of ``graph`` and of every graph its ops call, however deeply (cached)."""
    found = _graphs_below.get(graph)
    if found is None:
        seen: Dict[int, Any] = {}
        stack = [graph]
        while stack:
            g = stack.pop()
            if id(g) not in seen:
                seen[id(g)] = g
                for op in g.get_operations():
                    if op.type not in _PLAIN_OPS:
                        stack.extend(_called_graphs(op, g))
        found = _graphs_below[graph] = tuple(seen)
    return found


def running_under_tape(graph: Any) -> bool:
    """Whether ``graph`` (a function's, or a body in one, traced earlier) runs
    now in a function called from a thread with a tape open."""
    while graph is not None:
        if id(graph) in _running:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _refuse_uninitialized(function: Any) -> None:
    """Before ``inline`` traces ``function``'s body in place of its call: the
    variables its own first trace made must have their values. TensorFlow
    gives them those in the call it makes, which is not made when the value
    depends on an argument (an initializing cond in the function's graph):
    inlined, the variable stayed uninitialized, and reads gave an empty
    tensor, silently."""
    made = [ref() for ref in getattr(function, "_created_variables", None) or ()]
    with ops.init_scope():
        for var in made:
            if var is not None and not bool(resource_variable_ops.var_is_initialized_op(var.handle)):
                raise ControlFlowWriteError(
                    f"tf.function {function.name!r}, which writes a variable the tape follows, is "
                    f"traced inline in the tape's tf.function, and its first call made variable "
                    f"{var.name!r} from an argument, which only the function's own call initializes. "
                    "Make the variable before the tape's function (call this function once outside "
                    "it), or give it an initial value that does not depend on an argument."
                )


class _Inline(Exception):
    """From ``call_function`` to ``inline``: this call's function writes a
    variable the tape in this graph follows; trace its body here instead.
    Raised before the call puts anything in the graph."""


# Per thread, the graphs in which a ``tf.function`` (one with a Python body)
# is being called now, innermost last (``inline``).
_calls = threading.local()


def _inlining() -> bool:
    """Whether the concrete function about to be called is the one that the
    innermost ``inline`` call made, in this graph. (A function called inside
    that function's own trace is in another graph.)"""
    stack: Optional[List[Any]] = getattr(_calls, "graphs", None)
    return bool(stack and stack[-1] is ops.get_default_graph())


def inline(wrapped: Callable[..., Any], function: Any, args: Any, kwargs: Any) -> Any:
    """``Function._call`` (``wrapped``, called by ``_datasets.function_call``): in the graph of a tape's
    function, a ``tf.function`` that writes a variable the tape follows runs
    its Python body inline, traced in this graph as if it were undecorated
    (converted by AutoGraph if the function would be), so that the tape
    follows its writes: a version made inside the function's own graph could
    not leave it. Such a function is traced once as itself first, to find its
    writes: its Python side effects then happen twice on its first trace. It
    loses its own ``jit_compile`` (the caller's holds)."""
    if executing_eagerly() or not _registry.any_scopes() or not isinstance(function, Function):
        return wrapped(*args, **kwargs)
    stack = _calls.__dict__.setdefault("graphs", [])
    stack.append(ops.get_default_graph())
    try:
        return wrapped(*args, **kwargs)
    except _Inline:
        pass
    finally:
        stack.pop()
    _refuse_uninitialized(function)
    body = function.python_function
    if function.input_signature is not None:
        args = _as_signed(function.input_signature, args)
    if getattr(function, "_autograph", False):
        options = autograph_converter.ConversionOptions(
            recursive=True,
            optional_features=getattr(function, "_experimental_autograph_options", None),
            user_requested=True,
        )
        result = autograph_api.converted_call(body, args, kwargs, options=options)
    else:
        result = body(*args, **kwargs)
    return _as_outputs(result)


def _as_signed(signature: Any, args: Any) -> Any:
    """Positional arguments converted as an input signature converts them
    (Python numbers and arrays to tensors of the spec's dtype)."""

    def convert(spec: Any, value: Any) -> Any:
        dtype = getattr(spec, "dtype", None)
        if dtype is None or isinstance(value, (tensor_lib.Tensor, resource_variable_ops.BaseResourceVariable)):
            return value
        return ops.convert_to_tensor(value, dtype=dtype)

    try:
        return tuple(nest.map_structure(convert, tuple(signature)[: len(args)], tuple(args)))
    except (TypeError, ValueError):
        return args  # a structure the signature does not match: TensorFlow's own error follows in the body


def _as_outputs(result: Any) -> Any:
    """What the function's call would have returned: variables (and a write's
    lazily read result) as tensors, as a trace converts its outputs."""
    result = variable_utils.convert_variables_to_tensors(result)

    def convert(value: Any) -> Any:
        if value is None or isinstance(value, (ops.Operation, tensor_array_ops.TensorArray)):
            return value
        try:
            return ops.convert_to_tensor_or_composite(value)
        except (TypeError, ValueError):
            return value  # (a trace would raise; the body ran, so pass it back as is)

    return nest.map_structure(convert, result, expand_composites=True)


def _context(instance: Any) -> str:
    """The function, as a refusal names it (and what made it, if not the user)."""
    makers = getattr(_makers, "names", None)
    return f"tf.function {_name(instance)!r}" + (f" (made by {makers[-1]})" if makers else "")


# Per thread, what is making the functions called now, when the user did not
# write them (``vectorized``): a refusal names it.
_makers = threading.local()


def vectorized(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``parallel_for.pfor``, which ``tf.vectorized_map`` (and a tape's
    ``jacobian``) call: it traces the user's function into a tf.function of
    its own, called at once."""
    names = _makers.__dict__.setdefault("names", [])
    names.append("tf.vectorized_map (parallel_for.pfor)")
    try:
        with _control_gradients.refusing_forward_mode_failures(
            "A tape's jacobian (or tf.vectorized_map) through a compiled tf.cond or case",
            _control_gradients.REVERSE_INSTEAD,
        ):
            return wrapped(*args, **kwargs)
    except ValueError as error:
        refusal = _unvectorized_write(error)
        if refusal is None:
            raise
        raise refusal from error
    finally:
        names.pop()


# The write op pfor failed to convert, as its error names the op's node
# (``loop_body/AssignVariableOp/pfor/strided_slice``).
_PFOR_NODE = re.compile(r"/(\w+)/pfor/")


def _unvectorized_write(error: ValueError) -> Optional[ControlFlowWriteError]:
    """pfor's error on a write in a tape's graph, named. A body that reads a
    variable after writing it reads the write's new version, a handle the
    loop makes, which pfor cannot vectorize (plain TensorFlow reads the
    variable's own handle there): the error names neither the write nor what
    to do instead."""
    match = _PFOR_NODE.search(str(error))
    if match is None or match.group(1) not in _rules.RULES or not _registry.any_scopes():
        return None
    refusal: ControlFlowWriteError = ControlFlowWriteError(
        f"tf.vectorized_map could not vectorize the {match.group(1)} of a variable in its function, "
        "inside an AssignAwareTape's tf.function: a function that reads a variable after writing it "
        "cannot be vectorized there. Use tf.map_fn (which the tape differentiates), or write the "
        "variable outside the vectorized function."
    )
    return refusal


# A write that runs out of the tape's sight: the handle written (as the
# function was given or captured it), the writing op's type, and the function
# whose graph holds it (to name the variable behind the handle).
Write = Tuple[Any, str, Any]


def function_writes(function: Any, handles: List[Any]) -> List[Write]:
    """The writes of a traced function given ``handles`` (its inputs, then its
    captures, as its graph's inputs are ordered), and those its graph runs
    without showing them (``note_hidden_writes``)."""
    found = [
        (handles[i], op_type, function) for i, op_type in sorted(_written_inputs(function).items()) if i < len(handles)
    ]
    return found + [(h, op_type, function) for h, op_type, _ in _hidden_writes.get(function.graph, ())]


def _no_iterators(function: Any, captured: List[Any]) -> List[Write]:
    return []


# The writes of the datasets of the iterators a function captured, which a
# function traced before ``import assigntape`` did not note (its trace ran no
# hook): ``_datasets.captured_iterator_writes``, set there (it imports this module).
captured_iterators: Callable[[Any, List[Any]], List[Write]] = _no_iterators


def note_hidden_writes(graph: Any, writes: List[Write]) -> None:
    """Notes, on ``graph`` and the graphs it is traced in, writes that ops in
    it run but whose graph is not among its functions: a dataset (made
    outside, and captured) whose functions an iterator or reduce in it runs."""
    while graph is not None:
        if isinstance(graph, ops.Graph):
            try:
                _hidden_writes.setdefault(graph, []).extend(writes)
            except TypeError:
                return
        graph = getattr(graph, "outer_graph", None)


_hidden_writes: "weakref.WeakKeyDictionary[Any, List[Write]]" = weakref.WeakKeyDictionary()


def variables_written(scope: Any, writes: List[Write]) -> List[Tuple[Any, str]]:
    """The differentiable variables behind ``writes``, each once, with an op that writes it."""
    found: Dict[int, Tuple[Any, str]] = {}
    for handle, op_type, function in writes:
        var = _variable_behind(function, handle, scope)
        if var is not None and _versions.differentiable(var):
            found.setdefault(id(var), (var, op_type))
    return list(found.values())


def _recorders_around(scope: Any) -> Tuple[str, str]:
    """What is open around a call in ``scope``, for a refusal's message: the
    phrase, and the noun its advice names ("tape" or "accumulator")."""
    if any(record.keeps_history for record in scope.records):
        return "an AssignAwareTape is open", "tape"
    if scope.records:
        # Only ``assigntape.ForwardAccumulator``s: their internal tapes keep no history.
        return "an assigntape.ForwardAccumulator is open", "accumulator"
    # Held by a plain tape or accumulator only (the AssignAwareTape inside it
    # closed; see _plain_tapes).
    return "a plain tf.GradientTape or ForwardAccumulator that recorded an AssignAwareTape's writes is open", "tape"


def refuse_writes(scope: Any, writes: List[Tuple[Any, str]], context: str, eager_fixes: str, graph_fixes: str) -> None:
    """Before ``context`` runs writes the tape cannot follow: refused (or,
    eagerly and by option, let through, to be ``cut_writes`` after)."""
    for var, op_type in writes:
        if scope.key is not None:
            raise ControlFlowWriteError(
                f"{op_type} to variable {var.name!r} inside {context}, run in the function where "
                f"an AssignAwareTape is open: a version made in {context}'s graph cannot leave it. " + graph_fixes
            )
        around, recorder = _recorders_around(scope)
        if recorder != "tape":
            # The advice names the recorder that is open, not a tape that is not.
            eager_fixes = eager_fixes.replace("the tape", f"the {recorder}")
        _refusals.refuse_or_cut(
            [scope],
            var,
            context,
            f"{context} writes variable {var.name!r} ({op_type}) while {around} around it, and "
            f"such writes happen out of the {recorder}'s sight: reads after it would credit "
            f"the previous version, a silently wrong gradient. " + eager_fixes,
        )


def cut_writes(scope: Any, writes: List[Tuple[Any, str]], context: str) -> None:
    """After ``context`` ran writes ``refuse_writes`` let through: each a new
    version with no gradient path."""
    for var, _ in writes:
        _refusals.cut([scope], var, context)


def outside_writes(writes: List[Write], context: str) -> None:
    """No tape open in this thread's context. A tape open in another thread
    must not see its variables written behind its back (refused, as any
    write from another thread is); a closed tape may be re-entered, so tell it
    which of its variables ``context`` writes."""
    known = [w for w in writes if w[0] is not None]  # (not a dataset's known by its variant only)
    for handle, op_type, _ in known:
        _threads.refuse_other_thread(handle, None, f"{op_type} in {context}")
    for handle, _, _ in known:
        _resuming.note_write_while_closed(handle)
