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
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, Tuple

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import record
from tensorflow.python.framework import ops
from tensorflow.python.ops import (
    array_ops,
    gen_resource_variable_ops,
    handle_data_util,
    math_ops,
    resource_variable_ops,
)

from assigntape import _rules, _versions
from assigntape._wrapping import bind, params_of

__all__ = ["branch_write", "cond", "build_cond", "while_loop"]

_BRANCH_VERSION_GRAD = "AssigntapeBranchVersion"


@ops.RegisterGradient(_BRANCH_VERSION_GRAD)
def _branch_version_grad(op: Any, grad_handle: Any, grad_value: Any) -> List[Any]:
    """A branch version's handle is the value written: reads of it send their
    gradient (which arrives at the handle) to that value."""
    grads = [ops.convert_to_tensor(g) for g in (grad_handle, grad_value) if g is not None]
    return [None, math_ops.add_n(grads) if grads else None]


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
    old_value = gen_resource_variable_ops.read_variable_op(old, var.dtype)
    value = rule.value(old_value, arguments)
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
    _branch_version(branch, var, value, result)
    return result


def _branch_version(branch: Any, var: Any, value: Any, after: Any) -> None:
    """Makes ``value`` the variable's latest value in ``branch``: a handle for
    reads later in the branch (run after ``after``), whose registered gradient
    goes to ``value``, and the value the cond will return."""
    if branch.carried is not None and var._unique_id not in branch.carried:
        # A loop body writes a variable its loop does not carry yet: ask the
        # loop to trace again, carrying it (see ``while_loop``).
        _retry.request = (branch.token, var)
        raise _NotCarried(f"{var.name!r} is written in a loop body that does not carry it yet")
    # The handle's resource input is the tape-level version, made outside every
    # body: a loop's gradient cannot use a resource made in a loop body. The
    # control dependency, not the input, orders later reads after ``after``.
    root = branch.scope.current_version(var)
    with ops.control_dependencies([after]), ops.get_default_graph().gradient_override_map(
        {"IdentityN": _BRANCH_VERSION_GRAD}
    ):
        handle = array_ops.identity_n([root, value])[0]
    handle_data_util.copy_handle_data(root, handle)
    branch.versions[var._unique_id] = handle
    branch.values[var._unique_id] = (var, value)
    branch.scope.owners[id(handle)] = var
    branch.scope.canonical[id(_versions.canonical_handle(var))] = var


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
            branch = _versions.open_branch(scope, parent)
            branches.append(branch)
            try:
                out = fn()
            finally:
                _versions.close_branch(branch)
            return out, {uid: value for uid, (_, value) in branch.values.items()}

        return branch_fn

    arguments["true_fn"] = traced(arguments["true_fn"])
    arguments["false_fn"] = traced(arguments["false_fn"])
    _pending.append(branches)
    try:
        out, values = wrapped(**arguments)
    finally:
        _pending.remove(branches)
    written = {uid: var for b in branches for uid, (var, _) in b.values.items()}
    for uid in sorted(values):
        _leave(scope, parent, written[uid], values[uid], "tf.cond")
    return out


def _leave(scope: Any, parent: Any, var: Any, value: Any, what: str) -> None:
    """After a cond or loop, ``value`` (its output) is the variable's value in the
    graph around it: a new version there, or, inside a branch or loop body, that
    body's latest value."""
    if parent is not None:
        _branch_version(parent, var, value, value)
        return
    old = scope.current_version(var)
    new = _versions.new_version(old, value)
    record.record_operation(what, [new], [value], lambda g: [g])
    scope.advance(var, old, new, _versions.WriteRecord(what))


_pending: List[List[Any]] = []


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
                # This branch leaves the variable as it was: its value, read here.
                var = written[uid]
                values[uid] = gen_resource_variable_ops.read_variable_op(branch.outer_version_of(var), var.dtype)
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
            return _carrying(wrapped, arguments, scope, parent, carried, token)
        except Exception:
            request = getattr(_retry, "request", None)
            if request is None or request[0] is not token:
                raise
            _retry.request = None
            if any(v is request[1] for v in carried):
                raise
            carried.append(request[1])


def _carrying(
    wrapped: Callable[..., Any], arguments: Dict[str, Any], scope: Any, parent: Any, carried: List[Any], token: Any
) -> Any:
    """Builds the loop with ``carried``'s values as extra loop state."""
    loop_vars = arguments["loop_vars"]
    user_cond, user_body = arguments["cond"], arguments["body"]
    if not carried:
        # First attempt: carry nothing, but watch the body for writes.
        def watched_body(*state: Any) -> Any:
            body = _versions.open_branch(scope, parent, [], token)
            try:
                return user_body(*state)
            finally:
                _versions.close_branch(body)

        return wrapped(**dict(arguments, body=watched_body))
    n = len(loop_vars)
    uids = [v._unique_id for v in carried]
    outer = [_versions.version_in(scope, parent, v) for v in carried]
    start = tuple(gen_resource_variable_ops.read_variable_op(h, v.dtype) for h, v in zip(outer, carried))
    for v in carried:
        resource_variable_ops.variable_accessed(v)  # the start value's gradient goes to v

    def cond_fn(*state: Any) -> Any:
        return user_cond(*state[:n])

    def body_fn(*state: Any) -> Any:
        body = _versions.open_branch(scope, parent, uids, token)
        try:
            for v, value in zip(carried, state[n]):
                # This iteration's value of v is the state it was handed.
                _branch_version(body, v, value, value)
            out = user_body(*state[:n])
        finally:
            _versions.close_branch(body)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        return out + [tuple(body.values[uid][1] for uid in uids)]

    invariants = arguments.get("shape_invariants")
    if invariants is not None:
        invariants = list(invariants) + [tuple(t.shape for t in start)]
    result = wrapped(
        **dict(arguments, cond=cond_fn, body=body_fn, loop_vars=list(loop_vars) + [start], shape_invariants=invariants)
    )
    for v, value in zip(carried, result[-1]):
        _leave(scope, parent, v, value, "tf.while_loop")
    rest = list(result[:-1])
    if not arguments.get("return_same_structure", True) and len(rest) == 1:
        return rest[0]
    return type(loop_vars)(rest) if isinstance(loop_vars, tuple) else rest
