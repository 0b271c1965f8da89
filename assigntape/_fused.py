"""Gradient rules for the fused optimizer kernels: a plain dict, by op.

The ``ResourceApply*`` and ``ResourceSparseApply*`` kernels (used by
``tf.compat.v1.train`` optimizers and ``tf_keras.optimizers.legacy``) write a
variable and its slots (``accum``, ``m``, ``v``, ``linear``, ...) in one op.
Each ``Kernel`` here holds the kernel's documented update equations as a
*functional form*: the new value of every resource it writes, from the previous
values and the kernel's other arguments, written with plain differentiable
TensorFlow ops (``tensorflow/core/kernels/training_ops.cc``, in the same
order of operations as the CPU kernel, so that the values agree to round-off;
``tests/test_fused_optimizers.py`` checks every one against the real kernel).

The real kernel still computes the values the program sees. The tape uses the
functional form only for the gradient: each written variable's new version is
recorded as an identity of its functional value (``_writes.fused_write``), so
the backward pass is TensorFlow's own gradient of the form. That makes it
correct to any order and for complex dtypes, and it reaches every input: the
previous versions of the variable and of each slot, the gradient tensor and
every hyperparameter (learning rate, momentum, betas, epsilon, l1, l2, ...).

Where a kernel is not differentiable at a point, the form uses the TensorFlow
op whose gradient gives the subgradient, and says so: ``tf.sign`` (gradient
zero), ``tf.abs`` (``sign(x)``, zero at 0), ``tf.maximum(x, y)`` (all of it to
``x`` on a tie), and ``tf.where`` for the kernels' branches on a hyperparameter
(``l1 > 0``, ``|linear| > l1``): the branch the kernel takes gets the gradient.

Sparse kernels update only the rows at ``indices``: their form gathers those
rows of every written resource, applies the same row update as the dense
kernel, and scatters the new rows back (``tf.tensor_scatter_nd_update``), so
the rows not written pass their gradient straight through. The kernels apply
duplicate indices one after the other, which this form does not model: the
tape refuses duplicates (as for ``scatter_update``), and the optimizers
deduplicate their ``IndexedSlices`` before calling the kernel anyway.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Tuple

from assigntape._errors import DuplicateIndicesError
from assigntape._tf import array_ops, check_ops, context, dtypes, gen_array_ops, math_ops

__all__ = ["Kernel", "KERNELS", "new_values", "written", "no_duplicates"]

Values = Dict[str, Any]  # resource argument name -> value (a tensor)
Args = Dict[str, Any]  # the op's arguments, by name, tensors of the variable's dtype
Update = Callable[[Values, Args], Values]


class Kernel(NamedTuple):
    """How the tape differentiates one fused kernel."""

    # Its resource arguments, the variable first: every one the kernel writes.
    writes: Tuple[str, ...]
    # Its arguments of the variable's dtype: the hyperparameters and the gradient.
    inputs: Tuple[str, ...]
    # The functional form: previous values of ``writes`` (rows at ``indices`` for
    # a sparse kernel), and the arguments -> new values of the resources written.
    update: Update
    # ResourceSparseApply*: only the rows at ``indices`` are updated.
    sparse: bool = False


def written(kernel: Kernel, args: Args) -> Tuple[str, ...]:
    """The resource arguments the kernel writes when called with ``args``: all
    of ``kernel.writes``, but Adagrad with ``update_slots=False`` leaves its
    accumulator as it was."""
    if args.get("update_slots", True):
        return kernel.writes
    return tuple(name for name in kernel.writes if name != "accum")


def no_duplicates(indices: Any, var_name: str, op_name: str) -> List[Any]:
    """Refuses a sparse kernel's duplicate indices.

    The kernels apply the rows of a duplicate index one after the other (a
    second Adagrad step on the same row, say), which the functional form, one
    update per row, does not model. Eagerly this raises
    ``DuplicateIndicesError`` before the kernel runs; in a graph it returns an
    assertion for the kernel to wait for.

    Args:
      indices: The kernel's ``indices`` (a vector).
      var_name: The written variable's name, for the message.
      op_name: The kernel, for the message.

    Returns:
      The assertions the kernel must run after (none eagerly).
    """
    message = (
        f"{op_name} on variable {var_name!r} has duplicate indices. The kernel applies the "
        "rows of a repeated index one after the other, and the tape differentiates one "
        "update per row. Sum the gradient rows per index first (tf.unique of the indices, "
        "then tf.math.unsorted_segment_sum of the rows), as the apply_gradients of "
        "tf.compat.v1.train and tf_keras optimizers do."
    )
    unique = array_ops.size(array_ops.unique(indices)[0])
    if context.executing_eagerly():
        if int(unique) != int(array_ops.size(indices)):
            raise DuplicateIndicesError(message)
        return []
    return [check_ops.assert_equal(unique, array_ops.size(indices), message=message)]


def new_values(kernel: Kernel, old: Values, args: Args) -> Values:
    """The functional new value of each resource ``kernel`` writes, whole.

    Args:
      kernel: The kernel's rule.
      old: The previous value of each of ``kernel.writes``, whole.
      args: The op's arguments by name (``kernel.inputs`` as tensors of the
        variable's dtype, ``indices`` for a sparse kernel, attributes).

    Returns:
      The new value of each resource the kernel writes (``written``).
    """
    if not kernel.sparse:
        return kernel.update(old, args)
    indices = args["indices"]
    rows = {name: array_ops.gather(value, indices) for name, value in old.items()}
    positions = array_ops.expand_dims(indices, -1)
    return {
        name: gen_array_ops.tensor_scatter_update(old[name], positions, new_rows)
        for name, new_rows in kernel.update(rows, args).items()
    }


# -- shared pieces ---------------------------------------------------------------


def _sq(x: Any) -> Any:
    # The kernels' ``square``: x * x, also for complex x (not |x|^2).
    return math_ops.square(x)


def _grad(a: Args) -> Any:
    # The dense GradientDescent kernels call the gradient ``delta``.
    return a["delta"] if "delta" in a else a["grad"]


def _positive(x: Any) -> Any:
    """``x > 0`` for a branch the kernel takes on a scalar hyperparameter."""
    return math_ops.greater(x, array_ops.zeros_like(x))


def _shrink(prox: Any, threshold: Any, scale: Any, l1: Any) -> Any:
    """The proximal l1/l2 step of the Proximal* kernels: ``sign(prox) *
    max(|prox| - threshold, 0) / scale`` if ``l1 > 0``, else ``prox / scale``.

    Subgradients: ``tf.sign`` has gradient zero, ``tf.abs`` gives ``sign``
    (zero at 0), and at the kink ``|prox| == threshold`` ``tf.maximum`` gives
    the gradient to the unclipped side. At ``l1 == 0`` exactly, the kernel's
    branch (no shrinkage) decides, so no gradient reaches ``l1`` there.
    """
    shrunk = math_ops.sign(prox) * math_ops.maximum(math_ops.abs(prox) - threshold, 0) / scale
    return array_ops.where_v2(_positive(l1), shrunk, prox / scale)


# -- the update equations, one per kernel family ------------------------------------
#
# Each mirrors the CPU kernel's expression (training_ops.cc), so that the form's
# value equals the kernel's to round-off; the sparse kernels' row updates are
# the same equations (some written in another, equal order there).


def _gradient_descent(old: Values, a: Args) -> Values:
    # var -= delta * alpha
    return {"var": old["var"] - _grad(a) * a["alpha"]}


def _proximal_gradient_descent(old: Values, a: Args) -> Values:
    # prox = var - alpha * delta; then the l1/l2 proximal step (FOBOS).
    alpha, l1, l2 = a["alpha"], a["l1"], a["l2"]
    prox = old["var"] - _grad(a) * alpha
    return {"var": _shrink(prox, alpha * l1, 1 + l2 * alpha, l1)}


def _momentum(old: Values, a: Args) -> Values:
    # accum = accum * momentum + grad;  var -= lr * accum  (Nesterov:
    # var -= grad * lr + accum * momentum * lr).
    g, lr, momentum = a["grad"], a["lr"], a["momentum"]
    accum = old["accum"] * momentum + g
    if a.get("use_nesterov", False):
        var = old["var"] - (g * lr + accum * momentum * lr)
    else:
        var = old["var"] - accum * lr
    return {"var": var, "accum": accum}


def _keras_momentum(old: Values, a: Args) -> Values:
    # accum = accum * momentum - grad * lr;  var += accum  (Nesterov:
    # var += accum * momentum - grad * lr).
    g, lr, momentum = a["grad"], a["lr"], a["momentum"]
    accum = old["accum"] * momentum - g * lr
    if a.get("use_nesterov", False):
        var = old["var"] + (accum * momentum - g * lr)
    else:
        var = old["var"] + accum
    return {"var": var, "accum": accum}


def _adam(old: Values, a: Args) -> Values:
    # alpha = lr * sqrt(1 - beta2_power) / (1 - beta1_power)
    # m += (grad - m) * (1 - beta1);  v += (grad^2 - v) * (1 - beta2)
    # var -= m * alpha / (sqrt(v) + epsilon)
    # (Nesterov: (grad * (1 - beta1) + beta1 * m) in place of m.)
    g, beta1, beta2, epsilon = a["grad"], a["beta1"], a["beta2"], a["epsilon"]
    alpha = a["lr"] * math_ops.sqrt(1 - a["beta2_power"]) / (1 - a["beta1_power"])
    m = old["m"] + (g - old["m"]) * (1 - beta1)
    v = old["v"] + (_sq(g) - old["v"]) * (1 - beta2)
    step = (g * (1 - beta1) + beta1 * m) if a.get("use_nesterov", False) else m
    return {"var": old["var"] - (step * alpha) / (math_ops.sqrt(v) + epsilon), "m": m, "v": v}


def _adam_with_amsgrad(old: Values, a: Args) -> Values:
    # As Adam, with vhat = max(vhat, v) in the denominator. On a tie,
    # tf.maximum gives the gradient to the previous vhat (the kernel's
    # vhat.cwiseMax(v)).
    g, beta1, beta2, epsilon = a["grad"], a["beta1"], a["beta2"], a["epsilon"]
    alpha = a["lr"] * math_ops.sqrt(1 - a["beta2_power"]) / (1 - a["beta1_power"])
    m = old["m"] + (g - old["m"]) * (1 - beta1)
    v = old["v"] + (_sq(g) - old["v"]) * (1 - beta2)
    vhat = math_ops.maximum(old["vhat"], v)
    return {"var": old["var"] - (m * alpha) / (math_ops.sqrt(vhat) + epsilon), "m": m, "v": v, "vhat": vhat}


def _ada_max(old: Values, a: Args) -> Values:
    # m += (grad - m) * (1 - beta1);  v = max(beta2 * v, |grad|)
    # var -= lr / (1 - beta1_power) * (m / (v + epsilon))
    # On a tie, tf.maximum gives the gradient to beta2 * v; tf.abs gives
    # sign(grad), zero at 0.
    g = a["grad"]
    m = old["m"] + (g - old["m"]) * (1 - a["beta1"])
    v = math_ops.maximum(a["beta2"] * old["v"], math_ops.abs(g))
    var = old["var"] - a["lr"] / (1 - a["beta1_power"]) * (m / (v + a["epsilon"]))
    return {"var": var, "m": m, "v": v}


def _rms_prop(old: Values, a: Args) -> Values:
    # ms += (grad^2 - ms) * (1 - rho)
    # mom = mom * momentum + grad * lr / sqrt(ms + epsilon);  var -= mom
    g = a["grad"]
    ms = old["ms"] + (_sq(g) - old["ms"]) * (1 - a["rho"])
    mom = old["mom"] * a["momentum"] + (g * a["lr"]) / math_ops.sqrt(ms + a["epsilon"])
    return {"var": old["var"] - mom, "ms": ms, "mom": mom}


def _centered_rms_prop(old: Values, a: Args) -> Values:
    # As RMSProp, centred by the mean gradient mg:
    # mg += (grad - mg) * (1 - rho);  denominator sqrt(ms - mg^2 + epsilon).
    g, rho = a["grad"], a["rho"]
    ms = old["ms"] + (_sq(g) - old["ms"]) * (1 - rho)
    mg = old["mg"] + (g - old["mg"]) * (1 - rho)
    denom = (ms - _sq(mg)) + a["epsilon"]
    mom = old["mom"] * a["momentum"] + (g * a["lr"]) / math_ops.sqrt(denom)
    return {"var": old["var"] - mom, "mg": mg, "ms": ms, "mom": mom}


def _adagrad(old: Values, a: Args) -> Values:
    # accum += grad^2 (unless update_slots is False);  var -= grad * lr * rsqrt(accum)
    g, update_slots = a["grad"], a.get("update_slots", True)
    accum = old["accum"] + _sq(g) if update_slots else old["accum"]
    var = old["var"] - g * a["lr"] * math_ops.rsqrt(accum)
    return {"var": var, "accum": accum} if update_slots else {"var": var}


def _adagrad_v2(old: Values, a: Args) -> Values:
    # accum += grad^2 (unless update_slots is False)
    # var -= grad * lr / (sqrt(accum) + epsilon)
    g, update_slots = a["grad"], a.get("update_slots", True)
    accum = old["accum"] + _sq(g) if update_slots else old["accum"]
    var = old["var"] - g * a["lr"] / (math_ops.sqrt(accum) + a["epsilon"])
    return {"var": var, "accum": accum} if update_slots else {"var": var}


def _proximal_adagrad(old: Values, a: Args) -> Values:
    # accum += grad^2;  rate = lr * rsqrt(accum);  prox = var - grad * rate;
    # then the l1/l2 proximal step with that rate.
    g, l1, l2 = a["grad"], a["l1"], a["l2"]
    accum = old["accum"] + _sq(g)
    rate = a["lr"] * math_ops.rsqrt(accum)
    prox = old["var"] - g * rate
    return {"var": _shrink(prox, rate * l1, 1 + l2 * rate, l1), "accum": accum}


def _adagrad_da(old: Values, a: Args) -> Values:
    # ga += grad;  gga += grad^2;  T = global_step (as float, then the dtype)
    # var = -lr * sign(ga) * max(|ga| - l1 * T, 0) / (l2 * T * lr + sqrt(gga))
    # (var = -lr * ga / (...) if l1 <= 0). The previous var is not used.
    g, lr, l1, l2 = a["grad"], a["lr"], a["l1"], a["l2"]
    ga = old["gradient_accumulator"] + g
    gga = old["gradient_squared_accumulator"] + _sq(g)
    # The kernel casts the int64 step to float first; so does this form.
    step = math_ops.cast(math_ops.cast(a["global_step"], dtypes.float32), ga.dtype)
    denom = l2 * (step * lr) + math_ops.sqrt(gga)
    shrunk = lr * -1 * math_ops.sign(ga) * math_ops.maximum(math_ops.abs(ga) - step * l1, 0) / denom
    var = array_ops.where_v2(_positive(l1), shrunk, lr * ga * -1 / denom)
    return {"var": var, "gradient_accumulator": ga, "gradient_squared_accumulator": gga}


def _adadelta(old: Values, a: Args) -> Values:
    # accum = accum * rho + grad^2 * (1 - rho)
    # update = sqrt(accum_update + epsilon) * rsqrt(accum + epsilon) * grad
    # var -= update * lr;  accum_update = accum_update * rho + update^2 * (1 - rho)
    g, rho, epsilon = a["grad"], a["rho"], a["epsilon"]
    accum = old["accum"] * rho + _sq(g) * (1 - rho)
    update = math_ops.sqrt(old["accum_update"] + epsilon) * math_ops.rsqrt(accum + epsilon) * g
    accum_update = old["accum_update"] * rho + _sq(update) * (1 - rho)
    return {"var": old["var"] - update * a["lr"], "accum": accum, "accum_update": accum_update}


def _ftrl(old: Values, a: Args) -> Values:
    """Ftrl and FtrlV2 (``l2_shrinkage``), with or without ``multiply_linear_by_lr``.

    new_accum = accum + grad^2;  p(x) = x^(-lr_power)
    linear += grad' - (p(new_accum) - p(accum)) / lr * var,  grad' = grad + 2 l2_shrinkage var
    var = (l1 sign(linear) - linear) / (p(new_accum) / lr + 2 l2)  if |linear| > l1, else 0
    With ``multiply_linear_by_lr``, linear is kept times lr: ``grad' * lr``,
    ``(p(new) - p(old)) * var``, threshold ``l1 * lr``, denominator
    ``p(new_accum) + 2 l2 lr``.

    The kernel computes ``p`` with ``sqrt`` when ``lr_power == -0.5``; the form
    always uses ``tf.pow`` (equal to round-off), whose gradient also reaches
    ``lr_power`` (TensorFlow's: no ``log`` term where the base is 0).
    Subgradients: ``tf.sign`` zero; where ``|linear| <= l1`` the new var is 0
    and gets no gradient (``tf.where``, as the kernel's select).
    """
    g, lr, lr_power = a["grad"], a["lr"], a["lr_power"]
    accum, linear, var = old["accum"], old["linear"], old["var"]
    shrinkage = g + 2 * a["l2_shrinkage"] * var if "l2_shrinkage" in a else g
    new_accum = accum + _sq(g)
    power_new, power_old = math_ops.pow(new_accum, -lr_power), math_ops.pow(accum, -lr_power)
    if a.get("multiply_linear_by_lr", False):
        linear = linear + (shrinkage * lr - (power_new - power_old) * var)
        threshold = a["l1"] * lr
        y = power_new + 2 * a["l2"] * lr
    else:
        linear = linear + (shrinkage - (power_new - power_old) / lr * var)
        threshold = a["l1"]
        y = power_new / lr + 2 * a["l2"]
    x = threshold * math_ops.sign(linear) - linear
    new_var = array_ops.where_v2(math_ops.abs(linear) > threshold, x / y, array_ops.zeros_like(x))
    return {"var": new_var, "accum": new_accum, "linear": linear}


def _add_sign(old: Values, a: Args) -> Values:
    # m = m * beta + grad * (1 - beta)
    # var -= lr * (alpha + sign_decay * sign(grad) * sign(m)) * grad
    # tf.sign has gradient zero: the sign factors pass no gradient.
    g = a["grad"]
    m = old["m"] * a["beta"] + g * (1 - a["beta"])
    sign_gm = math_ops.sign(g) * math_ops.sign(m)
    return {"var": old["var"] - a["lr"] * (a["alpha"] + a["sign_decay"] * sign_gm) * g, "m": m}


def _power_sign(old: Values, a: Args) -> Values:
    # m = m * beta + grad * (1 - beta)
    # var -= lr * exp(logbase * sign_decay * sign(grad) * sign(m)) * grad
    g = a["grad"]
    m = old["m"] * a["beta"] + g * (1 - a["beta"])
    sign_gm = math_ops.sign(g) * math_ops.sign(m)
    scale = math_ops.exp(a["logbase"] * a["sign_decay"] * sign_gm)
    return {"var": old["var"] - a["lr"] * scale * g, "m": m}


# -- the registry ------------------------------------------------------------------
#
# op name -> Kernel. ``writes`` and ``inputs`` are the op's resource arguments and
# its arguments of type T, in the op's order (tests/test_fused_optimizers.py
# checks them against TensorFlow's op definitions).

_ADAM_INPUTS = ("beta1_power", "beta2_power", "lr", "beta1", "beta2", "epsilon", "grad")
_FTRL_INPUTS = ("grad", "lr", "l1", "l2", "lr_power")
_FTRL_V2_INPUTS = ("grad", "lr", "l1", "l2", "l2_shrinkage", "lr_power")

KERNELS: Dict[str, Kernel] = {
    # Dense: the whole variable.
    "ResourceApplyGradientDescent": Kernel(("var",), ("alpha", "delta"), _gradient_descent),
    "ResourceApplyProximalGradientDescent": Kernel(
        ("var",), ("alpha", "l1", "l2", "delta"), _proximal_gradient_descent
    ),
    "ResourceApplyMomentum": Kernel(("var", "accum"), ("lr", "grad", "momentum"), _momentum),
    "ResourceApplyKerasMomentum": Kernel(("var", "accum"), ("lr", "grad", "momentum"), _keras_momentum),
    "ResourceApplyAdam": Kernel(("var", "m", "v"), _ADAM_INPUTS, _adam),
    "ResourceApplyAdamWithAmsgrad": Kernel(("var", "m", "v", "vhat"), _ADAM_INPUTS, _adam_with_amsgrad),
    "ResourceApplyAdaMax": Kernel(
        ("var", "m", "v"), ("beta1_power", "lr", "beta1", "beta2", "epsilon", "grad"), _ada_max
    ),
    "ResourceApplyRMSProp": Kernel(("var", "ms", "mom"), ("lr", "rho", "momentum", "epsilon", "grad"), _rms_prop),
    "ResourceApplyCenteredRMSProp": Kernel(
        ("var", "mg", "ms", "mom"), ("lr", "rho", "momentum", "epsilon", "grad"), _centered_rms_prop
    ),
    "ResourceApplyAdagrad": Kernel(("var", "accum"), ("lr", "grad"), _adagrad),
    "ResourceApplyAdagradV2": Kernel(("var", "accum"), ("lr", "epsilon", "grad"), _adagrad_v2),
    "ResourceApplyProximalAdagrad": Kernel(("var", "accum"), ("lr", "l1", "l2", "grad"), _proximal_adagrad),
    "ResourceApplyAdagradDA": Kernel(
        ("var", "gradient_accumulator", "gradient_squared_accumulator"), ("grad", "lr", "l1", "l2"), _adagrad_da
    ),
    "ResourceApplyAdadelta": Kernel(("var", "accum", "accum_update"), ("lr", "rho", "epsilon", "grad"), _adadelta),
    "ResourceApplyFtrl": Kernel(("var", "accum", "linear"), _FTRL_INPUTS, _ftrl),
    "ResourceApplyFtrlV2": Kernel(("var", "accum", "linear"), _FTRL_V2_INPUTS, _ftrl),
    "ResourceApplyAddSign": Kernel(("var", "m"), ("lr", "alpha", "sign_decay", "beta", "grad"), _add_sign),
    "ResourceApplyPowerSign": Kernel(("var", "m"), ("lr", "logbase", "sign_decay", "beta", "grad"), _power_sign),
}

# Sparse: the rows at ``indices``, with the dense kernel's row update (see
# ``new_values``). TensorFlow has no sparse GradientDescent, Adam, AdaMax,
# AddSign or PowerSign kernel (their optimizers' sparse steps are scatter ops).
_DENSE_OF = {
    "ResourceSparseApplyProximalGradientDescent": "ResourceApplyProximalGradientDescent",
    "ResourceSparseApplyMomentum": "ResourceApplyMomentum",
    "ResourceSparseApplyKerasMomentum": "ResourceApplyKerasMomentum",
    "ResourceSparseApplyRMSProp": "ResourceApplyRMSProp",
    "ResourceSparseApplyCenteredRMSProp": "ResourceApplyCenteredRMSProp",
    "ResourceSparseApplyAdagrad": "ResourceApplyAdagrad",
    "ResourceSparseApplyAdagradV2": "ResourceApplyAdagradV2",
    "ResourceSparseApplyProximalAdagrad": "ResourceApplyProximalAdagrad",
    "ResourceSparseApplyAdagradDA": "ResourceApplyAdagradDA",
    "ResourceSparseApplyAdadelta": "ResourceApplyAdadelta",
    "ResourceSparseApplyFtrl": "ResourceApplyFtrl",
    "ResourceSparseApplyFtrlV2": "ResourceApplyFtrlV2",
}
for _sparse, _dense in _DENSE_OF.items():
    # The same inputs (the dense ProximalGradientDescent's ``delta`` is ``grad``
    # here), besides ``indices``.
    _inputs = tuple("grad" if name == "delta" else name for name in KERNELS[_dense].inputs)
    KERNELS[_sparse] = KERNELS[_dense]._replace(inputs=_inputs, sparse=True)
del _sparse, _dense, _inputs
