"""Forward mode where TensorFlow's own gives NaN for a finite derivative.

TensorFlow's accumulators compute an op's tangent by transposing its gradient
function (``forwardprop._jvp_helper``). Sqrt's gradient, ``SqrtGrad``, maps a
zero upstream gradient to zero, also at ``sqrt(0)``; its transpose does not:
it multiplies the tangent by ``0.5 / sqrt(0) = inf``, and a tangent that is
exactly zero becomes ``0 * inf = NaN``. Adam (and RMSprop, Nadam, ...) take
``sqrt(v)`` of a second moment that stays exactly 0 for a weight whose
gradient is exactly zero (a dead unit, an embedding row no batch used), whose
tangent is exactly zero too: every tangent of that weight, and of anything
summed over it, turned NaN, where reverse mode (and the true derivative) is
finite.

While a tape or accumulator of ours is open in this thread, the jvp function
TensorFlow calls answers Sqrt itself: ``0.5 t / sqrt(x)``, and exactly zero
where the tangent ``t`` is exactly zero: the transpose of TensorFlow's own
``SqrtGrad``. A non-zero tangent at ``x = 0`` stays ``inf``, as in
TensorFlow. ``SqrtGrad`` itself (forward over reverse) likewise keeps a zero
tangent zero where its upstream gradient is zero. Every other op, and these
outside every tape of ours, go to TensorFlow's function. It is registered while the patches are installed and
TensorFlow's is registered again by ``uninstall()``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

from assigntape import _registry
from assigntape._tf import array_ops, forwardprop, math_ops, pywrap_tfe

__all__ = ["register"]

# TensorFlow's, registered at its import (the C API cannot tell us what is
# registered now, so this is what ``register(False)`` puts back).
_TENSORFLOWS: Callable[..., Any] = forwardprop._jvp_dispatch


def _sqrt_jvp(attr_tuple: Any, inputs: Sequence[Any], outputs: Sequence[Any], tangents: Sequence[Any]) -> List[Any]:
    del attr_tuple, inputs
    (y,), (t,) = outputs, tangents
    zero = math_ops.equal(t, array_ops.zeros([], t.dtype))
    # Divided by 1 where the tangent is zero, so that neither this tangent
    # nor a derivative taken through it (forward over forward, reverse over
    # forward) meets 0 / 0. (y broadcasts against a batch of tangents.)
    safe = array_ops.where_v2(zero, array_ops.ones_like(y), y)
    return [array_ops.where_v2(zero, array_ops.zeros_like(t), t * math_ops.cast(0.5, t.dtype) / safe)]


def _sqrt_grad_jvp(
    attr_tuple: Any, inputs: Sequence[Any], outputs: Sequence[Any], tangents: Sequence[Any]
) -> List[Any]:
    """``SqrtGrad(y, dy) = 0.5 dy / conj(y)``, 0 where ``dy`` is 0: the op of
    sqrt's reverse pass, met by forward over reverse (a Hessian-vector
    product through Adam). Its tangent ``(0.5 t_dy - z conj(t_y)) / conj(y)``
    is exactly zero where ``dy`` and its tangent both are, as the op itself
    is zero there whatever ``y`` is."""
    del attr_tuple
    (y, dy), (z,) = inputs, outputs
    t_y, t_dy = (array_ops.zeros_like(x) if t is None else t for x, t in zip(inputs, tangents))
    zero = math_ops.logical_and(
        math_ops.equal(dy, array_ops.zeros([], dy.dtype)), math_ops.equal(t_dy, array_ops.zeros([], dy.dtype))
    )
    safe = array_ops.where_v2(zero, array_ops.ones_like(y), math_ops.conj(y))
    tangent = (t_dy * math_ops.cast(0.5, dy.dtype) - z * math_ops.conj(t_y)) / safe
    return [array_ops.where_v2(zero, array_ops.zeros_like(tangent), tangent)]


# Op name -> the tangents of its outputs, from (attrs, inputs, outputs, tangents).
_OURS: Dict[str, Callable[..., List[Any]]] = {"Sqrt": _sqrt_jvp, "SqrtGrad": _sqrt_grad_jvp}


def _dispatch(op_name: str, attr_tuple: Any, inputs: Any, outputs: Any, tangents: Any, use_batch: bool = False) -> Any:
    """What TensorFlow's accumulators call for each op they see."""
    ours = _OURS.get(op_name)
    if ours is None or not _registry.open_here():
        return _TENSORFLOWS(op_name, attr_tuple, inputs, outputs, tangents, use_batch)
    return ours(attr_tuple, inputs, outputs, tangents)


def register(on: bool) -> None:
    """Registers ours (``on``: the patches are installed) or TensorFlow's."""
    pywrap_tfe.TFE_Py_RegisterJVPFunction(_dispatch if on else _TENSORFLOWS)
