"""Writes inside ``tf.cond`` branches and graph loops, with the tape open in the
graph around them.

A tensor made in a branch cannot leave it, and the cond's gradient is
TensorFlow's symbolic one, which never sees what the tape recorded inside. So in
a branch the real write runs and, beside it, the variable's whole new value is
built from plain ops (``Rule.value``: the functional rewrite of each
write); reads later in the branch get a handle whose registered gradient goes to
that value. ``_control_flow.cond`` makes both branches return the values of every variable
either wrote (``build_cond`` adds, to the branch that left a variable alone, its
unchanged value), and after the cond each written variable gets a new version
fed by the cond's output, so the cond's own gradient routes into whichever
branch ran. A cond built inside a branch does the same one level down: its
outputs become that branch's latest values (``Branch.parent``).

Inside every body the variable's *resource* is one tensor only, the tape-level
version, captured down through each level; what crosses a body's boundary is
values, never a handle made in another body. Two handles of one variable given
to the same ``If`` or ``While`` become two separate resources when XLA compiles
it, and a read through one then misses a write through the other.

This module holds the writes in a body and the handles they make
(``branch_write``, ``_branch_version``), and what leaves a body after it
(``_leave``); ``_control_flow`` wraps ``cond_v2`` and ``while_v2`` around them.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

from assigntape import _branches, _fused, _record, _recorders, _rules, _versions
from assigntape._errors import ControlFlowWriteError, SavedModelError
from assigntape._tf import (
    array_ops,
    attr_value_pb2,
    auto_control_deps,
    composite_tensor,
    control_flow_util,
    eager_tape,
    gen_resource_variable_ops,
    handle_data_util,
    math_ops,
    nest,
    ops,
    pywrap_tfe,
    record,
    resource_variable_ops,
    tensor_array_ops,
    tensor_lib,
    variable_utils,
)
from assigntape._wrapping import unwrapped

_BRANCH_VERSION_GRAD = "AssigntapeBranchVersion"


@ops.RegisterGradient(_BRANCH_VERSION_GRAD)
def _branch_version_grad(op: Any, grad_handle: Any, grad_value: Any) -> List[Any]:
    """A branch version's handle is the value written: reads of it send their
    gradient (which arrives at the handle) to that value."""
    grads = [ops.convert_to_tensor(g) for g in (grad_handle, grad_value) if g is not None]
    return [None, math_ops.add_n(grads) if grads else None]


_TOP_VERSION_GRAD = "AssigntapeTopVersion"


@ops.RegisterGradient(_TOP_VERSION_GRAD)
def _top_version_grad(op: Any, grad_handle: Any, *rest: Any) -> List[Any]:
    """A version made at the top level of a tape's graph, for symbolic
    ``tf.gradients`` (tapes have the write recorded): the write's own backward
    function, kept on the op."""
    backward = getattr(op, "_assigntape_backward", None)
    if op is None or (backward is None and grad_handle is not None):
        # Every version made in this process keeps its rule on the op: none
        # here means a graph from elsewhere (a SavedModel loaded, with no
        # gradients saved; op None: one being saved), whose gradient through
        # the write would otherwise be silently cut.
        raise SavedModelError(unsaved_rule(getattr(op, "name", None)))
    if grad_handle is None or backward is None:
        return [None] * len(op.inputs)
    return [None, *backward(grad_handle)]


def unsaved_rule(op_name: Optional[str]) -> str:
    """Why a gradient through an AssignAwareTape's writes in a SavedModel is refused."""
    where = f" (op {op_name!r})" if op_name else ""
    return (
        f"A gradient through a variable write that an AssignAwareTape followed inside a "
        f"tf.function{where}, in a function loaded from a SavedModel or being saved: the "
        "write's gradient rule is Python code kept beside the graph, which a SavedModel "
        "cannot carry. The loaded function computes the same values and its own tape's "
        "gradients; to differentiate through it, build the tf.function from Python code "
        "in this process instead of loading it."
    )


def _on_its_device(var: Any) -> Any:
    """Places a version's IdentityN on the variable's device. IdentityN has
    several inputs, so TensorFlow's placer does not put it with its resource
    input, as it does an Identity, and colocating it with the function's
    captured handle is lost when the function is instantiated: it would run
    on the function's device, and every read through it (placed with it)
    fails for a variable elsewhere (tf.device, OneDeviceStrategy, parameter
    servers)."""
    device = getattr(var, "device", "")
    return ops.device(device) if device else contextlib.nullcontext()


def symbolic_version(var: Any, old: Any, write_result: Any, inputs: List[Any], backward: Callable[..., Any]) -> Any:
    """The new version of a write to ``var`` at the top level of a tape's
    graph: a handle for the same resource, read after the write, whose
    symbolic gradient (for ``tf.gradients``, which TensorFlow Probability's
    kernels use in graphs) is the write's backward function. Unrecorded, as
    ``_versions.new_version``."""
    with record.stop_recording(), ops.control_dependencies([write_result]):
        with ops.get_default_graph().gradient_override_map({"IdentityN": _TOP_VERSION_GRAD}):
            root = _versions.root_handle(old)
            with _on_its_device(var):
                outputs = array_ops.identity_n([root, *inputs])
    handle = outputs[0]
    handle.op._assigntape_backward = backward
    handle_data_util.copy_handle_data(old, handle)
    return _versions.same_handle_attributes(old, handle)


def top_version(
    scope: Any, var: Any, old: Any, write_result: Any, inputs: List[Any], backward: Callable[..., Any]
) -> Any:
    """The new version of a write to ``var`` at the top level of ``scope``
    (a write op's, a fused kernel's, a cond's or loop's output): eagerly a
    fresh handle; in the tape's graph one that the graph's own gradient
    (``tf.gradients``, TensorFlow's gradient of a call of the function)
    follows back to ``inputs`` by ``backward`` (``symbolic_version``), as
    the tapes do by their record. Unrecorded."""
    if scope.key is None or write_result is None:
        return _versions.new_version(old, write_result)
    return symbolic_version(var, old, write_result, inputs, backward)


def _is_branch_version(op: Any) -> bool:
    """A version handle made by IdentityN (in a body, or for tf.gradients)."""
    if op.type != "IdentityN":
        return False
    try:
        return op.get_attr("_gradient_op_type") in (_BRANCH_VERSION_GRAD.encode(), _TOP_VERSION_GRAD.encode())
    except ValueError:
        return False


def _resolve_branch_versions(op: Any, reads: Any, writes: Any) -> bool:
    """Automatic control dependencies, for a branch version's handle: the
    resource it touches is its input's (as TensorFlow's own resolver does for
    ``Identity``). Every op on any version in a body is then ordered in program
    order, like the ops on one handle: a read of an earlier version runs before
    a later write, also one inside a nested cond or loop, which is given the
    tape-level version."""
    del op

    def update(resources: Any) -> bool:
        found = [t for t in resources if _is_branch_version(t.op)]
        for t in found:
            resources.discard(t)
            resources.add(t.op.inputs[t.value_index])
        return bool(found)

    return bool(update(reads) | update(writes))


try:
    auto_control_deps.register_acd_resource_resolver(_resolve_branch_versions)
except KeyError:  # registered already (the module was reloaded)
    pass


def _version_handle(branch: Any, var: Any, value: Any, after: Optional[Any], taped: Optional[Any] = None) -> Any:
    """A handle for ``var`` in ``branch``'s graph standing for ``value``, for
    reads that run after ``after``.

    The handle's resource input is the tape-level version, made outside every
    body: TensorFlow's loop and cond gradients trace a resource a nested body
    was given back to an input of the body around it, which a handle made in a
    body cannot be traced to, and under XLA a second handle of the variable
    given to a nested ``If`` or ``While`` would be a second, stale resource
    there. Its registered gradient goes to ``value``. (Ops on it are ordered
    with those on the tape-level version by ``_resolve_branch_versions``.)
    """
    # (For a tape opened in another tape's body, its own versions are handles
    # made in that body: the outermost tape's version instead.)
    root = _branches.outermost(branch.scope).current_version(var)
    # Unrecorded (the tapes and accumulators get it below, as one op from
    # ``value``): a forward accumulator would otherwise try to differentiate
    # the IdentityN itself and fail on its resource output.
    with (
        record.stop_recording(),
        ops.control_dependencies([] if after is None else [after]),
        ops.get_default_graph().gradient_override_map({"IdentityN": _BRANCH_VERSION_GRAD}),
        _on_its_device(var),
    ):
        handle = array_ops.identity_n([root, value])[0]
    # Grappler would bypass it (its output 0 is its input 0), and with it the
    # data dependency on ``value`` that orders reads after the write.
    handle.op._set_attr("_grappler_do_not_remove", attr_value_pb2.AttrValue(b=True))
    # Tapes opened inside the body record ops as they are made, and look
    # gradients up by op type, not through gradient_override_map: tell them too.
    record.record_operation(
        "AssigntapeBranchVersion",
        [handle],
        [value if taped is None else taped],
        lambda g: [g],
        forward_function=lambda t: [t],
    )
    handle_data_util.copy_handle_data(root, handle)
    _versions.same_handle_attributes(root, handle)
    branch.scope.owners[id(handle)] = var
    return handle


def _inherit(branch: Any) -> None:
    """Gives a body just opened (a cond branch or loop body nested in another)
    a handle of its own for every variable an enclosing body wrote, fed by that
    body's latest value: a value can enter the nested body, a handle made in
    the enclosing one must not (see ``_version_handle``)."""
    outer = branch.parent
    while outer is not None:  # nearest first: its value is the latest
        for uid, (var, value) in outer.values.items():
            if uid not in branch.versions:
                branch.versions[uid] = _version_handle(branch, var, value, None)
        outer = outer.parent


def _open(scope: Any, parent: Any, carried: Optional[List[str]] = None, token: Any = None) -> Any:
    branch = _branches.open_branch(scope, parent, carried, token)
    try:
        _inherit(branch)
    except BaseException:
        _branches.close_branch(branch)
        raise
    return branch


# What a body may return unconverted; anything else, TensorFlow converts once
# the body function has returned (see ``_read_now``).
_OUTPUTS = (tensor_lib.Tensor, composite_tensor.CompositeTensor, tensor_array_ops.TensorArray, ops.Operation)


def _read_now(structure: Any) -> Any:
    """A body's outputs, with the variables among them (and anything else
    TensorFlow converts to a tensor) read now, while the body is open.

    TensorFlow reads them itself once the body function has returned, after
    the tape closed its record of the body: the read would credit the version
    from before the body's writes."""
    structure = variable_utils.convert_variables_to_tensors(structure)

    def read(x: Any) -> Any:
        if x is None or isinstance(x, _OUTPUTS):
            return x
        try:
            return ops.convert_to_tensor_or_composite(x)
        except (TypeError, ValueError):
            return x  # not a tensor: TensorFlow reports it, in its own words

    return nest.map_structure(read, structure)


def branch_write(
    op_name: str, rule: _rules.Rule, wrapped: Callable[..., Any], arguments: Dict[str, Any], branch: Any, var: Any
) -> Any:
    """A write inside a ``tf.cond`` branch or loop body in the tape's graph.

    The real write runs. Beside it, the variable's new value is built from plain
    ops (the functional rewrite, ``Rule.value``, reading the previous
    version), and a handle is made whose symbolic gradient goes to that value, so
    reads later in the body differentiate correctly. The cond returns the value
    as an extra output (a loop, as its next state); ``cond`` and ``while_loop``
    make the tape's version from it.
    """
    old = branch.version_of(var)
    # The rule's checks (duplicate indices) guard the write here as anywhere
    # (under XLA, indices known while tracing to repeat are refused right here).
    write = rule.prepare(var, old, arguments)
    if write.reads_old:
        # As outside a branch: the part kept from the old value needs the
        # variable watched, or a never-read variable's gradient is lost. Before
        # the read: a tape records the read (and the capture of an outer
        # version into this body) only of what it watches already.
        resource_variable_ops.variable_accessed(var)
    stopped = _stopped_for_symbolic(branch, var, op_name)
    old_value = gen_resource_variable_ops.read_variable_op(old, var.dtype)
    value = rule.value(old_value, arguments)
    taped = None
    if stopped:
        # Under stop_recording: a new version with no gradient path, as outside,
        # for the tape that stopped (whose gradient of the body is the cond's
        # or loop's own, symbolic). A tape opened in the body and still
        # recording recorded the ops of ``value``: reads after the write are
        # on it, as they would be outside a body.
        taped, value = value, array_ops.stop_gradient(value)
    else:
        value = _poison_duplicates(op_name, var, arguments, value)
    with ops.control_dependencies([old_value.op, *write.checks]):
        result = wrapped(**arguments)
    _branch_version(branch, var, value, result, taped)
    return result


def fused_branch_write(
    op_name: str,
    kernel: _fused.Kernel,
    wrapped: Callable[..., Any],
    arguments: Dict[str, Any],
    branch: Any,
    tracked: Dict[str, Any],
    checks: List[Any],
) -> Any:
    """A fused optimizer kernel inside a ``tf.cond`` branch or loop body.

    As ``branch_write`` does for one variable, for each variable the kernel
    writes: the kernel runs, and beside it the functional form
    (``_fused.new_values``, from the versions this branch sees) becomes each
    tracked variable's new value in the branch.
    """
    dtype = next(iter(tracked.values())).dtype
    old = {
        name: branch.version_of(tracked[name]) if name in tracked else arguments[name]
        for name in kernel.writes
        if arguments.get(name) is not None
    }
    stopped = _stopped_for_symbolic(branch, next(iter(tracked.values())), op_name)
    # Watched before they are read, as in ``branch_write``.
    for var in tracked.values():
        resource_variable_ops.variable_accessed(var)
    values = {name: gen_resource_variable_ops.read_variable_op(h, dtype) for name, h in old.items()}
    new_values = _fused.new_values(kernel, values, arguments)
    with ops.control_dependencies([v.op for v in values.values()] + checks):
        result = wrapped(**arguments)
    for name in _fused.written(kernel, arguments):
        var = tracked.get(name)
        if var is not None:
            value = array_ops.stop_gradient(new_values[name]) if stopped else new_values[name]
            _branch_version(branch, var, value, result, new_values[name] if stopped else None)
    return result


def _stopped_for_symbolic(branch: Any, var: Any, op_name: str) -> bool:
    """Whether a write in ``branch`` has no gradient path in the cond's or
    loop's own (symbolic) gradient.

    The recorders (tapes of ours, plain tapes, accumulators) that recorded a
    cond or loop around the write see it only through that one symbolic
    gradient: it follows the write if they record now, and not if they are
    stopped. If some record and others are stopped, one of them would get
    the other's answer, a silently wrong gradient: refused. (A recorder
    opened in the write's own body sees it directly, recorded with the write;
    one that recorded no enclosing cond or loop does not see it at all.)"""
    states = {_recorders.records(r) for entered in _entered_stack() for r in entered}
    if len(states) > 1:
        raise ControlFlowWriteError(
            f"{op_name} to variable {var.name!r} in a compiled tf.cond branch or loop body, "
            "while of the tapes that recorded an enclosing cond or loop some record and some "
            "are stopped (stop_recording): they all see the write only through the enclosing "
            "cond's or loop's own gradient, which cannot differ between them, so one would "
            "get a silently wrong gradient. Stop (or resume) recording around the whole "
            "enclosing cond or loop, or move the write out of the nested one."
        )
    return states == {False}


def _entered_stack() -> List[List[Any]]:
    """Per cond or loop being traced in this thread, outermost first: the
    recorders (``_recorders.recording_now``) recording as it was entered,
    which record its op."""
    found = getattr(_entered, "stack", None)
    if found is None:
        found = _entered.stack = []
    return found


_entered = threading.local()


@contextlib.contextmanager
def _entering() -> Iterator[None]:
    stack = _entered_stack()
    stack.append(_recorders.recording_now())
    try:
        yield
    finally:
        stack.pop()


def _branch_version(branch: Any, var: Any, value: Any, after: Any, taped: Optional[Any] = None) -> None:
    """Makes ``value`` the variable's latest value in ``branch``: a handle for
    reads later in the branch (run after ``after``), whose registered gradient
    goes to ``value``, and the value the cond will return. ``taped``, if
    given, is what the handle is recorded from on the tapes recording in the
    branch (a write one tape did not record, another did)."""
    if branch.carried is not None and var._unique_id not in branch.carried:
        # A loop body writes a variable its loop does not carry yet: ask the
        # loop to trace again, carrying it (see ``while_loop``).
        _retry.request = (branch.token, var)
        raise _NotCarried(f"{var.name!r} is written in a loop body that does not carry it yet")
    branch.versions[var._unique_id] = _version_handle(branch, var, value, after, taped)
    branch.values[var._unique_id] = (var, value)
    branch.scope.canonical[id(_versions.canonical_handle(var))] = var


def rebase_for_recorder(tape: Any) -> List[str]:
    """A plain tape was just entered inside a cond branch or loop body of a
    tape's graph: the variables the body has a value for (written in it, or
    carried by its loop) get that value again, read through their current
    handle, on the new tape.

    A cond nested in the body is handed each variable's latest *value*
    (``_inherit``), made before the plain tape was entered, so that tape
    would follow a write in the nested cond back to that value and stop
    there: its source, the handle current at its entry (whose gradient goes
    to that value, not from it), would get None. Read through the handle, the
    value's gradient reaches the handle, and from it, by the handle's own
    gradient, the value before.

    The read is recorded on ``tape`` (a plain ``GradientTape`` just entered)
    whether or not it watches accessed variables: one that does not may
    watch the variable later. Returns the unique ids of the variables read so.
    """
    found = _branches.cond_context()
    if found is None or found[1] is None or pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return []
    branch = found[1]
    written: Dict[str, Any] = {}
    for b in _branches._chain(branch):
        for uid, (var, _) in b.values.items():
            written.setdefault(uid, var)
    rebased = []
    for uid in sorted(written):
        if branch.carried is not None and uid not in branch.carried:
            continue  # a loop body that does not carry it: left as it was
        var = written[uid]
        handle = branch.version_of(var)
        eager_tape.watch(tape._tape, handle)  # the read below is recorded on it
        value = gen_resource_variable_ops.read_variable_op(handle, var.dtype)
        _branch_version(branch, var, value, value)
        rebased.append(uid)
    return rebased


# -- duplicate indices under XLA -------------------------------------------------

_POISON_GRAD = "AssigntapeDuplicateIndices"


@ops.RegisterGradient(_POISON_GRAD)
def _poison_grad(op: Any, grad: Any, _: Any) -> List[Any]:
    """NaN where the write's indices repeat: the gradient there depends on how
    TensorFlow combined the duplicates, which the rule does not model."""
    if grad is None:
        return [None, None]
    grad = ops.convert_to_tensor(grad)
    nan = array_ops.fill(array_ops.shape(grad), math_ops.cast(float("nan"), grad.dtype))
    return [array_ops.where(op.inputs[1], nan, grad), None]


def _poison_duplicates(op_name: str, var: Any, arguments: Dict[str, Any], value: Any) -> Any:
    """``value``, whose gradient is NaN at every position a scatter write wrote
    more than once, for a write whose gradient depends on the order of
    duplicates (``_rules._no_duplicates``) compiled by XLA, where the check that
    refuses it at run time is dropped. Indices known while tracing were refused
    already; any other value is returned as it is."""
    if not control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        return value
    nd_form = op_name.startswith("ResourceScatterNd")
    prefix = "ResourceScatterNd" if nd_form else "ResourceScatter"
    # The scatter writes with a combine of their own (update, mul, div, min,
    # max) are the ones _no_duplicates guards; add and sub sum duplicates.
    if not op_name.startswith(prefix) or op_name[len(prefix) :].lower() not in _rules.COMBINES:
        return value
    idx = _rules._nd(arguments["indices"], nd_form)
    idx = array_ops.reshape(idx, [-1, idx.shape[-1]])
    repeated = _rules._repeated(var, idx)
    # One flag per written row, spread over the positions it writes.
    rows = _rules.gather_rows(value, idx)
    flags = math_ops.cast(repeated, "float32")
    trailing = array_ops.ones_like(array_ops.shape(rows)[1:])
    flags = array_ops.reshape(flags, array_ops.concat([array_ops.shape(flags), trailing], 0))
    hits = array_ops.scatter_nd(
        idx, array_ops.broadcast_to(flags, array_ops.shape(rows)), array_ops.shape(value, out_type=idx.dtype)
    )
    with ops.get_default_graph().gradient_override_map({"IdentityN": _POISON_GRAD}):
        return array_ops.identity_n([value, math_ops.greater(hits, 0.0)])[0]


def write_in_body(
    scope: Any, branch: Any, around: Any, variables: List[Any], write: Callable[[Any], Any], what: str
) -> Any:
    """The one path of a write of ``variables`` that goes to a body, by
    ``write(body)``, which makes it that body's (a handle and value in the
    body, which leave it with the cond or loop): in a cond branch or loop
    body of the tape's own graph (``branch``), or, by a tape opened inside
    another tape's cond branch or loop body (``around``,
    ``_branches.branch_around``; ``branch`` None), in that body, so that it
    leaves the body for the outer tape, each of ``variables`` then getting
    the body's new handle as its version on this tape too. (Every write op,
    fused kernel and cond or loop output goes through here, or, at the
    tape's own level, makes its version there.)"""
    if branch is not None:
        return write(branch)
    olds = [scope.current.get(var._unique_id, around.version_of(var)) for var in variables]
    result = write(around)
    recorded = not pywrap_tfe.TFE_Py_TapeSetIsStopped()
    for var, old in zip(variables, olds):
        scope.advance(var, old, around.versions[var._unique_id], _record.WriteRecord(what, recorded=recorded))
    return result


def _leave(scope: Any, parent: Any, var: Any, value: Any, what: str) -> None:
    """After a cond or loop, ``value`` (its output) is the variable's value in the
    graph around it: a new version there, or, inside a branch or loop body, that
    body's latest value."""
    around = None if parent is not None else _branches.branch_around(scope)
    if parent is not None or around is not None:
        write_in_body(scope, parent, around, [var], lambda body: _branch_version(body, var, value, value), what)
        return
    old = scope.current_version(var)
    new = top_version(scope, var, old, value, [value], _rules.identity_backward)
    record.record_operation(what, [new], [value], _rules.identity_backward, forward_function=lambda t: [t])
    scope.advance(var, old, new, _record.WriteRecord(what))


# -- loops ---------------------------------------------------------------------

# The call ops TensorFlow puts around a loop for tape gradients
# (``control_flow_util_v2.run_as_function_for_tape_gradients``).
_CALL_OPS = ("StatefulPartitionedCall", "PartitionedCall")


def written_again(handles: List[Any], variables: List[Any], final: List[Any]) -> List[Any]:
    """After a loop that wrote ``variables`` (their handles before it,
    ``handles``; their values after it, ``final``): the values to make their
    versions from.

    With a persistent tape or nested tapes recording, TensorFlow builds the
    While op inside a function call (``cflow_gradient_wrapper``), and a
    gradient through the loop taken later in the same graph (``tf.gradients``,
    an inner tape's ``gradient``) turns that call into a forward function with
    the accumulators as extra outputs. XLA then drops the order of the loop's
    resource writes: a read after the loop sees the value from before it, and
    a write after it is overwritten by the loop's (plain TensorFlow too). So
    after such a loop each variable is written once more, at this level, with
    the value the loop carried out of it, which is the value it wrote (without
    XLA a write of the same value); later reads and writes are ordered after
    that write. Not recorded: the version made after it has the loop's value
    as its gradient path."""
    if not any(getattr(getattr(t, "op", None), "type", None) in _CALL_OPS for t in final):
        return final
    assign = unwrapped(gen_resource_variable_ops.assign_variable_op)
    with record.stop_recording():
        writes = [assign(handle, value) for handle, value in zip(handles, final)]
    with ops.control_dependencies(writes):
        # Recorded identities: the tapes' path from each version to the loop.
        return [array_ops.identity(value) for value in final]


class _NotCarried(BaseException):
    """Internal: a loop body wrote a variable its loop did not carry.

    A ``BaseException``, as ``GeneratorExit`` is: it passes through the
    user's loop body on its way to ``_control_flow.while_loop``, and an
    ``except Exception`` there (logging and going on) must not take it for
    an error of the write (the loop would not be traced again, and its
    gradient would silently be None)."""


# The retry request travels beside the exception: AutoGraph and TensorFlow may
# re-wrap an exception raised while tracing, but not this thread-local.
_retry = threading.local()
