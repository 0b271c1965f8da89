"""``tf.function``s called from an eager tape.

A function keeps the handles it captured when it was traced: the variables' own,
not their current versions. At call time those captures are mapped to the
current versions, so the function reads, and the gradient reaches, what the tape
wrote. Writes inside the function (or in functions it calls, or in its
control-flow bodies) happen out of the tape's sight: they are found from the
graph, once per function, and refused (or cut) before the function runs.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, List, Set

from tensorflow.python.framework import dtypes
from tensorflow.python.ops import resource_variable_ops

from assigntape import _rules, _versions
from assigntape._errors import UntrackedWriteError
from assigntape._wrapping import bind

__all__ = ["call_function"]


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


def call_function(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``ConcreteFunction._call_flat`` under an eager tape.

    A function keeps the handles it captured when it was traced: the variables'
    own. Map each to the variable's current version, so the function reads it
    and the gradient reaches it. A function that writes a tracked variable is
    refused (or cut): its writes happen inside the graph, out of the tape's sight.
    """
    scope = _versions.eager_scope()
    if scope is None:
        return wrapped(*args, **kwargs)
    arguments = bind(("tensor_inputs", "captured_inputs"), args, kwargs)
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
        if var is not None and _versions.differentiable(var) and scope.tracks(var)
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
        scope.advance(var, old, _versions.new_version(old, None), _versions.WriteRecord(f"tf.function {name!r}", cut=True))
    return result
