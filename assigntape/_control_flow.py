"""Writes inside ``tf.cond`` branches and graph loops, with the tape open in the
graph around them.

A tensor made in a branch cannot leave it, and the cond's gradient is
TensorFlow's symbolic one, which never sees what the tape recorded inside. So in
a branch the real write runs and, beside it, the variable's whole new value is
built from plain ops (``Rule.value``: the functional rewrite of each
write); reads later in the branch get a handle whose registered gradient goes to
that value. ``cond`` makes both branches return the values of every variable
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
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from assigntape import _fused, _record, _rules, _versions
from assigntape._errors import ControlFlowWriteError, SavedModelError
from assigntape._tf import (
    array_ops,
    attr_value_pb2,
    auto_control_deps,
    composite_tensor,
    context,
    control_flow_util,
    default_gradient,
    dtypes,
    eager_tape,
    forwardprop,
    gen_resource_variable_ops,
    gradients_util,
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
from assigntape._wrapping import bind, params_of

__all__ = ["branch_write", "cond", "build_cond", "while_loop", "write_around"]

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
    root = _versions.outermost(branch.scope).current_version(var)
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
    branch = _versions.open_branch(scope, parent, carried, token)
    try:
        _inherit(branch)
    except BaseException:
        _versions.close_branch(branch)
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
    states = {_versions.records(r) for entered in _entered_stack() for r in entered}
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
    recorders (``_versions.recording_now``) recording as it was entered,
    which record its op."""
    found = getattr(_entered, "stack", None)
    if found is None:
        found = _entered.stack = []
    return found


_entered = threading.local()


@contextlib.contextmanager
def _entering() -> Iterator[None]:
    stack = _entered_stack()
    stack.append(_versions.recording_now())
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
    found = _versions.cond_context()
    if found is None or found[1] is None or pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return []
    branch = found[1]
    written: Dict[str, Any] = {}
    for b in _versions._chain(branch):
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


def cond(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``cond_v2.cond_v2`` (``tf.cond``, autograph ``if``) in the graph of a tape.

    Each branch also returns the values of the variables it wrote (``Branch``);
    ``build_cond`` makes both branches return the same set, the other branch
    returning its unchanged value. After the cond, each written variable gets
    a new version whose gradient flows into the cond's output, and from there,
    by the cond's own gradient, into whichever branch ran.
    """
    found = _versions.cond_context()
    if found is None:
        return wrapped(*args, **kwargs)
    scope, parent = found
    arguments = bind(("pred", "true_fn", "false_fn", "name"), args, kwargs)
    branches: List[Any] = []

    def traced(fn: Callable[[], Any]) -> Callable[[], Any]:
        def branch_fn() -> Any:
            branch = _open(scope, parent)
            branches.append(branch)
            try:
                out = _read_now(fn())
            finally:
                _versions.close_branch(branch)
            # The user's outputs keep their structure, whatever it is: they are
            # one item of this pair, and only the pair is taken apart.
            return out, {uid: value for uid, (_, value) in branch.values.items()}

        return branch_fn

    arguments["true_fn"] = traced(arguments["true_fn"])
    arguments["false_fn"] = traced(arguments["false_fn"])
    _pending.append(branches)
    try:
        with _entering():
            out, values = wrapped(**arguments)
        _note_recorders((out, values), [b.graph for b in branches])
        _refuse_xla_forward_mode(_control_op((out, values)), branches)
    except (TypeError, ValueError, AssertionError) as error:
        _refuse_forward_mode_failure(error, [var for b in branches for var, _ in b.values.values()], "cond")
        raise
    finally:
        _pending.remove(branches)
    written = {uid: var for b in branches for uid, (var, _) in b.values.items()}
    for uid in sorted(values):
        _leave(scope, parent, written[uid], values[uid], "tf.cond")
    return out


def indexed_case(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``cond_v2.indexed_case`` (``tf.switch_case``): its op noted for the tapes
    that record it bare (``_note_recorders``). (Writes in its branches are not
    followed, as before.)"""
    arguments = bind(("branch_index", "branch_fns", "name", "lower_using_switch_merge"), args, kwargs)
    graphs: List[Any] = []

    def traced(fn: Callable[[], Any]) -> Callable[[], Any]:
        def branch_fn() -> Any:
            graphs.append(ops.get_default_graph())
            return fn()

        return branch_fn

    arguments["branch_fns"] = [traced(fn) for fn in arguments["branch_fns"]]
    out = wrapped(**arguments)
    _note_recorders(out, graphs)
    return out


def write_around(scope: Any, around: Any, variables: List[Any], write: Callable[[], Any], what: str) -> Any:
    """A write by a tape (``scope``) opened inside another tape's cond branch
    or loop body (``around``): ``write()`` makes it that body's (so that it
    leaves the body for the outer tape), and each of ``variables`` then gets
    the body's new handle as its version on this tape."""
    olds = [scope.current.get(var._unique_id, around.version_of(var)) for var in variables]
    result = write()
    recorded = not pywrap_tfe.TFE_Py_TapeSetIsStopped()
    for var, old in zip(variables, olds):
        scope.advance(var, old, around.versions[var._unique_id], _versions.WriteRecord(what, recorded=recorded))
    return result


def _leave(scope: Any, parent: Any, var: Any, value: Any, what: str) -> None:
    """After a cond or loop, ``value`` (its output) is the variable's value in the
    graph around it: a new version there, or, inside a branch or loop body, that
    body's latest value."""
    if parent is not None:
        _branch_version(parent, var, value, value)
        return
    around = _versions.branch_around(scope)
    if around is not None:
        write_around(scope, around, [var], lambda: _branch_version(around, var, value, value), what)
        return
    old = scope.current_version(var)
    if scope.key is None:
        new = _versions.new_version(old, value)
    else:
        # Connected to the value in the graph too, as a write at the top level
        # is: the graph's own gradient (tf.gradients, and TensorFlow's
        # gradient of a call of the function) follows it.
        new = symbolic_version(var, old, value, [value], _rules.identity_backward)
    record.record_operation(what, [new], [value], _rules.identity_backward, forward_function=lambda t: [t])
    scope.advance(var, old, new, _versions.WriteRecord(what))


def possible_gradient_types(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``gradients_util.PossibleTapeGradientTypes``, asked by a cond, case or
    loop being built and by a function call, which gradient functions to
    prepare: in the graph where a tape of ours records, always those for
    higher order, as for a persistent tape.

    With one non-persistent tape recording, TensorFlow records a graph cond,
    case, loop or call bare and prepares first-order gradients only. But
    ``tf.gradients`` inside the tape (a gradient penalty, MAML's inner step, a
    Jacobian) makes the op output intermediates after the tape recorded it,
    and the gradient ops the tape records next read them: the tape drops their
    cotangents (a plain tape is then silently wrong, returns None or fails an
    assertion). Prepared for higher order, the op sits in a function call whose
    recorded gradient outputs every intermediate up front."""
    kind = wrapped(*args, **kwargs)
    if kind != gradients_util.POSSIBLE_GRADIENT_TYPES_FIRST_ORDER or context.executing_eagerly():
        return kind
    # Only for ops built in the very graph where a tape of ours records, not
    # in a function traced there (whose trace TensorFlow caches for every
    # later caller) nor in a branch or body (wrapped at every level, pfor
    # cannot vectorize a Jacobian through a cond in a loop or in a cond).
    scope = getattr(_versions._tls, "scopes", {}).get(ops.get_default_graph())
    if scope is None or not any(r.recording() for r in scope.records):
        return kind
    # Not with an accumulator recording (TensorFlow's forward mode through the
    # wrapped op fails to build), nor under XLA for a cond or loop that writes
    # a variable (the wrapped op then fails to build). There the op stays
    # bare, and the tape completes its record of it (``complete_record``).
    if any(isinstance(r, forwardprop.ForwardAccumulator) for r in _versions.recording_now()):
        return kind
    if _building_writes() and control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        return kind
    return gradients_util.POSSIBLE_GRADIENT_TYPES_HIGHER_ORDER


def _building_writes() -> bool:
    """Whether a cond whose branches write, or a loop that carries written
    variables, is being built in this thread."""
    return bool(getattr(_carrying_now, "depth", 0)) or any(b.values for branches in _pending for b in branches)


# How many AssignAwareTape gradients this thread is computing (``branch_gradient``).
_differentiating = threading.local()


def differentiating(delta: int) -> None:
    """Counts this thread into (``+1``) or out of (``-1``) an AssignAwareTape's gradient."""
    _differentiating.depth = getattr(_differentiating, "depth", 0) + delta


# Branch and body graphs of the conds, cases and loops built through ``cond``,
# ``indexed_case`` and ``while_loop`` -> (a weak reference to the op, its number
# of outputs then, the non-persistent tapes of ours that recorded it bare):
# ``_note_recorders``, read by ``_note_gradient``.
_built_under: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()

_CONTROL_OPS = ("If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase")


def _control_op(tensors: Any) -> Any:
    """The If or While op that produced ``tensors`` (directly or through the
    identities cond_v2 and while_v2 put after it), or None (TensorFlow wrapped
    it in a function call, or there are no outputs)."""
    for t in nest.flatten(tensors, expand_composites=True):
        op = getattr(t, "op", None)
        if op is None:
            continue
        if op.type in _CONTROL_OPS:
            return op
        if op.type == "Identity" and op.inputs and op.inputs[0].op.type in _CONTROL_OPS:
            return op.inputs[0].op
    return None


@contextlib.contextmanager
def _paused(recorder: Any) -> Iterator[None]:
    if isinstance(recorder, _record.Record):
        recorder.pause()
        try:
            yield
        finally:
            recorder.resume()
    else:
        recorder._pop_tape()
        try:
            yield
        finally:
            recorder._push_tape()


@contextlib.contextmanager
def _alone(others: List[Any]) -> Iterator[None]:
    """``others`` (recorders) set aside: what records now is what is left."""
    with contextlib.ExitStack() as stack:
        for other in others:
            stack.enter_context(_paused(other))
        yield


def _records_alone(recorder: Any, others: List[Any], inputs: List[Any]) -> bool:
    """Whether ``recorder`` alone records an op of ``inputs`` (the others set aside)."""
    with _alone(others):
        return bool(pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop(inputs))


def _note_recorders(tensors: Any, graphs: List[Any]) -> None:
    """A cond, case or loop was built, with branch or body ``graphs``: which
    non-persistent tapes of ours recorded its op bare (TensorFlow wraps it in
    a function when a persistent tape or more than one could differentiate
    it; a tape differentiates such a call whole)."""
    op = _control_op(tensors)
    if op is None or pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return
    inputs = list(op.inputs)
    recorders = [r for r in _versions.recording_now() if not isinstance(r, forwardprop.ForwardAccumulator)]
    ours = [r for r in recorders if isinstance(r, _record.Record) and not getattr(r.tape, "_persistent", True)]
    if not ours or not pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop(inputs):
        return
    recorded = [r for r in ours if _records_alone(r, [o for o in recorders if o is not r], inputs)]
    if recorded:
        # (A weak reference to the op: a value of _built_under must not keep its key.)
        noted = (weakref.ref(op), len(op.outputs), weakref.WeakSet(recorded))
        for graph in graphs:
            _built_under[graph] = noted


def _note_gradient(graph: Any) -> None:
    """The gradient of the cond, case or loop of ``graph`` (a branch or body)
    is being built. A tape that recorded the op bare and records now records
    the ops of that gradient, which may read outputs the gradient adds to the
    op after the tape recorded it, which the tape has no record of (a plain
    tape fails an assertion there, or is silently wrong). The op is noted on
    the tape's record, for ``complete_record``. (An op no tape of ours
    recorded bare is not noted: built before the tape, or inside a function
    TensorFlow wrapped it in.)"""
    noted = _built_under.get(graph)
    if noted is None or not record.could_possibly_record() or pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return
    op_ref, count, recorded = noted
    for found in _versions.recording_now():
        if found in recorded:
            found.suspects.setdefault(id(op_ref), (op_ref, count))


def complete_record(found: Any) -> None:
    """Before ``found`` (a tape's record) is differentiated: the conds, cases
    and loops it recorded bare in this graph whose gradient, built while it
    recorded, made the op output more than it did when recorded.

    The tape has no record of those outputs, which the gradient ops it
    recorded read: a plain tape drops their cotangents (silently wrong where
    they depend on what it differentiates: a branch's ``sin(x) * x`` outputs
    ``sin(x)``) or fails an assertion. They are recorded now, on this tape
    alone, as made from the op's inputs by the op, with the op's own gradient
    (zero cotangents for the other outputs); the gradient through the op is
    then the sum of the two records', which is the op's gradient. A loop's
    gradient gives no cotangent to the outputs an earlier gradient added, so
    for a loop that record refuses, if the tape's gradient reaches it.
    """
    graph = ops.get_default_graph()
    for key, (op_ref, count) in list(found.suspects.items()):
        op = op_ref()
        if op is None or op.graph is not graph or len(op.outputs) <= count:
            continue
        found.suspects[key] = (op_ref, len(op.outputs))
        _record_outputs(found, op, count, len(op.outputs))


def _record_outputs(found: Any, op: Any, start: int, stop: int) -> None:
    """Records ``op.outputs[start:stop]`` on the tape of ``found`` alone."""
    added = op.outputs[start:stop]

    def backward(*grads: Any) -> Any:
        if op.type in ("While", "StatelessWhile"):
            raise ControlFlowWriteError(
                f"tf.gradients (or another tape's gradient) went through the graph loop {op.name!r} "
                "while this tape recorded, and this tape's gradient goes through what it computed, as "
                "for a second derivative or a gradient penalty. TensorFlow made the loop output "
                "intermediates after the tape recorded it, and its loop gradient gives them no "
                "cotangent (a plain tf.GradientTape is silently wrong here). Make this tape "
                "persistent=True, or take the inner gradient with a tape inside this one instead "
                "of tf.gradients."
            )
        outputs = op.outputs
        cotangents = [default_gradient.zeros_like(t) for t in outputs[:start]]
        cotangents += [default_gradient.zeros_like(t) if g is None else g for t, g in zip(added, grads)]
        cotangents += [default_gradient.zeros_like(t) for t in outputs[stop:]]
        return ops.get_gradient_function(op)(op, *cotangents)

    tape = found.tape
    others = [
        r for r in _versions.recording_now() if r is not found and not isinstance(r, forwardprop.ForwardAccumulator)
    ]
    with _alone(others), contextlib.ExitStack() as stack:
        if not found.recording():  # closed: on its tape for this record only
            tape._push_tape()
            stack.callback(tape._pop_tape)
        record.record_operation_backprop_only(op.type, added, list(op.inputs), backward)


def branch_gradient(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``cond_v2._grad_fn(func_graph, grads)``, the gradient of one branch of a
    cond, when a tape of ours asks it with fewer cotangents than the branch
    has outputs.

    That happens when ``tf.gradients`` went through the cond first: it made the
    If op output the intermediates its gradient reads, after a tape had recorded
    the op with the outputs it had then. TensorFlow then fails an assertion (a
    plain tape does too, with no variable: its own bug, left as it is outside
    our gradients). The branch is differentiated from the outputs the tape saw,
    with zero cotangents for the extra ones: the cotangents they do get, if the
    tape recorded ops reading them, flow through a record of their own
    (``complete_record``), and the op's gradient is the sum of the two.)"""
    func_graph, grads = bind(_params(wrapped), args, kwargs).values()
    outputs = func_graph.outputs
    _note_gradient(func_graph)
    if len(outputs) <= len(grads) or not getattr(_differentiating, "depth", 0):
        return wrapped(*args, **kwargs)
    # ``_grad_fn`` pairs ``func_graph.outputs`` with ``grads`` and reads nothing
    # else of them; the graph is shown its first outputs only while it does.
    func_graph.outputs = outputs[: len(grads)]
    try:
        return wrapped(func_graph, grads)
    finally:
        func_graph.outputs = outputs


def loop_gradient(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``while_v2._create_grad_func``, called by the gradient of a While op:
    noted (``_note_gradient``). (TensorFlow gives no cotangent to the outputs
    an earlier gradient added to the op, which is right unless a tape
    recorded ops reading them: such a tape of ours refuses, ``complete_record``.)"""
    body = bind(_params(wrapped), args, kwargs)["body_graph"]
    _note_gradient(body)
    try:
        return wrapped(*args, **kwargs)
    except ValueError as error:
        # Seen when tf.gradients went through a graph loop inside this loop's
        # body and the body writes a variable: the inner gradient reads the
        # write's version handle, made in the body (plain TF has no such handle).
        if "creates a resource in its body" not in str(error) or body not in _writing_bodies:
            raise
        raise ControlFlowWriteError(
            f"TensorFlow cannot differentiate the graph loop {body.name!r}: its body makes a "
            "resource that the gradient needs, as when tf.gradients goes through a graph loop "
            "inside a loop body that writes a variable. Take that inner gradient with a tape "
            "opened inside the loop body instead of tf.gradients."
        ) from error


_pending: List[List[Any]] = []

# How many loops that carry written variables this thread is building (``_carrying``).
_carrying_now = threading.local()

# The body graphs of the graph loops that carry written variables (``_carrying``).
_writing_bodies: "weakref.WeakSet[Any]" = weakref.WeakSet()


def build_cond(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``cond_v2._build_cond``, for a cond ``cond`` traced: give both branches
    the same extra outputs, the union of the variables either one wrote."""
    arguments = bind(_params(wrapped), args, kwargs)
    graphs = {id(arguments["true_graph"]), id(arguments["false_graph"])}
    branches = next((b for b in _pending if {id(x.graph) for x in b} == graphs), None)
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
                # This branch leaves the variable as it was: its value, read here
                # through the branch's own handle (never one of the graph around).
                var = written[uid]
                values[uid] = gen_resource_variable_ops.read_variable_op(branch.version_of(var), var.dtype)
        graph.structured_outputs = (out, values)
        graph.outputs[:] = base + [values[uid] for uid in sorted(values)]
    true_graph, false_graph = arguments["true_graph"], arguments["false_graph"]
    arguments["true_inputs"] = true_graph.external_captures
    arguments["false_inputs"] = false_graph.external_captures
    return wrapped(**arguments)


@functools.lru_cache(maxsize=None)
def _params(function: Any) -> Tuple[str, ...]:
    return tuple(params_of(function))


# -- loops ---------------------------------------------------------------------


class _NotCarried(Exception):
    """Internal: a loop body wrote a variable its loop did not carry."""


# The retry request travels beside the exception: AutoGraph and TensorFlow may
# re-wrap an exception raised while tracing, but not this thread-local.
_retry = threading.local()


def while_loop(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``while_v2.while_loop`` (``tf.while_loop``, autograph ``for``/``while`` on
    tensors) in the graph of a tape.

    A version made in a loop body can leave it only as loop state. So every
    variable the body writes is carried: its value is one more loop variable,
    reads in the body get a handle fed by that state, each write's functional
    value becomes the next state, and after the loop the final state makes the
    variable's new version; the loop's own gradient does the rest. Which
    variables the body writes is known only once it is traced, so the body is
    traced again, carrying one more variable, each time it writes one it did
    not carry (as TensorFlow itself may trace a function more than once).
    """
    found = _versions.cond_context()
    if found is None:
        return wrapped(*args, **kwargs)
    scope, parent = found
    arguments = bind(_params(wrapped), args, kwargs)
    token = object()
    carried: List[Any] = []
    while True:
        try:
            with _entering():
                return _carrying(wrapped, arguments, scope, parent, carried, token)
        except Exception:
            request = getattr(_retry, "request", None)
            if request is None or request[0] is not token:
                raise
            _retry.request = None
            if any(v is request[1] for v in carried):
                raise
            carried.append(request[1])


def _refuse_read_tangents(scope: Any, token: Any, carried: List[str]) -> None:
    """A loop body just traced reads a variable it does not write, through
    the variable's handle captured from outside, while a ``ForwardAccumulator``
    has a tangent for that handle: TensorFlow's forward mode through the loop
    does not carry a captured handle's tangent (it fails with "variable
    without handle data", or, beside a carried variable with a tangent, drops
    it: a silently wrong jvp). Refused while tracing, nothing run. (The
    variables the body writes, ``carried``, are written through their own
    handle, captured too: their values carry the tangents.)"""
    request = getattr(_retry, "request", None)
    if request is not None and request[0] is token:
        return  # traced again, carrying a written variable: checked then
    graph = ops.get_default_graph()
    for external, _ in getattr(graph, "captures", ()):
        if external.dtype != dtypes.resource:
            continue
        # The same handle in the graphs around: an accumulator in the function
        # watches the function's capture of the eager handle (its
        # placeholder), and a body nested in a body captures the outer body's.
        seen_as = {id(external): external}
        outer = getattr(graph, "outer_graph", None)
        while outer is not None:
            for outside, inside in getattr(outer, "captures", ()):
                if id(outside) in seen_as or id(inside) in seen_as:
                    seen_as[id(outside)], seen_as[id(inside)] = outside, inside
            outer = getattr(outer, "outer_graph", None)
        # Its own handle, or a version written before the loop.
        var = _versions.variable_of_handle(external)
        if var is None:
            var = scope.owners.get(id(external))
        if var is not None and var._unique_id in carried:
            continue  # written in the body: its value is carried, its handle written through
        _, tangents = pywrap_tfe.TFE_Py_PackJVPs(list(seen_as.values()))
        if tangents:
            name = repr(var.name) if var is not None else "a variable"
            raise ControlFlowWriteError(
                f"Forward mode through a graph loop that reads variable {name} without writing it, "
                "while a ForwardAccumulator has a tangent for it: TensorFlow does not carry the "
                "tangent of a variable captured by a loop body (the jvp would drop it). Read the "
                "variable once before the loop (x_value = x * 1.0) and use that tensor in the body, "
                f"or unroll the loop in Python{_TRACE_FIRST}."
            )


_TRACE_FIRST = (
    "; with the accumulator outside the tf.function, call the function once before "
    "opening it (traced outside the accumulator, it is differentiated right)"
)
# What TensorFlow's forward mode raises, while tracing, through a graph loop
# that writes a variable (README, Known limits).
_FORWARD_MODE_FAILURES = ("without handle data", "<dtype: 'variant'> is not compatible")


def _accumulator_recording() -> bool:
    """Whether a forward accumulator (TensorFlow's or ours) records in this thread."""
    return any(isinstance(r, forwardprop.ForwardAccumulator) for r in _versions.recording_now())


def _refuse_xla_forward_mode(op: Any, branches: List[Any]) -> None:
    """Under XLA, a cond whose inputs carry tangents for an open accumulator
    and whose branches capture a variable's resource: TensorFlow's forward
    mode through it does not compile (XLA's ``InvalidArgumentError``,
    "branch_shape", when the function runs; plain TensorFlow too). Refused
    while tracing instead, naming the variables."""
    if op is None or not control_flow_util.GraphOrParentsInXlaContext(op.graph):
        return
    if not _accumulator_recording():
        return
    _, tangents = pywrap_tfe.TFE_Py_PackJVPs(list(op.inputs))
    if not tangents:
        return
    captured = [t for b in branches for t in b.graph.external_captures if t.dtype == dtypes.resource]
    if not captured:
        return
    names = sorted({repr(var.name) for b in branches for var, _ in b.values.values()}) or ["a variable"]
    raise ControlFlowWriteError(
        f"Forward mode through a tf.cond that reads or writes {', '.join(names)} under jit_compile: "
        "TensorFlow's forward mode through a cond that captures a variable does not compile in XLA "
        "(InvalidArgumentError when the function runs, plain TensorFlow too), nothing ran. Compile "
        "without jit_compile, branch in Python, or take the gradient in reverse mode."
    )


def _failed_assertion(error: Exception) -> List[str]:
    """For an ``AssertionError`` raised in cond_v2 or while_v2 (under XLA, the
    forward mode of a cond beside a reverse tape fails there, plain TensorFlow
    too): where, as the text to name; else nothing."""
    if not isinstance(error, AssertionError):
        return []
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return []
    code = tb.tb_frame.f_code
    module = code.co_filename.rsplit("/", 1)[-1]
    if module not in ("cond_v2.py", "while_v2.py"):
        return []
    return [f"an assertion in {module[:-3]}.{code.co_name}"]


def _refuse_forward_mode_failure(error: Exception, written: List[Any], what: str) -> None:
    """TensorFlow failed to build the loop (or cond) that writes ``written``
    while a ``ForwardAccumulator`` is open here: its own forward mode through
    while_v2 or cond_v2 (alone, on the resource the body writes through;
    beside a reverse tape, in the gradient of the loop or cond, as in plain
    TensorFlow). Nothing has run. Raised as a ``ControlFlowWriteError`` that
    says what to do instead."""
    found = [text for text in _FORWARD_MODE_FAILURES if text in str(error)] or _failed_assertion(error)
    if not found:
        return
    if not _accumulator_recording():
        return
    names = ", ".join(sorted({repr(v.name) for v in written})) or "variables"
    remedy = (
        "Unroll the loop in Python (range instead of tf.range)"
        if what == "graph loop"
        else "Branch in Python, or use assigntape.ForwardAccumulator alone"
    ) + _TRACE_FIRST
    raise ControlFlowWriteError(
        f"Forward mode through a {what} that writes {names}: TensorFlow's own forward mode "
        f"through it failed while tracing ({type(error).__name__}: ...{found[0]}...), nothing "
        f"ran. {remedy}, or take the gradient in reverse mode."
    ) from error


def _carrying(
    wrapped: Callable[..., Any], arguments: Dict[str, Any], scope: Any, parent: Any, carried: List[Any], token: Any
) -> Any:
    """Builds the loop with ``carried``'s values as extra loop state.

    The loop state is the pair (the user's ``loop_vars``, the carried values):
    TensorFlow hands the body the user's part taken apart exactly as it would
    have without the pair, checks the body's result against it, and packs the
    result back into it, for any structure ``tf.nest`` knows (lists, tuples,
    namedtuples, dicts, attrs classes, nested), with its shape invariants."""
    loop_vars = arguments["loop_vars"]
    user_cond, user_body = arguments["cond"], arguments["body"]
    bodies: List[Any] = []  # the body's graphs (TensorFlow may trace it more than once)
    if not carried:
        # First attempt: carry nothing, but watch the body for writes.
        def watched_body(*state: Any) -> Any:
            bodies.append(ops.get_default_graph())
            body = _open(scope, parent, [], token)
            try:
                out = _read_now(user_body(*state))
                _refuse_read_tangents(scope, token, [])
                return out
            finally:
                _versions.close_branch(body)

        result = wrapped(**dict(arguments, body=watched_body))
        _note_recorders(result, bodies)
        return result
    uids = [v._unique_id for v in carried]
    outer = [_versions.version_in(scope, parent, v) for v in carried]
    start = tuple(gen_resource_variable_ops.read_variable_op(h, v.dtype) for h, v in zip(outer, carried))
    for v in carried:
        resource_variable_ops.variable_accessed(v)  # the start value's gradient goes to v

    def cond_fn(state: Any, values: Any) -> Any:
        return user_cond(*state)

    def body_fn(state: Any, values: Any) -> Any:
        bodies.append(ops.get_default_graph())
        _writing_bodies.add(bodies[-1])
        body = _versions.open_branch(scope, parent, uids, token)
        try:
            for v, value in zip(carried, values):
                # This iteration's value of v is the state it was handed.
                _branch_version(body, v, value, value)
            _inherit(body)
            out = _read_now(user_body(*state))
            _refuse_read_tangents(scope, token, uids)
        finally:
            _versions.close_branch(body)
        if not nest.is_nested(out):
            out = [out]  # as TensorFlow does: a body may return its only variable bare
        return out, tuple(body.values[uid][1] for uid in uids)

    invariants = arguments.get("shape_invariants")
    if invariants is not None:
        invariants = (invariants, tuple(t.shape for t in start))
    _carrying_now.depth = getattr(_carrying_now, "depth", 0) + 1
    try:
        result, final = wrapped(
            **dict(
                arguments,
                cond=cond_fn,
                body=body_fn,
                loop_vars=(loop_vars, start),
                shape_invariants=invariants,
                return_same_structure=True,
            )
        )
    except (TypeError, ValueError, AssertionError) as error:
        _refuse_forward_mode_failure(error, carried, "graph loop")
        raise
    finally:
        _carrying_now.depth -= 1
    _note_recorders((result, final), bodies)
    for v, value in zip(carried, final):
        _leave(scope, parent, v, value, "tf.while_loop")
    if arguments.get("return_same_structure", True):
        return result
    # As TensorFlow does without return_same_structure: one tensor comes back bare.
    flat = nest.flatten(result, expand_composites=True)
    return flat[0] if len(flat) == 1 else result
