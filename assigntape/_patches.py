"""The patches: installed while at least one AssignAwareTape is open anywhere.

Two things are patched, and both are restored to the exact original objects
when the last tape in the process closes:

* ``BaseResourceVariable._handle`` gets a data descriptor that answers with the
  current version (see ``_versions``).
* The write methods named in ``_rules.RULES`` get a wrapper that performs the
  real write, then makes the new version and records it on the tape.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Tuple

import wrapt
from tensorflow.python.eager import context, record
from tensorflow.python.framework import ops
from tensorflow.python.ops import array_ops, resource_variable_ops

from assigntape import _rules, _versions

__all__ = ["acquire", "release", "installed"]

_ABSENT = object()
_lock = threading.Lock()
_users = 0
_saved: List[Tuple[Any, str, Any]] = []

# ``tensorflow/python/ops/weak_tensor_ops.py`` replaces ``ResourceVariable.assign``
# (and assign_add, assign_sub) with wrappers of the functions defined on
# ``BaseResourceVariable``, so ``ResourceVariable`` instances find those wrappers
# first and ``_UnreadVariable``/``UninitializedVariable`` find the base ones. Each
# class that defines a write method in its own ``__dict__`` is patched there, so
# every lookup through the MRO meets exactly one wrapper. (The weak-tensor wrapper
# calls the base *function* it captured, not the attribute, so nothing is
# wrapped twice.)
_PATCHED_CLASSES = (
    resource_variable_ops.ResourceVariable,
    resource_variable_ops.BaseResourceVariable,
)


def _differentiable(var: Any) -> bool:
    # Integer and bool variables (optimizer iteration counters, step flags) carry
    # no gradient: their writes stay plain TensorFlow.
    return var.dtype.is_floating or var.dtype.is_complex


def _bind_value(method: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], var: Any):
    """Converts the written value once, so the tape sees the tensor the write uses."""
    name = "value" if method == "assign" else "delta"
    if args:
        value = ops.convert_to_tensor(args[0], dtype=var.dtype)
        return (value,) + tuple(args[1:]), kwargs, value
    value = ops.convert_to_tensor(kwargs[name], dtype=var.dtype)
    return args, dict(kwargs, **{name: value}), value


def _new_version(old: Any, write_result: Any) -> Any:
    """A fresh handle tensor for the same resource, unrecorded.

    It must not be recorded: a recorded Identity would chain the new version to
    the old one whenever the write itself is not recorded (a constant value, or
    nothing watched), leaking gradient to what produced the old value.
    """
    with record.stop_recording():
        if context.executing_eagerly():
            return array_ops.identity(old)
        # In a graph, reads through the new handle must run after the write.
        op = getattr(write_result, "_parent_op", write_result)
        deps = [op] if op is not None else []
        with ops.control_dependencies(deps):
            return array_ops.identity(old)


def _write_wrapper(method: str) -> Callable[..., Any]:
    rule = _rules.RULES[method]

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
        scope = _versions.scope_for_write(instance, method) if instance is not None else None
        if scope is None or not _differentiable(instance):
            return wrapped(*args, **kwargs)
        args, kwargs, value = _bind_value(method, args, kwargs, instance)
        old = instance.handle
        # The real write. If it raises (bad shape or dtype), nothing below runs:
        # the tape and the variable stay as they were.
        result = wrapped(*args, **kwargs)
        if rule.reads_old:
            # A partial write reads the old value, but a variable that was never
            # read is not watched yet, and an unwatched input is not recorded:
            # its gradient would be lost. (Watching after the write is enough:
            # what counts is that the old handle is watched when recording.)
            resource_variable_ops.variable_accessed(instance)
        new = _new_version(old, result)
        inputs = [old, value] if rule.reads_old else [value]
        record.record_operation(rule.op_type, [new], inputs, rule.backward)
        scope.current[instance._unique_id] = new
        for tape in scope.tapes:
            tape._note_write(instance, old, new, method)
        return result

    return wrapper


def _install() -> None:
    _saved.append(
        (
            resource_variable_ops.BaseResourceVariable,
            "_handle",
            resource_variable_ops.BaseResourceVariable.__dict__.get("_handle", _ABSENT),
        )
    )
    setattr(resource_variable_ops.BaseResourceVariable, "_handle", _versions.HandleDescriptor())
    for cls in _PATCHED_CLASSES:
        for method in _rules.RULES:
            if method in cls.__dict__:
                original = cls.__dict__[method]
                _saved.append((cls, method, original))
                wrapt.wrap_function_wrapper(cls, method, _write_wrapper(method))
                # AutoGraph warns about every wrapt-wrapped callee it meets while
                # converting a tf.function, unless the callee looks like one of its
                # own artifacts; the bound wrapper forwards attribute lookups to
                # the original function, so mark that (and unmark it on exit).
                # Unpatched, AutoGraph calls these TensorFlow methods unconverted
                # too, so nothing else changes.
                if not hasattr(original, "autograph_info__"):
                    _saved.append((original, "autograph_info__", _ABSENT))
                    original.autograph_info__ = {}


def _uninstall() -> None:
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
