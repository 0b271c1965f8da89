"""SavedModels of functions in which an AssignAwareTape wrote variables.

Each write the tape follows inside a ``tf.function`` is an ``IdentityN``
version op with a gradient of the library's own (``_control_flow``), whose
rule for that write is Python code kept on the op. ``tf.saved_model.save``
saves custom gradients by tracing each registered gradient function with no
op, which cannot give that rule: TensorFlow's own error there is an unclear
``ValueError`` about ``IdentityN``. Refused first, saying why and what to do.
"""

from __future__ import annotations

from typing import Any, Callable

from assigntape import _branch_writes
from assigntape._errors import SavedModelError

__all__ = ["trace_gradient_functions"]

# The gradient types of the library's graph ops (``_control_flow``).
_OURS = frozenset(
    t.encode()
    for t in (_branch_writes._TOP_VERSION_GRAD, _branch_writes._BRANCH_VERSION_GRAD, _branch_writes._POISON_GRAD)
)


def trace_gradient_functions(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``saved_model.save._trace_gradient_functions(graph, saveable_view)``,
    called only when custom gradients are saved (the default)."""
    graph = args[0] if args else kwargs["graph"]
    for function in list(graph._functions.values()):
        body = getattr(function, "graph", None)
        if body is None:
            continue
        for op in body.get_operations():
            if op.type != "IdentityN":
                continue
            try:
                kind = op.get_attr("_gradient_op_type")
            except ValueError:
                continue
            if kind in _OURS:
                raise SavedModelError(
                    f"tf.saved_model.save: function {_text(function.name)!r} holds a variable write that "
                    f"an AssignAwareTape followed (op {op.name!r}). Its gradient rule is Python code "
                    "kept beside the graph, which a SavedModel cannot carry, so the function's "
                    "gradients cannot be saved. Save with "
                    "options=tf.saved_model.SaveOptions(experimental_custom_gradients=False): the "
                    "loaded function computes the same values, its own tape's gradients included, "
                    "and a gradient through it raises SavedModelError instead of a wrong value."
                )
    return wrapped(*args, **kwargs)


def _text(name: Any) -> str:
    # TensorFlow names a graph's functions with bytes.
    return name.decode() if isinstance(name, bytes) else str(name)
