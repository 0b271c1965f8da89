"""The eager short paths of ``ResourceVariable``'s reads and writes.

Eagerly, a variable's ``value()`` (every read that converts it to a tensor:
``v + 1``, ``x @ v``) and its ``assign`` / ``assign_add`` / ``assign_sub`` go
through several layers of TensorFlow's Python before their op runs, and
under an ``AssignAwareTape`` each layer that asks ``v.handle`` runs the
version descriptor. While a tape is open, these methods are replaced on the
class (``_registry.served``, put in place and taken off with the handle
descriptor) by functions that do, for a plain variable, exactly what those
layers end in: the same op on the same version, the same watch, the same
record on the tapes, the same result. Anything else (a distributed
component, another thread's tape, a graph, dtype promotion mode, a cached
or colocated read) goes to TensorFlow's method, which the op wrappers follow
as before.

Plain functions, not wrapt wrappers: as methods they must bind like
TensorFlow's, and they are the hot path of every read and write.
"""

from __future__ import annotations

import inspect
import os
import types
from typing import Any, Callable, Dict

from assigntape import _rules, _serving, _writes
from assigntape._tf import (
    dtypes,
    executing_eagerly,
    gen_resource_variable_ops,
    ops,
    profiler_trace,
    resource_variable_ops,
    tensor_conversion_registry,
)
from assigntape._wrapping import Wrapper, unwrapped

__all__ = [
    "METHODS",
    "WRITE_METHODS",
    "convert_function",
    "is_tensorflows",
    "is_tensorflows_conversion",
    "value_method",
    "write_method",
]

# The write methods -> the op each runs, and its generated function's name.
WRITE_METHODS = {
    "assign": ("AssignVariableOp", "assign_variable_op"),
    "assign_add": ("AssignAddVariableOp", "assign_add_variable_op"),
    "assign_sub": ("AssignSubVariableOp", "assign_sub_variable_op"),
}

# Every method with a short path, on ``ResourceVariable``.
METHODS = ("value", *WRITE_METHODS)

# False sends every call to TensorFlow's methods (and the op wrappers), as
# before the short paths: the tests run programs both ways.
enabled = True

_UNREAD_VARIABLE = resource_variable_ops._UnreadVariable
_VARIANT = dtypes.variant
_EAGER_TENSOR = ops.EagerTensor


def is_tensorflows(method: Any) -> bool:
    """Whether ``method`` is TensorFlow's own (defined in
    ``resource_variable_ops``, or ``weak_tensor_ops``' dtype-promotion
    wrapper of such a one), not a wrapper someone else put there: that one
    must run, and a short path would skip it."""
    if type(method) is not types.FunctionType:  # (a proxy, e.g. wrapt's, forwards __code__)
        return False
    code = method.__code__
    if code.co_filename.endswith(os.path.join("ops", "resource_variable_ops.py")):
        return True
    inner = getattr(method, "__wrapped__", None)
    return code.co_filename.endswith(os.path.join("ops", "weak_tensor_ops.py")) and getattr(
        getattr(inner, "__code__", None), "co_filename", ""
    ).endswith(os.path.join("ops", "resource_variable_ops.py"))


def _op(snake: str) -> Callable[..., Any]:
    """The generated op function itself, not our wrapper of it (installed or not)."""
    return unwrapped(getattr(gen_resource_variable_ops, snake))


_GENERATED = vars(gen_resource_variable_ops)
_VARIABLE_OPS = vars(resource_variable_ops)


def _tensorflows_or_nothing(function: Any) -> Any:
    """``function`` if it is TensorFlow's own, else (someone wrapped it
    before assigntape was imported) an object nothing found later is: the
    short paths that skip it are then never taken."""
    return function if is_tensorflows(function) else object()


# What TensorFlow's read and write methods call besides the op: whether a
# variable is watched, and (writes) the lazy read they return.
_ACCESSED = _tensorflows_or_nothing(resource_variable_ops.variable_accessed)
_LAZY_READ = _tensorflows_or_nothing(resource_variable_ops.BaseResourceVariable._lazy_read)
_READ_OP = _tensorflows_or_nothing(resource_variable_ops.BaseResourceVariable._read_variable_op)


def _nothing_in_the_way(d: Dict[str, Any], method: str, own: Any) -> bool:
    """Whether a variable's ``<method>`` (``d``: its ``__dict__``) and the module's ``variable_accessed``, which
    TensorFlow's method calls, are TensorFlow's own: not wrapped or replaced
    on the class, not overridden on this variable."""
    return (
        _VARIABLE_OPS["variable_accessed"] is _ACCESSED
        and getattr(_RESOURCE_VARIABLE, method) is own
        and method not in d
    )


def _unwrapped(snake: str, op: Callable[..., Any]) -> bool:
    """Whether TensorFlow's methods would call ``op`` for ``snake`` (through
    our wrapper, or directly): no one else has wrapped or replaced the
    generated function since, whose wrapper a short path would skip."""
    found = _GENERATED[snake]
    return found is op or (type(found) is Wrapper and found.__wrapped__ is op)


def write_method(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """``ResourceVariable.<name>`` (``assign``, ``assign_add``, ``assign_sub``)
    while a tape is open; ``method`` is TensorFlow's.

    Eagerly, on a plain variable of the only thread with a tape open
    (``_serving.short_path_scope``): the value converted as TensorFlow's
    method does, the write and its version (``_writes.write_here``, which the
    op wrapper uses too), and TensorFlow's ``_lazy_read`` (the variable
    watched, an ``_UnreadVariable`` returned).
    """
    op_name, snake = WRITE_METHODS[name]
    rule = _rules.RULES[op_name]
    assert isinstance(rule, _rules.Rule)
    op = _op(snake)
    assigns = name == "assign"

    def write(self: Any, value: Any, use_locking: Any, name: Any, read_value: bool) -> Any:
        scope = _serving.short_path_scope(self) if enabled else None
        if (
            scope is None
            or ops.is_auto_dtype_conversion_enabled()  # (TensorFlow's method then promotes the value's dtype first)
            or not _unwrapped(snake, op)
            or (read_value and not _nothing_in_the_way(self.__dict__, "_lazy_read", _LAZY_READ))
        ):
            return method(self, value, use_locking, name, read_value)
        dtype = self._dtype
        if type(value) is not _EAGER_TENSOR or value.dtype is not dtype:  # (dtypes are interned)
            value = ops.convert_to_tensor(value, dtype=dtype)
        shape = self._shape
        if assigns and value.shape != shape:
            return method(self, value, use_locking, name, read_value)  # TensorFlow's error, or a broadcast
        handle = _serving.serve_handle(
            scope, self, self.__dict__
        )  # self._handle: the version TensorFlow's method writes through
        arguments: Dict[str, Any] = {"resource": handle, "value": value, "name": name}
        if assigns:
            arguments["validate_shape"] = self._validate_shape
        _writes.write_here(scope, self, op_name, rule, op, arguments)
        if not read_value:
            return None
        # TensorFlow's ``_lazy_read``, eagerly: the variable was accessed (its
        # new version is watched), and the result reads it lazily.
        _writes.watch(scope, self)
        return _lazy_read(self, shape)

    # TensorFlow's signatures: ``assign(value, ...)``, ``assign_add(delta, ...)``.
    short_path: Callable[..., Any]
    if assigns:

        def short_path(
            self: Any, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
        ) -> Any:
            return write(self, value, use_locking, name, read_value)
    else:

        def short_path(
            self: Any, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True
        ) -> Any:
            return write(self, delta, use_locking, name, read_value)

    return _like(short_path, method)


# The attributes in which two eager ``_UnreadVariable``s of different
# variables differ; every other one is the same for all (their defaults).
_PER_VARIABLE = {"_handle", "_shape", "_dtype", "_unique_id", "_graph_key"}
# One eager ``_UnreadVariable``'s attributes, or False where this TensorFlow's
# differ in more than ``_PER_VARIABLE`` (checked once, ``_template``).
# (``_graph_key``: the default graph's.)
_unread_template: Any = None


def _lazy_read(var: Any, shape: Any) -> Any:
    """``var._lazy_read(None)`` eagerly: the ``_UnreadVariable`` TensorFlow's
    write methods return, given the variable's own handle. Its constructor
    runs TensorFlow's variable initialization (about 7 us); every eager one
    gets the same attributes but for five, so the others are copied from a
    template."""
    d = var.__dict__
    template = _unread_template if _unread_template is not None else _template(var)
    if not template:
        return _UNREAD_VARIABLE(
            handle=d["_handle"],
            dtype=d["_dtype"],
            shape=shape,
            in_graph_mode=False,
            parent_op=None,
            unique_id=d["_unique_id"],
        )
    unread = _UNREAD_VARIABLE.__new__(_UNREAD_VARIABLE)
    attributes = unread.__dict__
    attributes.update(template)
    attributes["_handle"], attributes["_shape"] = d["_handle"], shape
    attributes["_dtype"], attributes["_unique_id"] = d["_dtype"], d["_unique_id"]
    attributes["_graph_key"] = ops.get_default_graph()._graph_key  # (the global graph may be replaced)
    # As the handle descriptor's ``__set__`` would: a kept result names its
    # variable's handle for later tapes (a variable made after uninstall()).
    _serving.note_handle(unread, d["_handle"])
    return unread


def _template(var: Any) -> Any:
    """Builds ``_unread_template`` from two real ``_UnreadVariable``s of two
    variables (this one, and a scalar of another dtype), or sets it False if
    they differ in more than ``_PER_VARIABLE``."""
    global _unread_template
    with ops.init_scope():
        other = resource_variable_ops.ResourceVariable(0, dtype=dtypes.int8, trainable=False)
    made = [
        _UNREAD_VARIABLE(
            handle=x.__dict__["_handle"],
            dtype=x.dtype,
            shape=x._shape,
            in_graph_mode=False,
            parent_op=None,
            unique_id=x._unique_id,
        )
        for x in (var, other)
    ]
    a, b = (vars(m) for m in made)
    differ = {k for k in a.keys() | b.keys() if k not in a or k not in b or a[k] is not b[k]}
    _unread_template = {k: v for k, v in a.items() if k not in _PER_VARIABLE} if differ <= _PER_VARIABLE else False
    return _unread_template


def value_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``ResourceVariable.value`` while a tape is open; ``method`` is TensorFlow's.

    Eagerly, on a plain variable with no cached value or caching device,
    where this thread has an eager tape: what ``_read_variable_op`` ends in
    (the variable watched by the tapes and variable watchers if trainable,
    then ``ReadVariableOp`` on the version the descriptor serves), without
    its layers.
    """
    read = _op("read_variable_op")

    def value(self: Any) -> Any:
        d = self.__dict__
        scope = _serving.short_path_read_scope(self) if enabled else None
        if (
            scope is None
            or d.get("_cached_value") is not None
            or d.get("_caching_device") is not None
            or d.get("_dtype") is _VARIANT
            # What TensorFlow's method calls, wrapped or replaced by someone
            # (on the class, on this variable, or the generated op): theirs must run.
            or not _nothing_in_the_way(d, "_read_variable_op", _READ_OP)
            or _GENERATED["read_variable_op"] is not read
        ):
            return method(self)
        handle = _serving.serve_handle(scope, self, d)  # self._handle: the version, a first read's checks included
        _writes.watch(scope, self)
        if "_variable_read" in d:  # (TensorFlow 2.17 and later note a read)
            d["_variable_read"] = True
        return read(handle, d["_dtype"])

    return _like(value, method)


_RESOURCE_VARIABLE = resource_variable_ops.ResourceVariable
# TensorFlow's conversion of every resource variable, as registered, and the
# method it calls; the registry's per-type cache (cleared when anything is
# registered).
_CONVERSION = resource_variable_ops._dense_var_to_tensor
_TO_TENSOR = resource_variable_ops.BaseResourceVariable._dense_var_to_tensor
_CONVERSIONS_BY_TYPE = tensor_conversion_registry._tensor_conversion_func_cache
# Both TensorFlow's own (someone may have wrapped one before assigntape was
# imported: theirs must run, and no conversion takes the short path).
_OWN_CONVERSION = all(
    getattr(getattr(f, "__code__", None), "co_filename", "").endswith(os.path.join("ops", "resource_variable_ops.py"))
    for f in (_CONVERSION, _TO_TENSOR)
)
# (TensorFlow 2.16 keeps whether the profiler traces as a module global, later
# ones ask a C function.)
_tracing: Callable[[], bool] = (
    profiler_trace.enabled if callable(profiler_trace.enabled) else (lambda: bool(profiler_trace.enabled))
)


def is_tensorflows_conversion(function: Any) -> bool:
    """Whether ``function`` is TensorFlow's ``ops.convert_to_tensor`` (under
    its profiler wrapper), not a wrapper someone else put there."""
    inner = getattr(function, "__wrapped__", None)
    code = getattr(inner, "__code__", None)
    return code is not None and code.co_filename.endswith(os.path.join("framework", "ops.py"))


def convert_function(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ops.convert_to_tensor`` while a tape is open; ``original`` is TensorFlow's.

    Every ``x @ v`` and ``v * x`` converts the variable through it: the
    profiler's wrapper, the conversion registry, ``_dense_var_to_tensor``, and
    then ``v.value()`` (the read short path), about 3 us of layers a read. For
    a plain ``ResourceVariable`` converted eagerly as a value, to its own dtype
    or none (asked or preferred), with the default result types, while the
    registry still converts it with TensorFlow's function and the profiler is
    not tracing: ``v.value()`` straight away, what those layers end in (the
    registry then asks the eager tensor's ``__tf_tensor__``, which returns it).
    Anything else (a graph, where a value may be captured) goes to
    TensorFlow's function.
    """
    accepted_default = inspect.signature(original).parameters["accepted_result_types"].default

    def convert_to_tensor(
        value: Any,
        dtype: Any = None,
        name: Any = None,
        as_ref: Any = False,
        preferred_dtype: Any = None,
        dtype_hint: Any = None,
        ctx: Any = None,
        accepted_result_types: Any = accepted_default,
    ) -> Any:
        if type(value) is _RESOURCE_VARIABLE and not as_ref and accepted_result_types is accepted_default and enabled:
            own = value._dtype
            preferred = preferred_dtype or dtype_hint  # (as TensorFlow's function takes it)
            if (
                (dtype is None or dtype is own)
                and (preferred is None or preferred is own)
                and executing_eagerly()
                and _converts_as_tensorflow(value)
                and not _tracing()
            ):
                return value.value()
        return original(value, dtype, name, as_ref, preferred_dtype, dtype_hint, ctx, accepted_result_types)

    return _like(convert_to_tensor, original)


def _converts_as_tensorflow(var: Any) -> bool:
    """Whether TensorFlow's registry would end in ``var.value()``: ``var`` has
    no ``__tf_tensor__`` (which the registry asks first), the registry's first
    conversion for the class (what it calls) is TensorFlow's, and so is the
    ``_dense_var_to_tensor`` that one calls, on the class and not replaced on
    the instance."""
    found = _CONVERSIONS_BY_TYPE.get(_RESOURCE_VARIABLE)
    return (
        _OWN_CONVERSION
        and bool(found)
        and found[0][1] is _CONVERSION
        and getattr(var, "__tf_tensor__", None) is None
        and _RESOURCE_VARIABLE._dense_var_to_tensor is _TO_TENSOR
        and "_dense_var_to_tensor" not in var.__dict__
    )


def _like(function: Callable[..., Any], method: Callable[..., Any]) -> Callable[..., Any]:
    function.__name__, function.__qualname__, function.__doc__ = method.__name__, method.__qualname__, method.__doc__
    function.__wrapped__ = method  # type: ignore[attr-defined]
    # What introspection (tf_inspect.getfullargspec, which does not follow
    # ``__wrapped__``) shows of TensorFlow's function itself.
    function.__signature__ = inspect.signature(method, follow_wrapped=False)  # type: ignore[attr-defined]
    return function
