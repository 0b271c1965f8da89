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

__all__ = ["Place", "Wrapper", "bind", "binds", "holds", "like", "params_of", "patch", "unwrapped"]

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


def unwrapped(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` itself if it is not our wrapper; else the function it wraps
    (a generated op the library runs without being seen by its own patch)."""
    inner: Callable[..., Any] = function.__wrapped__ if isinstance(function, Wrapper) else function
    return inner


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


# How many layers of other patches around ours ``holds`` looks through.
_DEPTH = 64


def holds(current: Any, wrapper: Any) -> bool:
    """Whether ``current`` is ``wrapper``, or a patch another library made
    around it later (wrapt's or functools' ``__wrapped__``, a mock's
    ``wraps``), through which ours still runs."""
    for _ in range(_DEPTH):
        if current is wrapper:
            return True
        try:
            # (A Mock answers any attribute but dunders; its ``wraps`` is kept as ``_mock_wraps``.)
            inner = getattr(current, "__wrapped__", None)
            if inner is None:
                inner = getattr(current, "_mock_wraps", None)
        except Exception:  # an attribute lookup of someone else's object may raise anything
            return False
        if inner is None or inner is current:
            return False
        current = inner
    return False


class Place:
    """One attribute a patch replaces, ``owner.name``: the wrapper put there
    and what it wraps (``below``), which ``make(below)`` built it around.

    Putting it on and off (the dormant switches, ``uninstall``) touches the
    attribute only where it still holds what this place put there, so it
    composes with patches other libraries make after ours: one made around
    ours (wrapt, ``mock.patch(..., wraps=...)``) stays in place, with ours
    running inside it; one put in place of ``below`` while ours was off is
    wrapped in turn when ours comes on again. A wrapper of ours that such a
    patch puts back when it is undone (a mock's exit) is still ours.
    """

    __slots__ = ("owner", "name", "below", "wrapper", "make", "made")

    def __init__(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        self.owner, self.name, self.make = owner, name, make
        self.below = vars(owner)[name]
        self.wrapper = make(self.below)
        # Every (wrapper, below) this place built: rebuilt only when someone
        # replaced ``below`` while ours was off, which is rare.
        self.made: List[Tuple[Any, Any]] = [(self.wrapper, self.below)]

    def put(self, on: bool) -> None:
        current = vars(self.owner).get(self.name, self)
        if current is self:
            return  # deleted by someone: theirs to put back
        for wrapper, below in self.made:
            if current is wrapper:
                # One of ours, put back by a patch undone since: current again.
                self.wrapper, self.below = wrapper, below
                if not on:
                    setattr(self.owner, self.name, below)
                return
        if not on or any(holds(current, wrapper) for wrapper, _ in self.made):
            return  # someone else's, with ours inside it or not ours to touch
        if current is not self.below:
            # Replaced while ours was off: ours goes around what is there now.
            self.below, self.wrapper = current, self.make(current)
            self.made.append((self.wrapper, self.below))
        setattr(self.owner, self.name, self.wrapper)


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
