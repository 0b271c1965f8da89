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
from typing import Any, Callable, Dict, List, Set

from assigntape import _branches
from assigntape._errors import ControlFlowWriteError
from assigntape._tf import executing_eagerly, nest, ops, resource_variable_ops

__all__ = ["gradients", "note_closed"]

# Per graph, for each variable (by unique id) written by tapes of ours that
# were open in it and have exited, the versions they made there.
_written: "weakref.WeakKeyDictionary[Any, Dict[str, List[Any]]]" = weakref.WeakKeyDictionary()


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


def gradients(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``gradients_util._GradientsHelper``, which ``tf.gradients`` calls:
    refused with respect to a variable a closed tape of this graph (or of
    one it is traced in) wrote, unless a tape of ours is open in it now.
    Always on: the tape has exited by then."""
    if not _written or executing_eagerly():
        return wrapped(*args, **kwargs)
    graph = ops.get_default_graph()
    written: Dict[str, List[Any]] = {}
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
