"""The patches: installed while at least one AssignAwareTape is open anywhere.

Two things are patched, and both are put back, as the exact original objects,
when the last tape in the process closes:

* ``BaseResourceVariable._handle`` gets a data descriptor that answers with the
  current version (see ``_versions``).
* The Python wrappers of the ops that write variables (``gen_*_ops.<op>``, and
  the same functions as ``tf.raw_ops.<Op>``) get a wrapper. For an op with a
  gradient rule in ``_rules.RULES`` it performs the real write, then makes the
  new version and records it on the tape. For the fused optimizer kernels, which
  have no rule, it refuses the write (or cuts the gradient, by option).

Why the op wrappers and not ``Variable.assign`` and friends: every path to a
write ends in one of these functions (``v.assign``, ``v[1:3].assign``,
``v.scatter_*``, ``tf.compat.v1.assign`` / ``scatter_*``, ``state_ops``, raw ops,
checkpoint restore), and TensorFlow calls them through the module attribute, so
one wrapper per op sees them all.
"""

from __future__ import annotations

import functools
import operator
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, List, Sequence, Set, Tuple

import tensorflow as tf
import wrapt
from tensorflow.python import pywrap_tfe
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.eager import context, record
from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction
from tensorflow.python.framework import dtypes, ops
from tensorflow.python.ops import (
    array_ops,
    cond_v2,
    gen_array_ops,
    gen_resource_variable_ops,
    gen_state_ops,
    gen_training_ops,
    handle_data_util,
    math_ops,
    resource_variable_ops,
)

from assigntape import _rules, _versions
from assigntape._errors import UntrackedWriteError

__all__ = ["acquire", "release", "installed"]

_ABSENT = object()
_lock = threading.Lock()
_users = 0
_saved: List[Tuple[Any, str, Any]] = []

_GEN_MODULES = (gen_resource_variable_ops, gen_state_ops, gen_array_ops, gen_training_ops)


def _differentiable(var: Any) -> bool:
    # Integer and bool variables (optimizer iteration counters, step flags) carry
    # no gradient: their writes stay plain TensorFlow.
    return var.dtype.is_floating or var.dtype.is_complex


def _snake(op_name: str, module: Any) -> str:
    """The op wrapper's Python name: ``AssignVariableOp`` -> ``assign_variable_op``."""
    key = op_name.lower()
    for name in vars(module):
        if name.replace("_", "") == key and not name.endswith("_eager_fallback"):
            return name
    raise LookupError(op_name)


def _bind(params: Sequence[str], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    arguments = dict(zip(params, args))
    arguments.update(kwargs)
    return arguments


def _new_version(old: Any, write_result: Any) -> Any:
    """A fresh handle tensor for the same resource, unrecorded.

    It must not be recorded: a recorded Identity would chain the new version to
    the old one whenever the write itself is not recorded (a constant value, or
    nothing watched), leaking gradient to what produced the old value.
    """
    if context.executing_eagerly():
        copy = getattr(old, "_copy_nograd", None)
        if copy is not None:
            # A new EagerTensor for the same handle, without dispatching an op
            # and without recording: ~3 us against ~45 us for tf.identity. The
            # handle's dtype-and-shape data (which gradients w.r.t. a version
            # need) lives on the Python object, so carry it over.
            new = copy(context.context(), old.device)
            handle_data = getattr(old, "_handle_data", None)
            if handle_data is not None:
                new._handle_data = handle_data
            return new
    with record.stop_recording():
        if context.executing_eagerly() or write_result is None:
            return array_ops.identity(old)
        # In a graph, reads through the new handle must run after the write.
        with ops.control_dependencies([write_result]):
            return array_ops.identity(old)


def _tracked_write(op_name: str, rule: _rules.OpRule, params: Sequence[str]) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        arguments = _bind(params, args, kwargs)
        found = _versions.owner(arguments.get(rule.resource_arg))
        if found is None or not _differentiable(found[1]):
            return wrapped(*args, **kwargs)
        scope, var = found
        branch = _versions.check_writable_here(scope, var, op_name)
        for name in rule.value_args:
            arguments[name] = ops.convert_to_tensor(arguments[name], dtype=var.dtype)
        if branch is not None:
            return _branch_write(op_name, rule, wrapped, arguments, branch, var)
        old = scope.current_version(var)
        write = rule.prepare(var, old, arguments)
        # The real write. If it raises (bad shape or dtype, duplicate indices),
        # nothing below runs: the tape and the variable stay as they were.
        if write.checks:
            with ops.control_dependencies(write.checks):
                result = wrapped(**arguments)
        else:
            result = wrapped(**arguments)
        new = _new_version(old, result)
        if write.reads_old:
            # A partial write reads the old value, but a variable that was never
            # read is not watched yet, and an unwatched input is not recorded:
            # its gradient would be lost. (Watching after the write is enough:
            # what counts is that the old handle is watched when recording.)
            resource_variable_ops.variable_accessed(var)
        record.record_operation(op_name, [new], write.inputs, write.backward)
        recorded = not pywrap_tfe.TFE_Py_TapeSetIsStopped()
        scope.advance(var, old, new, _versions.WriteRecord(op_name, recorded=recorded))
        return result

    return wrapper


_BRANCH_VERSION_GRAD = "AssigntapeBranchVersion"


@ops.RegisterGradient(_BRANCH_VERSION_GRAD)
def _branch_version_grad(op: Any, grad_handle: Any, grad_value: Any) -> List[Any]:
    """A branch version's handle is the value written: reads of it send their
    gradient (which arrives at the handle) to that value."""
    grads = [ops.convert_to_tensor(g) for g in (grad_handle, grad_value) if g is not None]
    return [None, math_ops.add_n(grads) if grads else None]


def _branch_write(
    op_name: str, rule: _rules.OpRule, wrapped: Callable[..., Any], arguments: Dict[str, Any], branch: Any, var: Any
) -> Any:
    """A write inside a ``tf.cond`` branch of the tape's graph.

    The real write runs. Beside it, the variable's new value is built from plain
    ops (the functional rewrite of ``_rules.BRANCH_VALUES``, reading the previous
    version), and a branch
    version handle is made whose symbolic gradient goes to that value, so reads
    later in the branch differentiate correctly. The cond returns the value as
    an extra output; ``_cond`` makes the tape's version from it.
    """
    uid = var._unique_id
    old = branch.versions.get(uid)
    if old is None:
        old = branch.scope.current_version(var)
    old_value = gen_resource_variable_ops.read_variable_op(old, var.dtype)
    value = _rules.BRANCH_VALUES[op_name](old_value, arguments)
    if pywrap_tfe.TFE_Py_TapeSetIsStopped() or not any(t._recording for t in branch.scope.tapes):
        # Under stop_recording: a new version with no gradient path, as outside.
        value = array_ops.stop_gradient(value)
    # The rule's checks (duplicate indices) guard the write here as anywhere.
    write = rule.prepare(var, old, arguments)
    with ops.control_dependencies([old_value.op, *write.checks]):
        result = wrapped(**arguments)
    if write.reads_old:
        # As outside a branch: the part kept from the old value needs the
        # variable watched, or a never-read variable's gradient is lost.
        resource_variable_ops.variable_accessed(var)
    with ops.control_dependencies([result]), ops.get_default_graph().gradient_override_map(
        {"IdentityN": _BRANCH_VERSION_GRAD}
    ):
        handle = array_ops.identity_n([old, value])[0]
    handle_data_util.copy_handle_data(old, handle)
    branch.versions[uid] = handle
    branch.values[uid] = (var, value)
    branch.scope.owners[id(handle)] = var
    return result


def _cond(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``cond_v2.cond_v2`` (``tf.cond``, autograph ``if``) in the graph of a tape.

    Each branch also returns the values of the variables it wrote (``Branch``);
    ``_build_cond`` makes both branches return the same set, the other branch
    returning its unchanged value. After the cond, each written variable gets
    a new version whose gradient flows into the cond's output, and from there,
    by the cond's own gradient, into whichever branch ran.
    """
    scope = _versions.graph_scope()
    if scope is None:
        return wrapped(*args, **kwargs)
    arguments = _bind(("pred", "true_fn", "false_fn", "name"), args, kwargs)
    branches: List[Any] = []

    def traced(fn: Callable[[], Any]) -> Callable[[], Any]:
        def branch_fn() -> Any:
            branch = _versions.open_branch(scope)
            branches.append(branch)
            try:
                out = fn()
            finally:
                _versions.close_branch(branch)
            return out, {uid: value for uid, (_, value) in branch.values.items()}

        return branch_fn

    arguments["true_fn"] = traced(arguments["true_fn"])
    arguments["false_fn"] = traced(arguments["false_fn"])
    _pending_conds.append(branches)
    try:
        out, values = wrapped(**arguments)
    finally:
        _pending_conds.remove(branches)
    written = {uid: var for b in branches for uid, (var, _) in b.values.items()}
    for uid in sorted(values):
        var = written[uid]
        old = scope.current_version(var)
        new = _new_version(old, values[uid])
        record.record_operation("If", [new], [values[uid]], lambda g: [g])
        scope.advance(var, old, new, _versions.WriteRecord("tf.cond"))
    return out


_pending_conds: List[List[Any]] = []


def _build_cond(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``cond_v2._build_cond``, for a cond ``_cond`` traced: give both branches
    the same extra outputs, the union of the variables either one wrote."""
    params = _BUILD_COND_PARAMS or _build_cond_params(wrapped)
    arguments = _bind(params, args, kwargs)
    graphs = {id(arguments["true_graph"]), id(arguments["false_graph"])}
    branches = next((b for b in _pending_conds if {id(x.graph) for x in b} == graphs), None)
    if branches is None or arguments.get("building_gradient"):
        return wrapped(*args, **kwargs)
    written = {uid: var for b in branches for uid, (var, _) in b.values.items()}
    for branch in branches:
        graph = branch.graph
        out, values = graph.structured_outputs
        base = graph.outputs[: len(graph.outputs) - len(values)]
        values = dict(values)
        with graph.as_default():
            for uid in written.keys() - values.keys():
                # This branch leaves the variable as it was: its value, read here.
                var = written[uid]
                values[uid] = gen_resource_variable_ops.read_variable_op(
                    branch.scope.current_version(var), var.dtype
                )
        graph.structured_outputs = (out, values)
        graph.outputs[:] = base + [values[uid] for uid in sorted(values)]
    true_graph, false_graph = arguments["true_graph"], arguments["false_graph"]
    arguments["true_inputs"] = true_graph.external_captures
    arguments["false_inputs"] = false_graph.external_captures
    return wrapped(**arguments)


_BUILD_COND_PARAMS: List[str] = []


def _build_cond_params(function: Any) -> List[str]:
    code = function.__code__
    _BUILD_COND_PARAMS[:] = code.co_varnames[: code.co_argcount]
    return _BUILD_COND_PARAMS


def _untracked_write(op_name: str, params: Sequence[str]) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        arguments = _bind(params, args, kwargs)
        hits = [h for h in map(_versions.owner, arguments.values()) if h is not None]
        hits = [(scope, var) for scope, var in hits if _differentiable(var)]
        if not hits:
            return wrapped(*args, **kwargs)
        scope, var = hits[0]
        if scope.refuses_untracked():
            raise UntrackedWriteError(
                f"{op_name} wrote variable {var.name!r}, which an AssignAwareTape is "
                "tracking, and the tape cannot differentiate that op: reads after it "
                "would credit the previous version, a silently wrong gradient. Write "
                "with tracked ops instead (v.assign / assign_add / assign_sub, scatter "
                "and slice writes, or a Keras 3 optimizer, whose steps are made of "
                "them), or pass AssignAwareTape(untracked_writes='cut') to treat this "
                "write as a new version with no gradient path."
            )
        warnings.warn(
            f"AssignAwareTape: {op_name} wrote {var.name!r}; no gradient flows "
            "through that write (untracked_writes='cut').",
            stacklevel=3,
        )
        result = wrapped(*args, **kwargs)
        for scope, var in hits:
            old = scope.current_version(var)
            scope.advance(var, old, _new_version(old, result), _versions.WriteRecord(op_name, cut=True))
        return result

    return wrapper


def _patch_targets() -> List[Tuple[List[Tuple[Any, str]], Any, Callable[..., Any]]]:
    """Each op: where its wrapper is found, the original, and our wrapper."""
    # tf.raw_ops and tf.compat.v2.raw_ops (a separate module holding the same
    # functions, which tf_keras calls). Not tf.compat.v1.raw_ops: it is a
    # TFModuleWrapper with its own attribute cache and a ~20 us __setattr__.
    raw_modules = [tf.raw_ops]
    if tf.compat.v2.raw_ops is not tf.raw_ops:
        raw_modules.append(tf.compat.v2.raw_ops)
    written = list(_rules.RULES)
    written += [
        name
        for name in vars(gen_training_ops)
        if name.startswith(_rules.UNDIFFERENTIABLE_PREFIXES) and name not in _rules.RULES
    ]
    targets = []
    for op_name in written:
        module = next(m for m in _GEN_MODULES if op_name in vars(m))
        snake = _snake(op_name, module)
        original = vars(module)[snake]
        params = list(original.__code__.co_varnames[: original.__code__.co_argcount])
        if op_name in _rules.RULES:
            wrapper = _tracked_write(op_name, _rules.RULES[op_name], params)
        else:
            wrapper = _untracked_write(op_name, params)
        # The snake-case wrapper and the raw op (`module.OpName`, which
        # tf.raw_ops also holds) are separate functions with the same code.
        places = [(module, snake)]
        places += [(m, op_name) for m in [module, *raw_modules] if op_name in vars(m)]
        targets.append((places, original, wrapper))
    return targets


def _written_inputs(function: Any) -> List[int]:
    """Positions of the function's inputs that ops in its graph write (cached)."""
    cached = _function_writes.get(function)
    if cached is None:
        cached = _function_writes[function] = sorted(_graph_writes(function.graph))
    return cached


def _writes_anything(op_type: str) -> bool:
    return op_type in _rules.RULES or op_type.startswith(_rules.UNDIFFERENTIABLE_PREFIXES)


def _called_graphs(op: Any, graph: Any) -> List[Any]:
    """The graphs of the functions an op runs: a call's callee, cond branches,
    loop bodies (attributes holding a function or a list of them)."""
    names = []
    for value in op.node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names += [f.name for f in value.list.func]
    found = (graph._get_function(name) for name in names)
    return [f.graph for f in found if f is not None and getattr(f, "graph", None) is not None]


def _graph_writes(graph: Any) -> Set[int]:
    """Positions of ``graph.inputs`` written by its ops, or by the functions
    they call, however deeply (cached per graph)."""
    cached = _graph_writes_cache.get(graph)
    if cached is not None:
        return cached
    position = {id(t): i for i, t in enumerate(graph.inputs)}
    written: Set[int] = set()
    for op in graph.get_operations():
        if _writes_anything(op.type):
            written.update(position[id(t)] for t in op.inputs if id(t) in position)
            continue
        callees = _called_graphs(op, graph) if op.type not in _PLAIN_OPS else []
        if not callees:
            continue
        if op.type in ("PartitionedCall", "StatefulPartitionedCall") and len(callees) == 1:
            # A call passes its inputs to the callee's, one for one.
            for i in _graph_writes(callees[0]):
                if i < len(op.inputs) and id(op.inputs[i]) in position:
                    written.add(position[id(op.inputs[i])])
        elif any(_graph_writes(g) for g in callees):
            # Control flow maps inputs to bodies in op-specific ways: count every
            # resource it is given as written.
            written.update(
                position[id(t)] for t in op.inputs if t.dtype == dtypes.resource and id(t) in position
            )
    _graph_writes_cache[graph] = written
    return written


# Ops that are common in function graphs and never call functions: skipping them
# saves parsing their attributes.
_PLAIN_OPS = frozenset(
    {"Placeholder", "Const", "Identity", "NoOp", "ReadVariableOp", "MatMul", "Mul", "AddV2", "Sub"}
)
_graph_writes_cache: "weakref.WeakKeyDictionary[Any, Set[int]]" = weakref.WeakKeyDictionary()
_function_writes: "weakref.WeakKeyDictionary[Any, List[int]]" = weakref.WeakKeyDictionary()


def _call_function(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``ConcreteFunction._call_flat`` under an eager tape.

    A function keeps the handles it captured when it was traced: the variables'
    own. Map each to the variable's current version, so the function reads it
    and the gradient reaches it. A function that writes a tracked variable is
    refused (or cut): its writes happen inside the graph, out of the tape's sight.
    """
    scope = _versions.eager_scope()
    if scope is None:
        return wrapped(*args, **kwargs)
    arguments = _bind(("tensor_inputs", "captured_inputs"), args, kwargs)
    tensor_inputs = list(arguments["tensor_inputs"])
    by_handle = {
        id(_versions.canonical_handle(v)): v
        for v in instance.graph.variables
        if isinstance(v, resource_variable_ops.BaseResourceVariable)
    }
    captured_vars = [by_handle.get(id(h)) for h in arguments["captured_inputs"]]
    captured = [
        h if v is None else scope.current_version(v)
        for h, v in zip(arguments["captured_inputs"], captured_vars)
    ]
    # Variables passed as arguments arrive as handles the descriptor served.
    input_vars = [None if found is None else found[1] for found in map(_versions.owner, tensor_inputs)]
    all_vars = input_vars + captured_vars
    written = [
        var
        for var in (all_vars[i] for i in _written_inputs(instance) if i < len(all_vars))
        if var is not None and _differentiable(var) and scope.tracks(var)
    ]
    name = instance.name.decode() if isinstance(instance.name, bytes) else str(instance.name)
    if written and scope.refuses_untracked():
        raise UntrackedWriteError(
            f"tf.function {name!r} writes variable {written[0].name!r}, which "
            "an AssignAwareTape is tracking, and writes inside a function called from "
            "an eager tape happen out of the tape's sight: reads after it would "
            "credit the previous version, a silently wrong gradient. Open the tape "
            "inside the function, call the function outside the tape, or pass "
            "AssignAwareTape(untracked_writes='cut') to treat the write as a new "
            "version with no gradient path."
        )
    if written:
        warnings.warn(
            f"AssignAwareTape: tf.function {name!r} wrote "
            f"{written[0].name!r}; no gradient flows through that write "
            "(untracked_writes='cut').",
            stacklevel=3,
        )
    result = wrapped(tensor_inputs, captured)
    for var in written:
        old = scope.current_version(var)
        scope.advance(var, old, _new_version(old, None), _versions.WriteRecord(f"tf.function {name!r}", cut=True))
    return result


_call_flat_wrapper = None


def _leave_tensorflow(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``EagerTensor._numpy`` (behind ``.numpy()``, ``float()``, ``np.asarray``).

    A value the tape records that leaves TensorFlow carries no gradient from
    then on. Note where it left, so that ``explain()`` can name the place.
    """
    scope = _versions.eager_scope()
    if scope is not None and pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop([instance]):
        where = _caller()
        for tape in scope.tapes:
            tape._note_escape(where)
    return wrapped(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _library_dirs() -> Tuple[str, ...]:
    import keras
    import numpy

    dirs = [os.path.dirname(m.__file__ or "") for m in (tf, keras, numpy, wrapt)]
    dirs.append(os.path.dirname(__file__) + os.sep + "_")  # our private modules
    # tensorflow's own modules live beside the tf package (tensorflow/python/...).
    return tuple(d for d in dirs if d)


def _caller() -> str:
    """``file:line`` of the innermost frame outside TensorFlow, Keras and us."""
    skip = _library_dirs()
    frame: Any = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


_numpy_wrapper = None


def _distributed_update(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``StrategyExtendedV2.update``: a cross-replica write of a distributed variable.

    It runs in cross-replica context (for MirroredStrategy, outside the replica
    threads), so a replica's tape cannot see it: reads after it would credit
    the version from before. Refuse it when a replica's tape tracks the variable.
    """
    var = args[0] if args else kwargs.get("var")
    components = list(getattr(var, "values", None) or (var,))
    if _differentiable(var) and _versions.tracked_elsewhere(components):
        aggregation = getattr(var, "aggregation", None)
        raise UntrackedWriteError(
            f"A cross-replica update of variable {var.name!r} (aggregation "
            f"{getattr(aggregation, 'name', aggregation)}), which an AssignAwareTape in a "
            "replica is tracking: it is applied outside the replica's sight (merge_call), "
            "so reads after it would credit the version from before, a silently wrong "
            "gradient. Such updates come from writes in replica context to a "
            "MirroredVariable whose aggregation is not NONE, and from optimizer steps "
            "(apply_gradients) in replica context. Inside the tape, write per replica "
            "instead: aggregation=NONE (each replica writes its own component) or "
            "synchronization=ON_READ, with assign / assign_sub; aggregate the "
            "meta-gradients after the tape."
        )
    return wrapped(*args, **kwargs)


_update_wrapper = None
_cond_wrappers = None


class _Wrapper(wrapt.FunctionWrapper):
    # AutoGraph warns about every wrapt-wrapped callee it meets while converting
    # a tf.function (user code calling tf.raw_ops directly), unless the callee
    # looks like one of its own artifacts. A class attribute answers that lookup
    # before the proxy would forward it to TensorFlow's function, which stays
    # untouched. (AutoGraph calls TensorFlow's ops unconverted either way.)
    autograph_info__: Dict[str, Any] = {}


# Built on first use and kept, grouped by the module that holds them, so that
# installing is one dict update per module.
class _Group:
    __slots__ = ("owner", "names", "originals", "wrappers", "get")

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.names: List[str] = []
        self.originals: Dict[str, Any] = {}
        self.wrappers: Dict[str, Any] = {}
        self.get: Any = None

    def add(self, name: str, wrapper: Callable[..., Any]) -> None:
        original = vars(self.owner)[name]
        self.names.append(name)
        self.originals[name] = original
        self.wrappers[name] = _Wrapper(original, wrapper)
        self.get = operator.itemgetter(*self.names)

    def unchanged(self) -> bool:
        current = self.get(vars(self.owner))
        current = current if len(self.names) > 1 else (current,)
        return all(map(operator.is_, current, self.originals.values()))


_groups: List[_Group] = []


def _build_wrappers() -> None:
    by_owner: Dict[int, _Group] = {}
    for places, _, wrapper in _patch_targets():
        for owner, name in places:
            by_owner.setdefault(id(owner), _Group(owner)).add(name, wrapper)
    _groups[:] = by_owner.values()


def _install() -> None:
    if not _groups or not all(group.unchanged() for group in _groups):
        # First use, or someone else re-bound an op since: wrap what is there now.
        _build_wrappers()
    base = resource_variable_ops.BaseResourceVariable
    _saved.append((base, "_handle", base.__dict__.get("_handle", _ABSENT)))
    setattr(base, "_handle", _versions.HandleDescriptor())
    global _call_flat_wrapper
    original = vars(ConcreteFunction)["_call_flat"]
    if _call_flat_wrapper is None or _call_flat_wrapper.__wrapped__ is not original:
        _call_flat_wrapper = _Wrapper(original, _call_function)
    _saved.append((ConcreteFunction, "_call_flat", original))
    setattr(ConcreteFunction, "_call_flat", _call_flat_wrapper)
    global _cond_wrappers
    originals = (vars(cond_v2)["cond_v2"], vars(cond_v2)["_build_cond"])
    if _cond_wrappers is None or tuple(w.__wrapped__ for w in _cond_wrappers) != originals:
        _cond_wrappers = (_Wrapper(originals[0], _cond), _Wrapper(originals[1], _build_cond))
    for name, original, wrapper in zip(("cond_v2", "_build_cond"), originals, _cond_wrappers):
        _saved.append((cond_v2, name, original))
        setattr(cond_v2, name, wrapper)
    global _update_wrapper
    extended = distribute_lib.StrategyExtendedV2
    original = vars(extended)["update"]
    if _update_wrapper is None or _update_wrapper.__wrapped__ is not original:
        _update_wrapper = _Wrapper(original, _distributed_update)
    _saved.append((extended, "update", original))
    setattr(extended, "update", _update_wrapper)
    global _numpy_wrapper
    eager_base = ops._EagerTensorBase
    original = vars(eager_base)["_numpy"]
    if _numpy_wrapper is None or _numpy_wrapper.__wrapped__ is not original:
        _numpy_wrapper = _Wrapper(original, _leave_tensorflow)
    _saved.append((eager_base, "_numpy", original))
    setattr(eager_base, "_numpy", _numpy_wrapper)
    for group in _groups:
        vars(group.owner).update(group.wrappers)


def _uninstall() -> None:
    for group in _groups:
        vars(group.owner).update(group.originals)
    while _saved:
        owner, name, original = _saved.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def acquire() -> None:
    """One more open tape; the first installs the patches."""
    global _users
    with _lock:
        if _users == 0:
            _install()
        _users += 1


def release() -> None:
    """One tape fewer; the last restores the original attributes."""
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            _uninstall()


def installed() -> bool:
    return _users > 0


def patched_places() -> List[Tuple[Any, str]]:
    """Every attribute the patches replace (for tests and diagnostics)."""
    if not _groups:
        _build_wrappers()
    base = resource_variable_ops.BaseResourceVariable
    return [
        (base, "_handle"),
        (ConcreteFunction, "_call_flat"),
        (ops._EagerTensorBase, "_numpy"),
        (distribute_lib.StrategyExtendedV2, "update"),
        (cond_v2, "cond_v2"),
        (cond_v2, "_build_cond"),
    ] + [
        (group.owner, name) for group in _groups for name in group.names
    ]
