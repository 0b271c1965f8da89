"""The wrapt plumbing every patch shares: one wrapper class, and argument binding.

Every patch is a ``wrapt.FunctionWrapper`` over TensorFlow's own function, with
wrapt's one signature, ``(wrapped, instance, args, kwargs)``. The originals are
never modified: uninstalling puts the very same objects back.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import wrapt

__all__ = ["Wrapper", "bind", "params_of"]


class _BoundWrapper(wrapt.BoundFunctionWrapper):
    autograph_info__: Dict[str, Any] = {}


class Wrapper(wrapt.FunctionWrapper):
    # AutoGraph warns about every wrapt-wrapped callee it meets while converting
    # a tf.function (user code calling tf.raw_ops directly, or a patched method
    # such as GradientTape.gradient), unless the callee looks like one of its
    # own artifacts. A class attribute answers that lookup before the proxy
    # would forward it to TensorFlow's function, which stays untouched; methods
    # are bound through a class that answers it too. (AutoGraph calls
    # TensorFlow's own functions unconverted either way.)
    autograph_info__: Dict[str, Any] = {}
    __bound_function_wrapper__ = _BoundWrapper


def params_of(function: Callable[..., Any]) -> List[str]:
    """The names of a plain function's positional parameters, in order."""
    code = function.__code__
    return list(code.co_varnames[: code.co_argcount])


def bind(params: Sequence[str], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``args`` and ``kwargs`` as one dict by parameter name (cheaper than inspect)."""
    arguments = dict(zip(params, args))
    arguments.update(kwargs)
    return arguments
