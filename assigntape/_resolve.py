"""The variable a wrapped variable stands for, and the gradient sources it gives.

A Keras 3 ``Variable``, tf_keras' ``AutoCastVariable``, tf.distribute's
``MirroredVariable`` / ``AggregatingVariable`` and other wrappers delegate to a
``tf.Variable`` with a handle of its own: versions are kept for that one
(``resolve``). Also what a tape's ``gradient`` and ``watched_variables`` need
of it (zeros for an unconnected source, TensorFlow's order of the watched).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from assigntape._errors import NotAVariableError
from assigntape._tf import (
    BaseResourceVariable as _BASE_VARIABLE,
)
from assigntape._tf import (
    ShardedVariable,
    UnconnectedGradients,
    array_ops,
    gen_resource_variable_ops,
    record,
    resource_variable_ops,
    tensor_lib,
)


def zeros_like_source(source: Any, handle: Any, shape: Any = None) -> Any:
    """Zeros for a gradient ``source``: a variable (``handle`` its version),
    whose shape is the variable's, or ``shape`` where given (a version's shape
    when the variable's is not fully defined), or else the resource's now."""
    var = resolve(source)
    if var is None:
        return array_ops.zeros_like(source)
    if var.shape.is_fully_defined():
        return array_ops.zeros(var.shape, dtype=var.dtype)
    return array_ops.zeros(dynamic_shape(handle) if shape is None else shape, dtype=var.dtype)


def dynamic_shape(handle: Any) -> Any:
    """The shape of the variable behind ``handle`` now, as a tensor."""
    with record.stop_recording():
        return gen_resource_variable_ops.variable_shape(handle)


def plain_question(target: Any, sources: Any, unconnected_gradients: Any) -> bool:
    """Whether a tape's ``gradient`` is asked of a tensor target, for a list or
    tuple of plain variables, with ``None`` for the unconnected ones: where
    no source or target needs mapping to a version if ``serves_own_handles``."""
    if not isinstance(target, tensor_lib.Tensor) or type(sources) not in (list, tuple):
        return False
    if unconnected_gradients is not UnconnectedGradients.NONE and unconnected_gradients != "none":
        return False
    for s in sources:
        if type(s) is not _RESOURCE_VARIABLE:
            return False
    return True


def watched_in_order(found: Sequence[Any]) -> Tuple[Any, ...]:
    """What a tape's ``watched_variables()`` lists, from TensorFlow's own
    answer ``found``: each variable once, however many of its versions were
    read, in TensorFlow's order. TensorFlow's tape keeps the variables in a
    set ordered by the id of the handle each was watched through: with no
    writes, the variable's own handle (made when it was created), but a
    version's handle is made when it is written, so after writes the order
    would follow the writes. Ordered by the variables' own handles instead,
    as with no writes (code zips the list with another: TensorFlow
    Probability's minimize carries it through a ``tf.cond``). A wrapper
    TensorFlow lists (a ``MirroredVariable``, watched through its component's
    handle) is ordered by the own handle of the variable it stands for here
    (``resolve``: in a replica, that replica's component), as TensorFlow's
    order would be with no writes."""
    unique: Dict[Any, Any] = {}
    for var in found:
        unique.setdefault(getattr(var, "_unique_id", None) or id(var), var)
    listed = tuple(unique.values())
    ids: List[Any] = [getattr(getattr(resolve(var), "__dict__", {}).get("_handle"), "_id", None) for var in listed]
    if None in ids:
        return listed  # (a variable with no handle of its own: TensorFlow's order kept)
    order: List[int] = sorted(range(len(listed)), key=ids.__getitem__)
    return tuple(listed[i] for i in order)


_RESOURCE_VARIABLE = resource_variable_ops.ResourceVariable

# Where wrappers keep the variable they delegate to: Keras 3's ``Variable``
# (``_value``), tf_keras mixed precision's ``AutoCastVariable`` (``_variable``),
# and tf.distribute's ``AggregatingVariable`` (``_v``; parameter-server and
# central-storage strategies). Read from the instance's own ``__dict__``: their
# ``__getattr__`` would delegate the lookup itself.
_WRAPPED_IN = ("_value", "_variable", "_v")


def resolve(x: Any) -> Optional[Any]:
    """The ``tf.Variable`` with a handle of its own that ``x`` stands for: ``x``
    itself, or the variable a wrapper delegates to (for a ``MirroredVariable``
    or ``SyncOnReadVariable``, the component of the current replica, or the
    primary one in cross-replica context), else None (a tensor)."""
    if type(x) is _RESOURCE_VARIABLE and "_handle" in x.__dict__:  # the usual case, without isinstance
        return x
    for _ in range(8):  # wrappers of wrappers, never a cycle
        attributes = getattr(x, "__dict__", None)
        if attributes is None:
            return None
        if "_handle" in attributes and isinstance(x, _BASE_VARIABLE):
            return x
        component = getattr(type(x), "_get_on_device_or_primary", None)
        if component is not None:
            x = x._get_on_device_or_primary()
            continue
        inner = next((attributes[a] for a in _WRAPPED_IN if a in attributes), None)
        if inner is None and isinstance(x, _BASE_VARIABLE):
            # A BaseResourceVariable subclass with no handle of its own that
            # keeps the variable it delegates to under another name.
            inner = _delegate(attributes)
        x = inner
    return None


def _delegate(attributes: Dict[str, Any]) -> Optional[Any]:
    """The one ``BaseResourceVariable`` among a wrapper's attributes, which
    it must be delegating to; None if there is none, or more than one (no
    way to tell which it stands for)."""
    found = [value for value in attributes.values() if isinstance(value, _BASE_VARIABLE)]
    return found[0] if len(found) == 1 else None


def gradient_variable(x: Any) -> Optional[Any]:
    """``resolve`` for a source or target of ``gradient``, which refuses a
    ``ShardedVariable`` (a parameter-server variable split in shards) with the
    fix, where TensorFlow's own tapes fail with an AttributeError."""
    var = resolve(x)
    if var is not None:
        return var
    if isinstance(x, ShardedVariable):
        raise NotAVariableError(
            f"{x.name!r} is a ShardedVariable (a variable split across parameter servers), "
            "which no gradient tape takes as a whole: give its shards instead "
            "(v.variables), as sources or targets, and concatenate their gradients."
        )
    if isinstance(x, _BASE_VARIABLE):
        raise NotAVariableError(
            f"{getattr(x, 'name', type(x).__name__)!r} ({type(x).__name__}) stands for no single "
            "tf.Variable the tape can find: it has no handle of its own and does not hold exactly "
            "one variable to delegate to. Give the tape the variable it wraps instead."
        )
    return var
