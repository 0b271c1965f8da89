"""Writes inside ``tf.cond`` branches, with the tape open in the graph around them.

A tensor made in a branch cannot leave it, and the cond's gradient is
TensorFlow's symbolic one, which never sees what the tape recorded inside. So in
a branch the real write runs and, beside it, the variable's whole new value is
built from plain ops (``_rules.BRANCH_VALUES``: the functional rewrite of each
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

__all__ = ["branch_write", "cond", "build_cond"]

_BRANCH_VERSION_GRAD = "AssigntapeBranchVersion"


@ops.RegisterGradient(_BRANCH_VERSION_GRAD)
def _branch_version_grad(op: Any, grad_handle: Any, grad_value: Any) -> List[Any]:
    """A branch version's handle is the value written: reads of it send their
    gradient (which arrives at the handle) to that value."""
    grads = [ops.convert_to_tensor(g) for g in (grad_handle, grad_value) if g is not None]
    return [None, math_ops.add_n(grads) if grads else None]


def branch_write(
    op_name: str, rule: _rules.OpRule, wrapped: Callable[..., Any], arguments: Dict[str, Any], branch: Any, var: Any
) -> Any:
    """A write inside a ``tf.cond`` branch of the tape's graph.

    The real write runs. Beside it, the variable's new value is built from plain
    ops (the functional rewrite of ``_rules.BRANCH_VALUES``, reading the previous
    version), and a branch
    version handle is made whose symbolic gradient goes to that value, so reads
    later in the branch differentiate correctly. The cond returns the value as
    an extra output; ``cond`` makes the tape's version from it.
    """
    old = branch.version_of(var)
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
    _branch_version(branch, var, old, value, result)
    return result


def _branch_version(branch: Any, var: Any, old: Any, value: Any, after: Any) -> None:
    """Makes ``value`` the variable's latest value in ``branch``: a handle for
    reads later in the branch (run after ``after``), whose registered gradient
    goes to ``value``, and the value the cond will return."""
    with ops.control_dependencies([after]), ops.get_default_graph().gradient_override_map(
        {"IdentityN": _BRANCH_VERSION_GRAD}
    ):
        handle = array_ops.identity_n([old, value])[0]
    handle_data_util.copy_handle_data(old, handle)
    branch.versions[var._unique_id] = handle
    branch.values[var._unique_id] = (var, value)
    branch.scope.owners[id(handle)] = var


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
        var = written[uid]
        if parent is not None:
            # A cond inside a branch: its writes are that branch's writes.
            _branch_version(parent, var, parent.version_of(var), values[uid], values[uid])
            continue
        old = scope.current_version(var)
        new = _versions.new_version(old, values[uid])
        record.record_operation("If", [new], [values[uid]], lambda g: [g])
        scope.advance(var, old, new, _versions.WriteRecord("tf.cond"))
    return out


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
