"""The fused optimizer kernels (``ResourceApply*``, ``ResourceSparseApply*``) are
differentiated: the variable and every slot they write get a new version, and
gradients reach the previous versions, the gradient tensor and every
hyperparameter.

* Each kernel directly (``tf.raw_ops``): the rule's functional form gives the
  kernel's own values (to float64 round-off), and the tape's gradient with
  respect to every input (previous values of the variable and each slot, the
  gradient, each hyperparameter) equals central finite differences of the real
  kernel; compiled too (``tf.function``, and XLA where the kernel compiles).
* The optimizers built on them (``tf.compat.v1.train`` and
  ``tf_keras.optimizers.legacy``), two steps so that the slots carry state: the
  hypergradient with respect to the learning rate and the meta-gradient with
  respect to the initial weights equal finite differences of the whole program,
  eagerly and inside ``tf.function``, with dense gradients and with sparse
  ``IndexedSlices`` from an embedding lookup.
* The bookkeeping: versions for every slot, variables the tape does not know,
  duplicate indices, control flow, ``stop_recording``, second order.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.core.framework import op_def_pb2, types_pb2
from tensorflow.python.client import pywrap_tf_session
from tensorflow.python.ops import resource_variable_ops, state_ops

from assigntape import AssignAwareTape, DuplicateIndicesError, UntrackedWriteError, _fused, _patches, _rules

F64, C128 = tf.float64, tf.complex128

# -- the registry ----------------------------------------------------------------


def _op_defs() -> Dict[str, op_def_pb2.OpDef]:
    """Every op registered in this TensorFlow, by name."""
    op_list = op_def_pb2.OpList()
    op_list.ParseFromString(pywrap_tf_session.TF_GetBuffer(pywrap_tf_session.TF_GetAllOpList()))
    return {op.name: op for op in op_list.op}


OP_DEFS = _op_defs()
FUSED_OPS = sorted(name for name in OP_DEFS if name.startswith(_rules.UNDIFFERENTIABLE_PREFIXES))


def test_every_fused_kernel_has_a_rule_and_none_is_refused():
    # All 30 of TensorFlow 2.21 (18 dense, 12 sparse). One a later TensorFlow
    # adds is refused until it has a rule.
    assert len(_fused.KERNELS) == 30 and set(_fused.KERNELS) <= set(FUSED_OPS)
    for name in FUSED_OPS:
        if name in _fused.KERNELS:
            assert _rules.RULES[name] is _fused.KERNELS[name], name
            assert not _rules.refused(name), name
        else:
            assert _rules.refused(name), name
    assert _rules.refused("ResourceApplyFutureOptimizer")
    assert _rules.refused("ResourceSparseApplyFutureOptimizer")


@pytest.mark.parametrize("name", sorted(_fused.KERNELS))
def test_each_rule_names_the_kernels_arguments(name):
    # The resources it writes and the inputs of the variable's dtype, in the
    # op's order, from TensorFlow's own op definition.
    op_def = OP_DEFS[name]
    kernel = _fused.KERNELS[name]
    assert kernel.writes == tuple(a.name for a in op_def.input_arg if a.type == types_pb2.DT_RESOURCE)
    assert kernel.inputs == tuple(a.name for a in op_def.input_arg if a.type_attr == "T")
    assert kernel.sparse == name.startswith("ResourceSparseApply")


def test_the_kernels_wrappers_are_patched():
    patched = {(id(owner), name) for owner, name in _patches.patched_places()}
    from tensorflow.python.ops import gen_training_ops

    for name in FUSED_OPS:
        assert (id(tf.raw_ops), name) in patched, name
        assert (id(gen_training_ops), _patches._snake(name, gen_training_ops)) in patched, name


# -- each kernel, directly ---------------------------------------------------------
#
# Inputs drawn away from the kernels' kinks (so that central differences see a
# smooth function), but on both sides of them: some Ftrl coordinates have
# |linear| <= l1 (new var 0), some proximal steps shrink to 0 (``KINKED``).

HYPER: Dict[str, float] = {
    "lr": 0.3,
    "alpha": 0.3,
    "momentum": 0.7,
    "beta1": 0.8,
    "beta2": 0.95,
    "beta1_power": 0.64,
    "beta2_power": 0.9025,
    "epsilon": 0.05,
    "rho": 0.8,
    "l1": 0.6,
    "l2": 0.2,
    "l2_shrinkage": 0.15,
    "lr_power": -0.5,
    "sign_decay": 0.6,
    "beta": 0.7,
    "logbase": float(np.log(2.0)),
}
# (low, high) of each slot's starting values; others are uniform in (-1, 1).
SLOT_RANGE = {
    "accum": (0.2, 1.0),
    "ms": (0.6, 1.0),
    "mg": (-0.3, 0.3),
    "v": (0.05, 0.2),
    "vhat": (0.05, 0.3),
    "accum_update": (0.2, 1.0),
    "gradient_squared_accumulator": (0.2, 1.0),
}
COMPLEX_KERNELS = {  # the kernels TensorFlow registers for complex types on the CPU
    "GradientDescent",
    "Momentum",
    "KerasMomentum",
    "Adagrad",
    "AdagradV2",
    "Adadelta",
    "Adam",
    "RMSProp",
    "CenteredRMSProp",
}
# The value whose size the l1 shrinkage compares with its threshold.
KINKED = {
    "Ftrl": "linear",
    "FtrlV2": "linear",
    "ProximalGradientDescent": "var",
    "ProximalAdagrad": "var",
    "AdagradDA": "gradient_accumulator",
}
GLOBAL_STEP = 3
SPARSE_INDICES = [3, 0, 1, 4]


def _family(name: str) -> str:
    return name.replace("ResourceSparseApply", "").replace("ResourceApply", "")


def _kernel_cases() -> List[Any]:
    cases = []
    for name in sorted(_fused.KERNELS):
        family, sparse = _family(name), _fused.KERNELS[name].sparse
        variants: List[Tuple[str, Dict[str, Any], Dict[str, float]]] = [("", {}, {})]
        if family in ("Momentum", "KerasMomentum", "Adam"):
            variants.append(("nesterov", {"use_nesterov": True}, {}))
        if family in ("Adagrad", "AdagradV2"):
            variants.append(("no_slot_update", {"update_slots": False}, {}))
        if family.startswith("Ftrl"):
            variants += [
                ("linear_by_lr", {"multiply_linear_by_lr": True}, {}),
                ("lr_power", {}, {"lr_power": -0.7}),
                ("linear_by_lr_lr_power", {"multiply_linear_by_lr": True}, {"lr_power": -0.7}),
            ]
        if family.startswith("Proximal") or family == "AdagradDA":
            variants.append(("l1_zero", {}, {"l1": 0.0}))
        for label, attrs, hyper in variants:
            shapes = [(5, 3), (6,)] if sparse else [(4, 3)]  # rank 1: the kernels' scalar-row path
            for shape in shapes:
                dtypes = [F64] + ([C128] if family in COMPLEX_KERNELS and not label else [])
                for dtype in dtypes:
                    parts = [name, label, "x".join(map(str, shape)), dtype.name]
                    cases.append(pytest.param(name, attrs, hyper, shape, dtype, id="-".join(p for p in parts if p)))
    return cases


KERNEL_CASES = _kernel_cases()


class KernelCall:
    """One call of a fused kernel: starting values, arguments, a loss weighting
    every value it writes; and the same call run plainly, for finite differences."""

    def __init__(self, name: str, attrs: Dict[str, Any], hyper: Dict[str, float], shape: Tuple[int, ...], dtype: Any):
        rng = np.random.default_rng(zlib.crc32(repr((name, attrs, hyper, shape, dtype.name)).encode()))
        self.name, self.kernel, self.dtype = name, _fused.KERNELS[name], dtype
        self.attrs = dict(attrs)
        complex_ = dtype.is_complex

        def draw(size: Tuple[int, ...], low: float = -1.0, high: float = 1.0) -> np.ndarray:
            x = rng.uniform(low, high, size)
            return x + 0.3j * rng.uniform(low, high, size) if complex_ else x

        self.old = {r: draw(shape, *SLOT_RANGE.get(r, (-1.0, 1.0))) for r in self.kernel.writes}
        rows = (len(SPARSE_INDICES),) + tuple(shape[1:]) if self.kernel.sparse else shape
        grad_scale = 2.0 if complex_ else 1.0
        kinked = KINKED.get(_family(name))
        if kinked is not None:
            # Alternate coordinates (so every written row has both) well inside
            # and well outside the l1 threshold, with gradients too small to
            # carry one across: both sides of the kink, none near it.
            size = int(np.prod(shape))
            magnitude = np.where(np.arange(size) % 2 == 0, 0.02, 3.0).reshape(shape)
            self.old[kinked] = magnitude * rng.choice([-1.0, 1.0], shape) * rng.uniform(0.8, 1.2, shape)
            grad_scale = 0.1
        params = {**HYPER, **hyper}
        self.inputs = {
            a: draw(rows) * grad_scale if a in ("grad", "delta") else np.asarray(params[a] + (0.1j if complex_ else 0))
            for a in self.kernel.inputs
        }
        self.fixed: Dict[str, Any] = {}
        if self.kernel.sparse:
            self.fixed["indices"] = tf.constant(SPARSE_INDICES, tf.int64)
        if "global_step" in (a.name for a in OP_DEFS[name].input_arg):
            self.fixed["global_step"] = tf.constant(GLOBAL_STEP, tf.int64)
        self.weights = {r: draw(shape) for r in self.kernel.writes}

    def written(self) -> Tuple[str, ...]:
        return _fused.written(self.kernel, self.attrs)

    def call(self, variables: Dict[str, tf.Variable], inputs: Dict[str, Any]) -> None:
        op = getattr(tf.raw_ops, self.name)
        op(**{r: v.handle for r, v in variables.items()}, **inputs, **self.fixed, **self.attrs)

    def loss(self, values: Dict[str, Any]) -> Any:
        return tf.add_n([tf.reduce_sum(tf.math.real(self.weights[r] * values[r])) for r in self.kernel.writes])

    def plain(self, old: Dict[str, np.ndarray], inputs: Dict[str, np.ndarray]) -> float:
        variables = {r: tf.Variable(v, dtype=self.dtype) for r, v in old.items()}
        self.call(variables, {a: tf.constant(v, self.dtype) for a, v in inputs.items()})
        return float(self.loss({r: v.read_value() for r, v in variables.items()}))

    def tape_gradients(self, mode: str) -> Tuple[Dict[str, Any], Dict[str, np.ndarray], Dict[str, int]]:
        """The written values, the gradient w.r.t. every input and every
        starting value, and each variable's number of versions. The gradient is
        the tape's, or in ``graph`` modes the graph's own: ``tf.gradients`` in
        the tape's function (``tf_gradients``), or a plain tape around a call
        of the tape's function (``call``); ``_xla`` compiles the function."""
        variables = {r: tf.Variable(v, dtype=self.dtype, name=r) for r, v in self.old.items()}
        inputs = {a: tf.constant(v, self.dtype) for a, v in self.inputs.items()}
        graph_mode = mode.removesuffix("_xla")

        def body(*given: Any) -> Tuple[Dict[str, Any], Any, Dict[str, Any], Dict[str, Any]]:
            args = dict(zip(inputs, given)) if given else inputs
            own = [v.handle for v in variables.values()]  # each variable's version at tape start
            with AssignAwareTape() as tape:
                tape.watch(list(args.values()))
                if mode == "cond":
                    tf.cond(
                        tf.constant(True),
                        lambda: (self.call(variables, args), tf.constant(0))[1],
                        lambda: tf.constant(0),
                    )
                elif mode == "loop":
                    tf.while_loop(lambda i: i < 1, lambda i: (self.call(variables, args), i + 1)[1], [tf.constant(0)])
                else:
                    self.call(variables, args)
                values = {r: v.read_value() for r, v in variables.items()}
                loss = self.loss(values)
            # AdagradDA's new var does not depend on the previous one: zeros, which
            # the finite differences must agree with.
            zero = tf.UnconnectedGradients.ZERO
            if graph_mode == "tf_gradients":
                found = tf.gradients(loss, [*own, *args.values()], unconnected_gradients=zero)
                grads = dict(zip([*variables, *args], found))
            elif graph_mode == "call":
                grads = {}  # the plain tape around the call takes them
            else:
                grads = tape.gradient(loss, {**variables, **args}, unconnected_gradients=zero)
            counts = {r: tf.constant(len(tape.versions(v))) for r, v in variables.items()}
            return values, loss, grads, counts

        if graph_mode == "call":
            compiled = tf.function(body, jit_compile=mode.endswith("_xla"))
            with tf.GradientTape() as plain:
                plain.watch(list(inputs.values()))
                values, loss, _, counts = compiled(*inputs.values())
            grads = plain.gradient(loss, {**variables, **inputs}, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        else:
            jit = mode in ("xla", "tf_gradients_xla")
            run = body if mode == "eager" else tf.function(body, jit_compile=jit)
            values, _, grads, counts = run()
        return (
            {r: v.numpy() for r, v in values.items()},
            {k: np.asarray(tf.convert_to_tensor(g)) for k, g in grads.items()},
            {r: int(c) for r, c in counts.items()},
        )

    def finite_difference(self, key: str, direction: np.ndarray, eps: float = 1e-6) -> float:
        def at(t: float) -> float:
            old = {r: v + t * direction if r == key else v for r, v in self.old.items()}
            inputs = {a: v + t * direction if a == key else v for a, v in self.inputs.items()}
            return self.plain(old, inputs)

        return (at(eps) - at(-eps)) / (2 * eps)


def _directional(grad: np.ndarray, direction: np.ndarray) -> float:
    # TensorFlow's gradient of a real loss w.r.t. complex z is dL/dx + i dL/dy.
    return float(np.sum(np.real(np.conj(grad) * direction)))


def _check_kernel(call: KernelCall, mode: str) -> None:
    values, grads, counts = call.tape_gradients(mode)
    # The values are the kernel's (the tape does not change them) and equal the
    # rule's functional form: this checks the update equations.
    old = {r: tf.constant(v, call.dtype) for r, v in call.old.items()}
    args = {**{a: tf.constant(v, call.dtype) for a, v in call.inputs.items()}, **call.fixed, **call.attrs}
    expected = _fused.new_values(call.kernel, old, args)
    assert set(expected) == set(call.written())
    for r in call.kernel.writes:
        np.testing.assert_allclose(values[r], expected[r] if r in expected else call.old[r], rtol=1e-12, atol=1e-13)
        # One new version per variable the kernel writes.
        assert counts[r] == (2 if r in call.written() else 1), r
    family = _family(call.name)
    if (family.startswith(("Ftrl", "Proximal")) or family == "AdagradDA") and float(np.real(call.inputs["l1"])) > 0:
        # Both sides of the l1 kink: written coordinates shrunk to 0 and others not.
        written = values["var"][SPARSE_INDICES] if call.kernel.sparse else values["var"]
        zero = written == 0
        assert zero.any() and not zero.all(), written
    # The gradient w.r.t. every starting value and every input, against finite
    # differences of the real kernel in a random direction.
    rng = np.random.default_rng(7)
    for key in [*call.kernel.writes, *call.kernel.inputs]:
        point = call.old.get(key, call.inputs.get(key))
        direction = rng.normal(size=np.shape(point)) + (
            1j * rng.normal(size=np.shape(point)) if call.dtype.is_complex else 0
        )
        if key == "l1" and float(np.real(point)) == 0.0:
            # At l1 == 0 the kernel takes its no-shrinkage branch, and so does
            # the gradient: none reaches l1 (l1 < 0 is refused by some kernels).
            assert _directional(grads[key], direction) == 0.0
            continue
        fd = call.finite_difference(key, direction)
        np.testing.assert_allclose(_directional(grads[key], direction), fd, rtol=1e-6, atol=1e-8, err_msg=key)


@pytest.mark.parametrize("name, attrs, hyper, shape, dtype", KERNEL_CASES)
def test_kernel_values_and_gradients_eager(name, attrs, hyper, shape, dtype):
    _check_kernel(KernelCall(name, attrs, hyper, shape, dtype), "eager")


# Compiled: every kernel in its default form inside tf.function, and every dense
# kernel that XLA compiles (all but AdamWithAmsgrad; TensorFlow has no XLA
# kernel for it or for the sparse ones) under jit_compile.
XLA_LESS = {"ResourceApplyAdamWithAmsgrad"}
COMPILED_CASES = [
    pytest.param(name, mode, id=f"{name}-{mode}")
    for name in sorted(_fused.KERNELS)
    for mode in ("function", "xla")
    if mode == "function" or not (_fused.KERNELS[name].sparse or name in XLA_LESS)
]


# Every kernel in a tf.cond branch and in a graph loop body (one iteration) of
# the tape's function.
CONTROL_FLOW_CASES = [
    pytest.param(name, mode, id=f"{name}-{mode}") for name in sorted(_fused.KERNELS) for mode in ("cond", "loop")
]


@pytest.mark.parametrize("name, mode", COMPILED_CASES + CONTROL_FLOW_CASES)
def test_kernel_values_and_gradients_compiled(name, mode):
    _check_kernel(KernelCall(name, {}, {}, (5, 3), F64), mode)


# The graph's own gradient through every kernel, as TensorFlow differentiates
# the tape's function without the tape: tf.gradients in it, and a plain tape
# around a call of it; compiled by XLA where XLA has the kernel.
GRAPH_GRADIENT_CASES = [
    pytest.param(name, f"{how}{xla}", id=f"{name}-{how}{xla}")
    for name in sorted(_fused.KERNELS)
    for how in ("tf_gradients", "call")
    for xla in ("", "_xla")
    if not xla or not (_fused.KERNELS[name].sparse or name in XLA_LESS)
]


@pytest.mark.parametrize("name, mode", GRAPH_GRADIENT_CASES)
def test_kernel_graph_gradients(name, mode):
    _check_kernel(KernelCall(name, {}, {}, (5, 3), F64), mode)


# -- the optimizers ------------------------------------------------------------------
#
# Two steps of an optimizer inside the tape, the inner gradient from a plain tape
# (second order, through it, for the meta-gradient), then a validation loss. The
# learning rate is a float64 variable: tf.compat.v1 optimizers take it as it is,
# tf_keras ones through a callable (they would copy a number into a variable of
# their own).
# The oracle is central finite differences of the same program (no
# AssignAwareTape) in the learning rate and along a direction in the initial
# weights; each optimizer is also checked to have run the kernel named.


class Spec:
    """An optimizer under test: how to make it, and the kernels its steps use."""

    def __init__(self, make: Callable[[tf.Variable], Any], dense: str, sparse: str = "", lr: float = 0.1):
        self.make, self.dense, self.sparse, self.lr = make, dense, sparse, lr


V1 = tf.compat.v1.train
K2 = tf_keras.optimizers.legacy
OPTIMIZERS: Dict[str, Spec] = {
    # tf.compat.v1.train
    "v1_sgd": Spec(lambda lr: V1.GradientDescentOptimizer(lr), "ResourceApplyGradientDescent"),
    "v1_momentum": Spec(
        lambda lr: V1.MomentumOptimizer(lr, 0.8), "ResourceApplyMomentum", "ResourceSparseApplyMomentum"
    ),
    "v1_nesterov": Spec(
        lambda lr: V1.MomentumOptimizer(lr, 0.8, use_nesterov=True),
        "ResourceApplyMomentum",
        "ResourceSparseApplyMomentum",
    ),
    # Its sparse step is assign and scatter ops, no kernel: here for the slot
    # lookup of tf.compat.v1 optimizers after a write in the tape's graph.
    "v1_adam": Spec(lambda lr: V1.AdamOptimizer(lr, epsilon=1e-3), "ResourceApplyAdam", "ResourceScatterAdd"),
    "v1_rmsprop": Spec(
        lambda lr: V1.RMSPropOptimizer(lr, epsilon=1e-3),
        "ResourceApplyRMSProp",
        "ResourceSparseApplyRMSProp",
        lr=0.05,
    ),
    "v1_rmsprop_momentum": Spec(
        lambda lr: V1.RMSPropOptimizer(lr, momentum=0.5, epsilon=1e-3),
        "ResourceApplyRMSProp",
        "ResourceSparseApplyRMSProp",
        lr=0.05,
    ),
    "v1_rmsprop_centered": Spec(
        lambda lr: V1.RMSPropOptimizer(lr, momentum=0.5, epsilon=1e-3, centered=True),
        "ResourceApplyCenteredRMSProp",
        "ResourceSparseApplyCenteredRMSProp",
        lr=0.05,
    ),
    "v1_adagrad": Spec(lambda lr: V1.AdagradOptimizer(lr), "ResourceApplyAdagrad", "ResourceSparseApplyAdagrad"),
    "v1_adagrad_da": Spec(
        lambda lr: V1.AdagradDAOptimizer(
            lr, tf.Variable(1, dtype=tf.int64), l1_regularization_strength=0.01, l2_regularization_strength=0.01
        ),
        "ResourceApplyAdagradDA",
        "ResourceSparseApplyAdagradDA",
    ),
    "v1_adadelta": Spec(
        lambda lr: V1.AdadeltaOptimizer(lr, epsilon=1e-2),
        "ResourceApplyAdadelta",
        "ResourceSparseApplyAdadelta",
        lr=1.0,
    ),
    "v1_ftrl": Spec(
        lambda lr: V1.FtrlOptimizer(lr, l1_regularization_strength=0.01, l2_regularization_strength=0.01),
        "ResourceApplyFtrl",
        "ResourceSparseApplyFtrl",
    ),
    "v1_ftrl_shrinkage": Spec(
        lambda lr: V1.FtrlOptimizer(lr, l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.1),
        "ResourceApplyFtrlV2",
        "ResourceSparseApplyFtrlV2",
    ),
    # The dense steps of these two pass l1 and l2 uncast: float64 tensors for a
    # float64 variable (as plain TensorFlow needs).
    "v1_proximal_sgd": Spec(
        lambda lr: V1.ProximalGradientDescentOptimizer(
            lr, l1_regularization_strength=tf.constant(0.01, F64), l2_regularization_strength=tf.constant(0.01, F64)
        ),
        "ResourceApplyProximalGradientDescent",
        "ResourceSparseApplyProximalGradientDescent",
    ),
    "v1_proximal_adagrad": Spec(
        lambda lr: V1.ProximalAdagradOptimizer(
            lr, l1_regularization_strength=tf.constant(0.01, F64), l2_regularization_strength=tf.constant(0.01, F64)
        ),
        "ResourceApplyProximalAdagrad",
        "ResourceSparseApplyProximalAdagrad",
    ),
    # tf_keras.optimizers.legacy
    "k2_sgd": Spec(lambda lr: K2.SGD(lambda: lr), "ResourceApplyGradientDescent"),
    "k2_sgd_momentum": Spec(
        lambda lr: K2.SGD(lambda: lr, momentum=0.8), "ResourceApplyKerasMomentum", "ResourceSparseApplyKerasMomentum"
    ),
    "k2_sgd_nesterov": Spec(
        lambda lr: K2.SGD(lambda: lr, momentum=0.8, nesterov=True),
        "ResourceApplyKerasMomentum",
        "ResourceSparseApplyKerasMomentum",
    ),
    "k2_adam": Spec(lambda lr: K2.Adam(lambda: lr, epsilon=1e-3), "ResourceApplyAdam"),
    "k2_adam_amsgrad": Spec(lambda lr: K2.Adam(lambda: lr, epsilon=1e-3, amsgrad=True), "ResourceApplyAdamWithAmsgrad"),
    "k2_adamax": Spec(lambda lr: K2.Adamax(lambda: lr, epsilon=1e-3), "ResourceApplyAdaMax"),
    "k2_adagrad": Spec(lambda lr: K2.Adagrad(lambda: lr), "ResourceApplyAdagradV2", "ResourceSparseApplyAdagradV2"),
    "k2_adadelta": Spec(
        lambda lr: K2.Adadelta(lambda: lr, epsilon=1e-2), "ResourceApplyAdadelta", "ResourceSparseApplyAdadelta", lr=1.0
    ),
    # Without momentum, legacy RMSprop (and Nadam always) writes with assign ops.
    "k2_rmsprop": Spec(lambda lr: K2.RMSprop(lambda: lr, epsilon=1e-3), "AssignVariableOp", lr=0.05),
    "k2_rmsprop_momentum": Spec(
        lambda lr: K2.RMSprop(lambda: lr, momentum=0.5, epsilon=1e-3),
        "ResourceApplyRMSProp",
        "ResourceSparseApplyRMSProp",
        lr=0.05,
    ),
    "k2_rmsprop_centered": Spec(
        lambda lr: K2.RMSprop(lambda: lr, momentum=0.5, epsilon=1e-3, centered=True),
        "ResourceApplyCenteredRMSProp",
        "ResourceSparseApplyCenteredRMSProp",
        lr=0.05,
    ),
    "k2_ftrl": Spec(
        lambda lr: K2.Ftrl(lambda: lr, l1_regularization_strength=0.01, l2_regularization_strength=0.01),
        "ResourceApplyFtrl",
        "ResourceSparseApplyFtrl",
    ),
    "k2_ftrl_shrinkage": Spec(
        lambda lr: K2.Ftrl(lambda: lr, l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.1),
        "ResourceApplyFtrlV2",
        "ResourceSparseApplyFtrlV2",
    ),
    "k2_nadam": Spec(lambda lr: K2.Nadam(lambda: lr, epsilon=1e-3), "AssignVariableOp"),
}

_rng = np.random.default_rng(11)
X = tf.constant(_rng.normal(size=(4, 3)))
Y = tf.constant(_rng.normal(size=(4, 2)))
W0 = _rng.normal(size=(3, 2)) * 0.5
W_DIRECTION = _rng.normal(size=(3, 2))
# Sparse: an embedding table, looked up with a repeated id (which the optimizers
# sum before their sparse kernel) and one row never looked up.
IDS = tf.constant([3, 0, 3, 1])
E0 = _rng.normal(size=(5, 2)) * 0.5
E_DIRECTION = _rng.normal(size=(5, 2))
Q = tf.constant(_rng.normal(size=(4, 2)))


def _inner_loss(w: Any, sparse: bool) -> Any:
    if sparse:
        return tf.reduce_sum(tf.sin(tf.nn.embedding_lookup(w, IDS) + Q) * Q)
    return tf.reduce_sum(tf.sin(X @ w) * Y)


def _outer_loss(w: Any, sparse: bool) -> Any:
    if sparse:
        return tf.reduce_sum(tf.tanh(tf.gather(w, IDS) - Q) ** 2) + tf.reduce_sum(w**2)
    return tf.reduce_sum(tf.tanh(X @ w - Y) ** 2)


def _train(spec: Spec, w0: np.ndarray, lr0: float, sparse: bool, mode: str, tape: bool):
    """Two optimizer steps, then the validation loss; with ``tape``, inside an
    AssignAwareTape, also the gradients w.r.t. the learning rate and the
    initial weights, and the ops that made the weights' versions."""
    w, lr = tf.Variable(w0, dtype=F64, name="w"), tf.Variable(lr0, dtype=F64, name="lr")
    opt = spec.make(lr)
    ops_seen: List[str] = []

    def steps() -> Any:
        for _ in range(2):
            with tf.GradientTape() as inner:
                loss = _inner_loss(w, sparse)
            grad = inner.gradient(loss, w)
            assert isinstance(grad, tf.IndexedSlices) == sparse
            opt.apply_gradients([(grad, w)])
        return _outer_loss(w, sparse)

    def body() -> Tuple[Any, Any, Any]:
        with AssignAwareTape() as outer:
            val = steps()
        ops_seen.extend(r.op for records in outer.history().variables.values() for r in records if r.op)
        # The weights and every slot (none for plain gradient descent): a
        # version per step, besides the first.
        slots = [opt.get_slot(w, name) for name in opt.get_slot_names()]
        assert all(s is not None for s in slots)
        versions.extend(len(outer.versions(v)) for v in [w, *slots])
        d_lr, d_w = outer.gradient(val, [lr, w])
        return val, d_lr, d_w

    if not tape:
        return float(steps())
    versions: List[int] = []
    val, d_lr, d_w = body() if mode == "eager" else tf.function(body, jit_compile=(mode == "xla"))()
    # A fused kernel writes each once per step; assign-and-scatter steps
    # (tf.compat.v1 Adam's sparse one) write a slot more than once.
    fused = (spec.sparse if sparse else spec.dense).startswith(_rules.UNDIFFERENTIABLE_PREFIXES)
    assert versions and all(n == 3 if fused else n >= 3 for n in versions), versions
    return float(val), float(d_lr), np.asarray(tf.convert_to_tensor(d_w)), set(ops_seen)


_references: Dict[Tuple[str, bool], Tuple[float, float, float]] = {}


def _reference(name: str, sparse: bool) -> Tuple[float, float, float]:
    """The validation loss and its finite-difference derivatives in the learning
    rate and along the weight direction, of the program without the tape."""
    key = (name, sparse)
    if key not in _references:
        spec = OPTIMIZERS[name]
        w0, direction = (E0, E_DIRECTION) if sparse else (W0, W_DIRECTION)
        f = lambda w, lr: _train(spec, w, lr, sparse, "eager", tape=False)  # noqa: E731
        eps = 1e-6
        d_lr = (f(w0, spec.lr + eps) - f(w0, spec.lr - eps)) / (2 * eps)
        d_w = (f(w0 + eps * direction, spec.lr) - f(w0 - eps * direction, spec.lr)) / (2 * eps)
        _references[key] = (f(w0, spec.lr), d_lr, d_w)
    return _references[key]


def _check_optimizer(name: str, sparse: bool, mode: str) -> None:
    spec = OPTIMIZERS[name]
    w0, direction = (E0, E_DIRECTION) if sparse else (W0, W_DIRECTION)
    val, d_lr, d_w, ops_seen = _train(spec, w0, spec.lr, sparse, mode, tape=True)
    ref_val, ref_lr, ref_w = _reference(name, sparse)
    assert (spec.sparse if sparse else spec.dense) in ops_seen, ops_seen
    np.testing.assert_allclose(val, ref_val, rtol=1e-12)
    assert abs(ref_lr) > 1e-3 and abs(ref_w) > 1e-3  # the checks below are not vacuous
    np.testing.assert_allclose(d_lr, ref_lr, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(np.sum(d_w * direction), ref_w, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_hypergradient_and_meta_gradient(name, mode):
    _check_optimizer(name, sparse=False, mode=mode)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name", sorted(n for n, s in OPTIMIZERS.items() if s.sparse))
def test_optimizer_sparse_embedding(name, mode):
    _check_optimizer(name, sparse=True, mode=mode)


# Under XLA (every dense kernel but AdamWithAmsgrad compiles; the sparse ones
# do not), a sample of the families: each kernel is also checked under XLA directly.
XLA_OPTIMIZERS = [
    "k2_adadelta",
    "k2_adamax",
    "k2_sgd_nesterov",
    "v1_adagrad_da",
    "v1_ftrl_shrinkage",
    "v1_proximal_adagrad",
    "v1_rmsprop_centered",
]


@pytest.mark.parametrize("name", XLA_OPTIMIZERS)
def test_optimizer_under_xla(name):
    _check_optimizer(name, sparse=False, mode="xla")


# -- what the tape records ----------------------------------------------------------


def _plain_momentum(var0: np.ndarray, accum0: np.ndarray, lr: float, steps: int = 2) -> float:
    var, accum = tf.Variable(var0), tf.Variable(accum0, trainable=False)
    for _ in range(steps):
        tf.raw_ops.ResourceApplyMomentum(var=var.handle, accum=accum.handle, lr=lr, grad=tf.sin(var), momentum=0.9)
    return float(tf.reduce_sum(var**3) + tf.reduce_sum(accum**2))


VAR0, ACCUM0 = np.array([0.5, -1.0, 2.0]), np.array([0.3, 0.1, -0.2])


def test_slots_the_tape_never_read_get_versions_and_watched_ones_a_gradient():
    var, accum = tf.Variable(VAR0), tf.Variable(ACCUM0, trainable=False, name="accum")
    lr = tf.Variable(0.1, dtype=F64)
    with AssignAwareTape(persistent=True) as tape:
        for _ in range(2):
            tf.raw_ops.ResourceApplyMomentum(
                var=var.handle, accum=accum.handle, lr=lr * 1.0, grad=tf.sin(var), momentum=0.9
            )
        loss = tf.reduce_sum(var**3) + tf.reduce_sum(accum**2)
    assert len(tape.versions(var)) == len(tape.versions(accum)) == 3
    # A non-trainable slot's start value is not watched unless asked, as with
    # tf.GradientTape; its later versions carry the gradient between steps.
    assert tape.gradient(loss, accum) is None
    d_lr, d_var = tape.gradient(loss, [lr, var])
    eps = 1e-6
    np.testing.assert_allclose(
        float(d_lr),
        (_plain_momentum(VAR0, ACCUM0, 0.1 + eps) - _plain_momentum(VAR0, ACCUM0, 0.1 - eps)) / (2 * eps),
        rtol=1e-6,
    )
    direction = np.array([0.3, -0.7, 0.2])
    fd = (
        _plain_momentum(VAR0 + eps * direction, ACCUM0, 0.1) - _plain_momentum(VAR0 - eps * direction, ACCUM0, 0.1)
    ) / (2 * eps)
    np.testing.assert_allclose(float(np.sum(d_var.numpy() * direction)), fd, rtol=1e-6)

    var, accum = tf.Variable(VAR0), tf.Variable(ACCUM0, trainable=False)
    with AssignAwareTape() as tape:
        tape.watch(accum)
        for _ in range(2):
            tf.raw_ops.ResourceApplyMomentum(var=var.handle, accum=accum.handle, lr=0.1, grad=tf.sin(var), momentum=0.9)
        loss = tf.reduce_sum(var**3) + tf.reduce_sum(accum**2)
    d_accum = tape.gradient(loss, accum)
    fd = (
        _plain_momentum(VAR0, ACCUM0 + eps * direction, 0.1) - _plain_momentum(VAR0, ACCUM0 - eps * direction, 0.1)
    ) / (2 * eps)
    np.testing.assert_allclose(float(np.sum(d_accum.numpy() * direction)), fd, rtol=1e-6)


def _plain_adam(lr: float) -> float:
    var, m, v = tf.Variable(VAR0), tf.Variable(ACCUM0), tf.Variable(np.abs(ACCUM0))
    _adam_step(var.handle, m.handle, v.handle, tf.constant(lr, F64), tf.sin(var))
    return float(tf.reduce_sum(var**3) + tf.reduce_sum(v) + tf.reduce_sum(m))


def _adam_step(var: Any, m: Any, v: Any, lr: Any, grad: Any) -> None:
    c = lambda x: tf.constant(x, F64)  # noqa: E731
    tf.raw_ops.ResourceApplyAdam(
        var=var,
        m=m,
        v=v,
        beta1_power=c(0.81),
        beta2_power=c(0.9),
        lr=lr,
        beta1=c(0.9),
        beta2=c(0.95),
        epsilon=c(0.01),
        grad=grad,
    )


def test_a_slot_given_by_a_handle_taken_before_the_tape_gets_a_version():
    # The library knows the variables created once it is installed by their
    # handles (README, "Known limits"): the slot is a version like the others.
    with AssignAwareTape():
        pass
    var, m, v = tf.Variable(VAR0), tf.Variable(ACCUM0, name="m"), tf.Variable(np.abs(ACCUM0))
    m_handle = m.handle
    lr = tf.Variable(0.1, dtype=F64)
    with AssignAwareTape() as tape:
        _adam_step(var.handle, m_handle, v.handle, lr * 1.0, tf.sin(var))
        loss = tf.reduce_sum(var**3) + tf.reduce_sum(v) + tf.reduce_sum(m)
    assert len(tape.versions(var)) == len(tape.versions(v)) == len(tape.versions(m)) == 2
    assert not np.allclose(m.numpy(), ACCUM0)  # the kernel wrote it all the same
    eps = 1e-6
    fd = (_plain_adam(0.1 + eps) - _plain_adam(0.1 - eps)) / (2 * eps)
    np.testing.assert_allclose(float(tape.gradient(loss, lr)), fd, rtol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_duplicate_indices_are_refused_before_the_kernel_runs(mode):
    start = np.arange(6.0).reshape(3, 2)
    var, accum = tf.Variable(start, name="embedding"), tf.Variable(np.ones((3, 2)))

    def body() -> None:
        with AssignAwareTape():
            _ = var * 1.0
            tf.raw_ops.ResourceSparseApplyAdagrad(
                var=var.handle,
                accum=accum.handle,
                lr=tf.constant(0.1, F64),
                grad=tf.ones([2, 2], F64),
                indices=tf.constant([1, 1]),
            )

    if mode == "eager":
        with pytest.raises(DuplicateIndicesError, match="ResourceSparseApplyAdagrad.*'embedding") as info:
            body()
        assert "unsorted_segment_sum" in str(info.value)
    else:
        with pytest.raises(tf.errors.InvalidArgumentError, match="duplicate indices"):
            tf.function(body)()
    np.testing.assert_array_equal(var.numpy(), start)
    np.testing.assert_array_equal(accum.numpy(), np.ones((3, 2)))


def _momentum_in_control_flow(where: str, var0: np.ndarray, lr0: float, tape: bool) -> Any:
    """Two tf_keras momentum steps (ResourceApplyKerasMomentum) inside a
    tf.cond branch or a graph loop of a tf.function; the loss; with ``tape``,
    its gradients w.r.t. the learning rate and the initial weights."""
    var, lr = tf.Variable(var0, name="in_body"), tf.Variable(lr0, dtype=F64)
    opt = K2.SGD(lambda: lr, momentum=0.9)
    opt._create_all_weights([var])

    def step() -> None:
        opt.apply_gradients([(tf.sin(var) * var, var)])

    @tf.function
    def run(flag: Any) -> Any:
        with AssignAwareTape() as outer:
            if where == "cond":
                tf.cond(flag, lambda: (step(), step(), tf.constant(0.0))[2], lambda: tf.constant(0.0))
            else:
                tf.while_loop(lambda i: i < 2, lambda i: (step(), i + 1)[1], [tf.constant(0)])
            loss = tf.reduce_sum(var**3)
        return (loss, outer.gradient(loss, [lr, var])) if tape else loss

    return run(tf.constant(True))


@pytest.mark.parametrize("where", ["cond", "while_loop"])
def test_an_optimizer_step_in_control_flow(where):
    loss, (d_lr, d_w) = _momentum_in_control_flow(where, VAR0, 0.1, tape=True)
    plain = lambda w, lr: float(_momentum_in_control_flow(where, w, lr, tape=False))  # noqa: E731
    eps, direction = 1e-6, np.array([0.3, -0.7, 0.5])
    np.testing.assert_allclose(float(loss), plain(VAR0, 0.1), rtol=1e-12)
    fd_lr = (plain(VAR0, 0.1 + eps) - plain(VAR0, 0.1 - eps)) / (2 * eps)
    fd_w = (plain(VAR0 + eps * direction, 0.1) - plain(VAR0 - eps * direction, 0.1)) / (2 * eps)
    assert abs(fd_lr) > 1e-2 and abs(fd_w) > 1e-2
    np.testing.assert_allclose(float(d_lr), fd_lr, rtol=1e-6)
    np.testing.assert_allclose(float(np.sum(d_w.numpy() * direction)), fd_w, rtol=1e-6)


def test_under_stop_recording_every_written_variable_gets_a_version_without_a_gradient_path():
    var, accum = tf.Variable(VAR0, name="var"), tf.Variable(ACCUM0, name="accum")
    lr = tf.Variable(0.1, dtype=F64)
    with AssignAwareTape() as tape:
        lr_t = lr * 1.0
        with tape.stop_recording():
            tf.raw_ops.ResourceApplyMomentum(
                var=var.handle, accum=accum.handle, lr=lr_t, grad=tf.sin(var), momentum=0.9
            )
        loss = tf.reduce_sum(var) + tf.reduce_sum(accum)
    history = tape.history()
    for name in ("var:0", "accum:0"):
        assert [(r.op, r.recorded) for r in history.variables[name]] == [(None, True), ("ResourceApplyMomentum", False)]
    assert tape.gradient(loss, [lr, var, accum]) == [None, None, None]


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_second_order_through_a_fused_kernel(mode):
    # d2 val / d lr2 through two Adam steps, nested tapes.
    def body() -> Tuple[Any, Any]:
        var, m, v = variables
        with AssignAwareTape() as outer:
            with AssignAwareTape() as inner:
                for _ in range(2):
                    _adam_step(var.handle, m.handle, v.handle, lr * 1.0, tf.sin(var))
                val = tf.reduce_sum(var**3) + tf.reduce_sum(v)
            d1 = inner.gradient(val, lr)
        return d1, outer.gradient(d1, lr)

    def plain(lr_value: float) -> float:
        var, m, v = tf.Variable(VAR0), tf.Variable(ACCUM0), tf.Variable(np.abs(ACCUM0))
        for _ in range(2):
            _adam_step(var.handle, m.handle, v.handle, tf.constant(lr_value, F64), tf.sin(var))
        return float(tf.reduce_sum(var**3) + tf.reduce_sum(v))

    variables = (tf.Variable(VAR0), tf.Variable(ACCUM0), tf.Variable(np.abs(ACCUM0)))
    lr = tf.Variable(0.1, dtype=F64)
    d1, d2 = body() if mode == "eager" else tf.function(body)()
    eps = 1e-4
    np.testing.assert_allclose(float(d1), (plain(0.1 + eps) - plain(0.1 - eps)) / (2 * eps), rtol=1e-6)
    np.testing.assert_allclose(float(d2), (plain(0.1 + eps) - 2 * plain(0.1) + plain(0.1 - eps)) / eps**2, rtol=1e-4)
    assert abs(float(d2)) > 1e-2


def test_a_function_running_a_kernel_called_from_an_eager_tape_is_still_refused():
    # Its writes happen inside its graph, out of the eager tape's sight.
    var = tf.Variable(VAR0, name="written_in_function")

    @tf.function
    def step() -> None:
        tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=tf.constant(0.1, F64), delta=tf.sin(var))

    with AssignAwareTape():
        _ = var * 1.0
        with pytest.raises(UntrackedWriteError, match="written_in_function.*ResourceApplyGradientDescent"):
            step()
    np.testing.assert_array_equal(var.numpy(), VAR0)


ALIASED_WRITES = {
    # tf.compat.v1 Adam's sparse step writes its slots through this one.
    "resource_variable_ops.resource_scatter_add": lambda v, u: resource_variable_ops.resource_scatter_add(
        v.handle, [0, 2], u
    ),
    "resource_variable_ops.assign_variable_op": lambda v, u: resource_variable_ops.assign_variable_op(
        v.handle, tf.tensor_scatter_nd_add(tf.zeros([3], F64), [[0], [2]], u)
    ),
    "state_ops.resource_scatter_nd_add": lambda v, u: state_ops.resource_scatter_nd_add(v.handle, [[0], [2]], u),
}


@pytest.mark.parametrize("name", sorted(ALIASED_WRITES))
def test_writes_through_tensorflows_reexported_wrappers_are_tracked(name):
    # Modules that star-import the generated wrappers hold them under their own
    # names; a write through one must make a version like any other.
    v, a = tf.Variable([1.0, 2.0, 3.0], dtype=F64), tf.Variable(2.0, dtype=F64)
    with AssignAwareTape() as tape:
        ALIASED_WRITES[name](v, tf.stack([a, a**2]))
        loss = tf.reduce_sum(v * v)
    assert len(tape.versions(v)) == 2
    # d/da of sum(v * v) with v[0] and v[2] raised by (a, a^2) (or set to them).
    expected = 2 * (a + 1.0) + 2 * (a**2 + 3.0) * 2 * a if "assign_variable_op" not in name else 2 * a + 4 * a**3
    np.testing.assert_allclose(float(tape.gradient(loss, a)), float(expected))
