"""What happens on a write: the op wrappers that ``_patches`` installs.

For an op with a gradient rule (``_rules.RULES``) the wrapper performs the
real write, then makes the new version and records it on the tapes; inside a
``tf.cond`` branch or loop body of a tape's graph the write takes the branch
form (``_control_flow``). A fused optimizer kernel (``ResourceApply*``,
``_fused``) makes a version of the variable and of every slot it writes. A
write with no rule is refused, or cut by option (``untracked_write``). A raw
read op given a kept handle reads the current version (``raw_read``).

Each wrapper has wrapt's signature ``(wrapped, instance, args, kwargs)``;
``_patches`` only decides where they go and installs them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from assigntape import (
    _branch_writes,
    _branches,
    _fused,
    _plain_tapes,
    _record,
    _refusals,
    _resolve,
    _resuming,
    _rules,
    _serving,
    _threads,
    _versions,
)
from assigntape._errors import WriteDtypeError
from assigntape._tf import (
    dtypes,
    gen_resource_variable_ops,
    gradients_util,
    ops,
    pywrap_tfe,
    record,
    resource_variable_ops,
    tensor_lib,
)
from assigntape._wrapping import bind

__all__ = ["fused_write", "raw_read", "tracked_write", "untracked_write", "watch", "write_here"]


def tracked_write(op_name: str, rule: _rules.Rule, params: Sequence[str]) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        arguments = bind(params, args, kwargs)
        handle = arguments.get(rule.resource_arg)
        _refusals.refuse_unordered_graph([handle], op_name)
        found = _serving.owner(handle)
        if found is None or not _versions.differentiable(found[1]):
            _threads.refuse_other_thread(handle, None, op_name)
            if found is None:
                _refusals.unknown_variable_write(handle, op_name)
            _resuming.note_write_while_closed(handle)
            return wrapped(*args, **kwargs)
        scope, var = found
        _threads.refuse_other_thread(handle, var, op_name)
        branch = _branches.check_writable_here(scope, var, op_name)
        around = _branches.branch_around(scope)
        if around is None and branch is None and scope.key is not None:
            _plain_tapes.refuse_recorders_outside_body(scope, var, op_name)
        values = _converted(op_name, arguments, rule.value_args, var, scope.key is None)
        if values is None:
            # A value of another dtype (a Python list of floats for a float64
            # variable, a NumPy float64 array, Python ints, an int32 tensor), or
            # one TensorFlow cannot convert: the call as the user made it, for
            # TensorFlow's own error, before anything is written or recorded.
            return wrapped(*args, **kwargs)
        arguments.update(values)
        _threads.refuse_foreign_inputs(var, op_name, [arguments[name] for name in rule.value_args])
        if branch is None and around is None:
            return write_here(scope, var, op_name, rule, wrapped, arguments)
        return _branch_writes.write_in_body(
            scope,
            branch,
            around,
            [var],
            lambda body: _branch_writes.branch_write(op_name, rule, wrapped, arguments, body, var),
            op_name,
        )

    return wrapper


def write_here(
    scope: _versions.Scope,
    var: Any,
    op_name: str,
    rule: _rules.Rule,
    run: Callable[..., Any],
    arguments: Dict[str, Any],
) -> Any:
    """A write in the tape's own graph, or eagerly: ``run(**arguments)`` writes,
    then the new version is made and recorded, and becomes current."""
    old = _resuming.first_touch(scope, var)
    write = rule.prepare(var, old, arguments)
    old_shape = None if var.shape.is_fully_defined() else _resolve.dynamic_shape(old)
    forward = _forward_value(rule, var, old, write, arguments, scope.key is None)
    # The real write. If it raises (bad shape or dtype, duplicate indices),
    # nothing below runs: the tape and the variable stay as they were.
    if write.checks:
        with ops.control_dependencies(write.checks):
            result = run(**arguments)
    else:
        result = run(**arguments)
    new = _branch_writes.top_version(scope, var, old, result, write.inputs, write.backward)
    if write.reads_old:
        # A partial write reads the old value, but a variable that was never
        # read is not watched yet, and an unwatched input is not recorded:
        # its gradient would be lost. (Watching after the write is enough:
        # what counts is that the old handle is watched when recording.)
        watch(scope, var)
    record.record_operation_backprop_only(op_name, [new], write.inputs, write.backward)
    if forward is not None:
        # Forward accumulators: the new version's tangent is the functional
        # value's, whose ops TensorFlow differentiates forward.
        record.record_operation_forwardprop_only(op_name, [new], [forward], _rules.identity_backward, None)
    recorded = not pywrap_tfe.TFE_Py_TapeSetIsStopped()
    scope.advance(var, old, new, _record.WriteRecord(op_name, recorded=recorded, old_shape=old_shape), closed=True)
    return result


def fused_write(op_name: str, kernel: _fused.Kernel, params: Sequence[str]) -> Callable[..., Any]:
    """The wrapper of a fused optimizer kernel (``ResourceApply*``), which
    writes a variable and its slots in one op (see ``_fused``).

    Before the kernel runs, the previous version of every resource it writes
    is read, recorded, so that TensorFlow's own tape connects the kernel's
    functional form to those versions, the gradient and the hyperparameters.
    The real kernel then computes the values the program sees. Each written
    variable gets a new version, recorded as an identity of its functional
    value: the backward pass is TensorFlow's gradient of the form, correct to
    any order. In a graph the graph's own gradient follows it the same way
    (``_form_backward``), as a rule's write's follows its rule.
    """

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        arguments = bind(params, args, kwargs)
        handles = {name: arguments.get(name) for name in kernel.writes}
        _refusals.refuse_unordered_graph([h for h in handles.values() if h is not None], op_name)
        owners = {name: _serving.owner(handle) for name, handle in handles.items()}
        for name, handle in handles.items():
            owner = owners[name]
            _threads.refuse_other_thread(handle, None if owner is None else owner[1], op_name)
        found = {name: f for name, f in owners.items() if f is not None and _versions.differentiable(f[1])}
        if not found:
            for name, handle in handles.items():
                if owners[name] is None:
                    _refusals.unknown_variable_write(handle, op_name)
                _resuming.note_write_while_closed(handle)
            return wrapped(*args, **kwargs)
        tracked = {name: var for name, (_, var) in found.items()}
        # Every handle the op is given is found in the scope of the graph being built.
        scope, first = next(iter(found.values()))
        branch = _branches.check_writable_here(scope, first, op_name)
        around = _branches.branch_around(scope)
        if around is None and branch is None and scope.key is not None:
            _plain_tapes.refuse_recorders_outside_body(scope, first, op_name)
        # The kernel's inputs converted once, for the kernel and the form alike,
        # to the dtype TensorFlow's function would convert them to.
        inputs = _kernel_inputs(op_name, arguments, kernel.inputs, first, scope.key is None)
        if inputs is None:
            return wrapped(*args, **kwargs)  # TensorFlow's own error, nothing written
        arguments.update(inputs)
        _threads.refuse_foreign_inputs(first, op_name, [arguments.get(name) for name in kernel.inputs])
        checks: List[Any] = []
        if kernel.sparse:
            arguments["indices"] = ops.convert_to_tensor(arguments["indices"])
            checks = _fused.no_duplicates(arguments["indices"], first.name, op_name)
        if branch is not None or around is not None:
            return _branch_writes.write_in_body(
                scope,
                branch,
                around,
                [tracked[name] for name in _fused.written(kernel, arguments) if name in tracked],
                lambda body: _branch_writes.fused_branch_write(
                    op_name, kernel, wrapped, arguments, body, tracked, checks
                ),
                op_name,
            )
        # The previous versions: a tracked variable's current one (whichever of
        # its handles the op was given, it writes the same resource), else the
        # handle given (a variable the tape does not know: no version for it).
        old = {name: scope.current_version(tracked[name]) if name in tracked else h for name, h in handles.items()}
        shapes = {
            name: _resolve.dynamic_shape(old[name]) for name, var in tracked.items() if not var.shape.is_fully_defined()
        }
        recording = not pywrap_tfe.TFE_Py_TapeSetIsStopped()
        values: Dict[str, Any] = {}
        if recording:
            # Watched, as a read is (a never-read variable's start-of-tape version
            # would not be).
            for var in tracked.values():
                resource_variable_ops.variable_accessed(var)
        if recording or scope.key is not None:
            # Read before the kernel overwrites them. In a graph always: the
            # graph's own gradient follows the write whether tapes record or
            # not, as it follows a rule's write (``write_here``).
            values = {
                name: gen_resource_variable_ops.read_variable_op(handle, first.dtype) for name, handle in old.items()
            }
        # In a graph, the reads (and the duplicate check) must run before the kernel.
        with ops.control_dependencies(list(values.values()) + checks):
            result = wrapped(**arguments)
        written = _fused.written(kernel, arguments)
        for name, handle in handles.items():
            if name not in tracked or name not in written:  # (the others: by ``advance``)
                _resuming.note_write_while_closed(handle, tracked.get(name))
        new_values = _fused.new_values(kernel, values, arguments) if values else {}
        sources = _form_sources(kernel, values, arguments)
        for name in written:
            var = tracked.get(name)
            if var is None:
                continue
            # (No form eagerly while nothing records: no graph gradient to follow.)
            backward = _form_backward(new_values[name], sources) if new_values else _rules.identity_backward
            new = _branch_writes.top_version(scope, var, old[name], result, sources, backward)
            if recording:
                record.record_operation(
                    op_name, [new], [new_values[name]], _rules.identity_backward, forward_function=lambda t: [t]
                )
            write = _record.WriteRecord(op_name, recorded=recording, old_shape=shapes.get(name))
            scope.advance(var, old[name], new, write, closed=True)
        return result

    return wrapper


def _form_sources(kernel: _fused.Kernel, values: Dict[str, Any], arguments: Dict[str, Any]) -> List[Any]:
    """What a fused kernel's functional form is differentiable in: the previous
    values of the resources it writes and its inputs of type ``T``, each once
    (a tensor given twice would get its gradient twice)."""
    given = [*values.values(), *(arguments.get(name) for name in kernel.inputs)]
    unique = {t.ref(): t for t in given if isinstance(t, tensor_lib.Tensor)}
    return list(unique.values())


def _form_backward(form: Any, sources: List[Any]) -> Callable[[Any], List[Any]]:
    """The backward function of a fused kernel's version in a graph, from its
    ``sources`` (``_form_sources``) to the version: TensorFlow's gradient of
    the functional value ``form``. The form's ops are not the version's inputs,
    so they run only when a gradient needs them, not at every step."""

    def backward(g: Any) -> List[Any]:
        # The form is in the tape's graph; the gradient may be built in another
        # (a call's backward function), which captures what it uses.
        grads: List[Any] = gradients_util._GradientsHelper(
            [form], sources, grad_ys=_rules.identity_backward(g), src_graph=form.graph
        )
        return grads

    return backward


# Write ops whose kernels abort the process (TensorFlow 2.21) when given a
# value whose dtype is not the variable's, where the others raise
# InvalidArgumentError: refused before they run (``WriteDtypeError``). The
# strided-slice assign aborts only while a tensor shares the variable's
# buffer, which an eager recording tape keeps (a plain tape's too); in a
# graph it raises InvalidArgumentError.
_ABORT_ON_DTYPE = frozenset(
    [
        "ResourceStridedSliceAssign",
        "ResourceScatterNdUpdate",
        "ResourceScatterNdAdd",
        "ResourceScatterNdSub",
        "ResourceScatterNdMin",
        "ResourceScatterNdMax",
    ]
)
_ABORT_ONLY_EAGERLY = frozenset(["ResourceStridedSliceAssign"])


def _converted(
    op_name: str, arguments: Dict[str, Any], names: Sequence[str], var: Any, eager: bool
) -> Optional[Dict[str, Any]]:
    """A write op's value arguments converted as its generated function
    converts them, from the value alone (a Python float list to float32,
    Python ints to int32, a NumPy array in its own dtype: not to the
    variable's), or None where one does not convert or is not of the
    variable's dtype: TensorFlow's op then raises its own error (or, where
    its kernel would abort, ``WriteDtypeError``)."""
    converted = {}
    for name in names:
        try:
            value = ops.convert_to_tensor(arguments[name])
        except (TypeError, ValueError):
            return None
        if value.dtype != var.dtype:
            if op_name in _ABORT_ON_DTYPE and (eager or op_name not in _ABORT_ONLY_EAGERLY):
                raise _dtype_error(op_name, names, value.dtype.name, var)
            return None
        converted[name] = value
    return converted


def _dtype_error(op_name: str, names: Sequence[str], found: str, var: Any) -> WriteDtypeError:
    error: WriteDtypeError = WriteDtypeError(
        f"{op_name} was given {', '.join(names)} that TensorFlow converts to {found}, for variable "
        f"{var.name!r} of dtype {var.dtype.name}: its kernel would abort the process. Nothing was "
        f"written. Pass tensors of dtype {var.dtype.name} (tf.constant(x, {var.dtype.name!r}))."
    )
    return error


def _kernel_inputs(
    op_name: str, arguments: Dict[str, Any], names: Sequence[str], var: Any, eager: bool
) -> Optional[Dict[str, Any]]:
    """A fused kernel's inputs of its type ``T`` (``names``, in the op's
    order) converted to the dtype TensorFlow's function gives them: eagerly
    the first tensor's, else the one the first value converts to; in a graph
    the first input's. None where an input does not convert to it: the call
    as the user made it then raises TensorFlow's own ``TypeError``. A ``T``
    that is not the variable's dtype is refused before anything runs
    (``WriteDtypeError``, a ``TypeError``): TensorFlow's kernel would abort
    the process (TensorFlow 2.21, a float64 variable given Python floats)."""
    given = [(name, arguments[name]) for name in names if arguments.get(name) is not None]
    tensors = [value for _, value in given if isinstance(value, tensor_lib.Tensor)]
    first = tensors[0] if tensors and eager else given[0][1] if given else None
    try:
        dtype = first.dtype if isinstance(first, tensor_lib.Tensor) else ops.convert_to_tensor(first).dtype
        converted = {name: ops.convert_to_tensor(value, dtype=dtype) for name, value in given}
    except (TypeError, ValueError):
        return None  # TensorFlow's conversion fails the same way, before its kernel
    if dtype != var.dtype:
        raise _dtype_error(op_name, names, dtype.name, var)
    return converted


def _forward_value(
    rule: _rules.Rule, var: Any, old: Any, write: _rules.Write, arguments: Dict[str, Any], eager: bool
) -> Any:
    """The write's new value as plain ops on the previous version, when a
    ``ForwardAccumulator`` has a tangent for an input of the write (else None):
    computed before the write, which overwrites the previous value."""
    if not write.inputs:
        return None
    # In a function, an accumulator watches the handle the function captured
    # (as TensorFlow's does: convert_to_tensor of the eager handle), not the
    # eager handle a variable not yet written here is known by. (Eagerly,
    # ``old`` is a handle already.)
    first = old if eager else ops.convert_to_tensor(old)
    _, tangents = pywrap_tfe.TFE_Py_PackJVPs([first, *write.inputs])
    if not tangents:
        return None
    return rule.value(gen_resource_variable_ops.read_variable_op(old, var.dtype), arguments)


def watch(scope: _versions.Scope, var: Any) -> None:
    """``resource_variable_ops.variable_accessed(var)``: the variable is watched
    by the tapes, as a read would. Eagerly, for a variable that is not a
    distributed one's component (for which TensorFlow's distribution lookup
    gives the variable itself; it was made under no strategy), and where no
    function graph watches, the two C calls
    it ends in, without its Python layers: about ten microseconds a write."""
    if scope.key is not None or var.__dict__.get("_distribute_strategy") is not None:
        resource_variable_ops.variable_accessed(var)
    elif var.trainable:
        pywrap_tfe.TFE_Py_TapeVariableAccessed(var)
        pywrap_tfe.TFE_Py_VariableWatcherVariableAccessed(var)


def _resource_arguments(arguments: Dict[str, Any]) -> List[Any]:
    """The resource tensors among an op's arguments, including those in lists
    (an op that writes ``N`` variables takes them as one list argument)."""
    found = []
    for value in arguments.values():
        for a in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(a, tensor_lib.Tensor) and a.dtype == dtypes.resource:
                found.append(a)
    return found


def untracked_write(op_name: str, params: Sequence[str]) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        arguments = bind(params, args, kwargs)
        handles = _resource_arguments(arguments)
        _refusals.refuse_unordered_graph(handles, op_name)
        hits = [h for h in map(_serving.owner, handles) if h is not None]
        hits = [(scope, var) for scope, var in hits if _versions.differentiable(var)]
        for h in handles:
            _threads.refuse_other_thread(h, None, op_name)
        if not hits:
            for h in handles:
                _resuming.note_write_while_closed(h)
            return wrapped(*args, **kwargs)
        scope, var = hits[0]
        _refusals.refuse_or_cut(
            [scope],
            var,
            op_name,
            f"{op_name} wrote variable {var.name!r}, which an AssignAwareTape is tracking, "
            "and the tape cannot differentiate that op: reads after it would credit the "
            "previous version, a silently wrong gradient. Write with tracked ops instead "
            "(v.assign / assign_add / assign_sub, scatter and slice writes, or a Keras 3 "
            "optimizer, whose steps are made of them).",
        )
        result = wrapped(*args, **kwargs)
        for scope, var in hits:
            _resuming.note_write_while_closed(None, var)
            _refusals.cut([scope], var, op_name, result)
        return result

    return wrapper


def raw_read(params: Sequence[str]) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        arguments = bind(params, args, kwargs)
        handle = arguments.get("resource")
        mapped = _serving.handle_for_read(handle)
        if mapped is handle:
            return wrapped(*args, **kwargs)
        arguments["resource"] = mapped
        return wrapped(**arguments)

    return wrapper
