"""The plumbing every patch shares: the wrappers, and argument binding.

Every patch calls a function with wrapt's one signature, ``(wrapped,
instance, args, kwargs)``, around TensorFlow's own function: through a
``wrapt.FunctionWrapper``, or, for a method defined on a class (``patch``),
through a plain function. The originals are never modified: uninstalling puts
the very same objects back.
"""

from __future__ import annotations

import inspect
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import wrapt

__all__ = ["Wrapper", "bind", "binds", "like", "params_of", "patch"]

_F = TypeVar("_F", bound=Callable[..., Any])


class _BoundWrapper(wrapt.BoundFunctionWrapper):  # type: ignore[type-arg]  # (wrapt types it by the wrapped callable; ours wrap any)
    autograph_info__: Dict[str, Any] = {}


class Wrapper(wrapt.FunctionWrapper):  # type: ignore[type-arg]  # (as above)
    # AutoGraph warns about every wrapt-wrapped callee it meets while converting
    # a tf.function (user code calling tf.raw_ops directly, or a patched method
    # such as GradientTape.gradient), unless the callee looks like one of its
    # own artifacts. A class attribute answers that lookup before the proxy
    # would forward it to TensorFlow's function, which stays untouched; methods
    # are bound through a class that answers it too. (AutoGraph calls
    # TensorFlow's own functions unconverted either way.)
    autograph_info__: Dict[str, Any] = {}
    __bound_function_wrapper__ = _BoundWrapper


def patch(
    owner: Any, original: Any, function: Callable[..., Any], passes: Optional[Callable[[Any, Any, Any], bool]] = None
) -> Any:
    """What to put in place of ``original``, found on ``owner``, so that calls
    go through ``function(wrapped, instance, args, kwargs)``.

    A plain function defined on a class (a method: ``GradientTape.gradient``)
    gets a plain function, which binds as the method did. wrapt's
    ``FunctionWrapper`` binds in Python (a bound wrapper made at every
    attribute lookup, and two Python frames a call), which a Keras train step
    pays at every tape it opens, and every frame between a program and
    TensorFlow's eager ops costs each op run below it (TensorFlow keeps every
    eager op's Python stack). With ``passes(instance, args, kwargs)`` true,
    ``original`` is called from the method's own frame, without ``function``'s. Anything else
    (a module's function, a class method) gets a ``Wrapper``.
    """
    if not isinstance(owner, type) or type(original) is not types.FunctionType:
        return Wrapper(original, function)
    if passes is None:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return function(original.__get__(self), self, args, kwargs)
    else:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if passes(self, args, kwargs):
                return original(self, *args, **kwargs)
            return function(original.__get__(self), self, args, kwargs)
    return like(method, original, function)


def like(method: _F, original: Any, function: Callable[..., Any]) -> _F:
    """``method``, made to look like ``original`` to introspection, and
    marked as a patch that calls ``function``."""
    marked: Any = method  # (the attributes below are a function's, not a callable's)
    for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(marked, attribute, getattr(original, attribute))
    marked.__wrapped__ = original
    # inspect.getfullargspec (which TensorFlow's tf_inspect uses) does not
    # follow ``__wrapped__``, but takes a ``__signature__``: the original's.
    marked.__signature__ = inspect.signature(original)
    marked._self_wrapper = function  # (wrapt's name: one check finds either)
    # As Wrapper's class attribute: AutoGraph calls it unconverted.
    marked.autograph_info__ = {}
    return method


def params_of(function: Callable[..., Any]) -> List[str]:
    """The names of a plain function's positional parameters, in order."""
    code = function.__code__
    return list(code.co_varnames[: code.co_argcount])


def bind(params: Sequence[str], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``args`` and ``kwargs`` as one dict by parameter name (cheaper than inspect)."""
    arguments = dict(zip(params, args))
    arguments.update(kwargs)
    return arguments


def binds(params: Sequence[str], required: int, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether a call with ``args`` and ``kwargs`` binds to ``params``, the
    first ``required`` of which have no default. Where it does not, a
    follower calls the original as it was called, for Python's own error."""
    if len(args) > len(params):
        return False
    positional = params[: len(args)]
    for name in kwargs:
        if name in positional or name not in params:
            return False
    return all(name in kwargs for name in params[len(args) : required])

