"""``tf.gradients`` in a graph after the tape that wrote a variable exited.

Inside an ``AssignAwareTape`` open in a ``tf.function``'s graph, ``w`` names
its latest version, and ``tf.gradients(y, w)`` differentiates with respect to
it. After the tape exits, ``w`` is the variable's own handle again, which is
the version the tape started from: for a ``y`` that reads a version the
tape made, the gradient would go back through the tape's writes, where the
rewrite's ``w`` after the tape is its last version. So such a
``tf.gradients`` is refused, naming the variable. A ``y`` that reads ``w``
only after the tape (its own handle, holding the last version's value) gets
the right gradient and is plain TensorFlow, as is a variable no tape of the
graph wrote.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Set, Tuple

from assigntape import _branches
from assigntape._errors import ControlFlowWriteError
from assigntape._tf import executing_eagerly, nest, ops, resource_variable_ops

__all__ = ["gradients", "note_closed"]

# Per graph, for each variable (by unique id) written by tapes of ours that
# were open in it and have exited, the versions they made there.
_written: "weakref.WeakKeyDictionary[Any, Dict[str, List[Any]]]" = weakref.WeakKeyDictionary()
# Per graph, for each such variable, how many ops the graph had when the
# first tape that wrote it there closed, and the variable's name: an op made
# after that reads the variable's own handle, not a version (``_read_after``).
_closed_at: "weakref.WeakKeyDictionary[Any, Dict[str, Tuple[int, str]]]" = weakref.WeakKeyDictionary()


def note_closed(scope: Any, record: Any) -> None:
    """A tape closes in ``scope``: in a graph, what it wrote is noted there."""
    if scope.key is None:
        return
    written = {uid: list(versions) for uid, versions in record.versions.items() if versions}
    if written:
        try:
            noted = _written.setdefault(scope.key, {})
        except TypeError:
            return  # not weakly referable
        for uid, versions in written.items():
            noted.setdefault(uid, []).extend(versions)
        count = len(scope.key.get_operations())
        closed_at = _closed_at.setdefault(scope.key, {})
        for uid in written:
            closed_at.setdefault(uid, (count, record.owner_of(uid, written[uid][0]).name))


def gradients(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``gradients_util._GradientsHelper``, which ``tf.gradients`` calls:
    refused with respect to a variable a closed tape of this graph (or of
    one it is traced in) wrote, unless a tape of ours is open in it now.
    Always on: the tape has exited by then."""
    if not _written or executing_eagerly():
        return wrapped(*args, **kwargs)
    written: Dict[str, List[Any]] = {}
    # The graph built in, and the graph differentiated (``src_graph``:
    # TensorFlow's gradient of a call of a function, built in a graph of its own).
    src_graph = kwargs.get("src_graph", args[9] if len(args) > 9 else None)
    for graph in (ops.get_default_graph(), src_graph):
        while graph is not None:
            for uid, versions in _written.get(graph, {}).items():
                written.setdefault(uid, []).extend(versions)
            graph = getattr(graph, "outer_graph", None)
    if not written:
        return wrapped(*args, **kwargs)
    found = _branches.call_context()
    if found is not None and found[0].key is not None:
        return wrapped(*args, **kwargs)  # inside a tape: ``w`` names its latest version
    xs = kwargs.get("xs", args[1] if len(args) > 1 else None)
    ys = kwargs.get("ys", args[0] if args else None)
    _refuse_read_after(nest.flatten(ys), nest.flatten(xs), written)
    for x in nest.flatten(xs):
        if (
            isinstance(x, resource_variable_ops.BaseResourceVariable)
            and x._unique_id in written
            and _reaches(nest.flatten(ys), {id(v) for v in written[x._unique_id]})
        ):
            raise ControlFlowWriteError(
                f"tf.gradients with respect to variable {x.name!r} after the AssignAwareTape that "
                "wrote it in this tf.function exited: there the variable is the version the tape "
                "started from, so the gradient would go back through the tape's writes instead of "
                "being taken with respect to the variable's last version. Take tf.gradients inside "
                f"the tape, or use tape.gradient(y, {x.name.split(':')[0]}) (a persistent tape for several)."
            )
    return wrapped(*args, **kwargs)


def _reaches(ys: List[Any], versions: Set[int]) -> bool:
    """Whether a tensor of ``ys`` is computed from one of ``versions`` (by
    id), through the data inputs of the ops between (as gradients flow)."""
    seen: Set[int] = set()
    pending = [y for y in ys if hasattr(y, "op")]
    while pending:
        tensor = pending.pop()
        if id(tensor) in versions:
            return True
        op = tensor.op
        if id(op) in seen:
            continue
        seen.add(id(op))
        pending += list(op.inputs)
    return False


def _refuse_read_after(ys: List[Any], xs: List[Any], written: Dict[str, List[Any]]) -> None:
    """A ``y`` computed from a read of a variable made after the tape that
    wrote it in this graph closed: that read is of the variable's own handle,
    which holds the last version's value but has no gradient path to the
    tape's writes. Differentiated with respect to a tensor that the writes
    depend on (a value written; the function's inputs, in the gradient of a
    call of the function that a ``GradientTape`` or ``ForwardAccumulator``
    around the call asks), the answer would miss the writes: refused, naming
    the variable. (With respect to the variable itself, it is the version
    read: right, and plain TensorFlow, as the module says.)"""
    for uid, name in _read_after(ys, written):
        versions = [v for v in written[uid] if hasattr(v, "op")]
        tensors = {id(x) for x in xs if not isinstance(x, resource_variable_ops.BaseResourceVariable)}
        if tensors and _reaches(versions, tensors):
            raise ControlFlowWriteError(
                f"A gradient through a read of variable {name!r} made after the AssignAwareTape "
                "that wrote it in this tf.function exited (tf.gradients there, or a GradientTape "
                "or ForwardAccumulator around a call of the function): that read is of the "
                "variable's own handle, which has no gradient path to the tape's writes, so the "
                "gradient would miss them. Compute the value from the variable inside the tape "
                "(before its with block ends), or open the tape around the call."
            )


def _read_after(ys: List[Any], written: Dict[str, List[Any]]) -> List[Tuple[str, str]]:
    """The variables (unique id, name) of ``written`` that an op ``ys``
    reach reads through their own handle, made after the first tape that
    wrote them in its graph closed."""
    graphs = {id(y.graph): y.graph for y in ys if hasattr(y, "graph")}
    found: Dict[str, str] = {}
    for graph in graphs.values():
        closed_at = _closed_at.get(graph)
        if not closed_at:
            continue
        # A version made there is an IdentityN of the variable's handle in
        # the graph (its capture) and of the write's inputs.
        roots: Dict[int, str] = {}
        made: Set[int] = set()
        for uid in closed_at:
            for version in written.get(uid, ()):
                op = getattr(version, "op", None)
                if op is not None and op.graph is graph and op.inputs:
                    roots[id(op.inputs[0])] = uid
                    made.add(id(op))
        operations = graph.get_operations()
        position = {id(op): i for i, op in enumerate(operations)}
        seen: Set[int] = set()
        pending = [y for y in ys if getattr(y, "graph", None) is graph]
        while pending:
            op = pending.pop().op
            if id(op) in seen:
                continue
            seen.add(id(op))
            if id(op) not in made:
                for t in op.inputs:
                    read = roots.get(id(t))
                    if read is not None and position.get(id(op), -1) >= closed_at[read][0]:
                        found[read] = closed_at[read][1]
            pending += list(op.inputs)
    return list(found.items())
