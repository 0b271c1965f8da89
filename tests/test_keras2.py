"""Keras 2 (tf_keras) optimizers.

The optimizers of ``tf_keras.optimizers`` update with assign ops; those of
``tf_keras.optimizers.legacy`` call fused ``ResourceApply*`` kernels, which the
tape differentiates through their rules (``assigntape/_fused.py``; every legacy
optimizer is tested in ``tests/test_fused_optimizers.py``). Both kinds of step
are differentiable.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from oracle import central_difference

from assigntape import AssignAwareTape

W0 = np.array([1.0, 2.0, -0.5])

OPTIMIZERS = {
    "sgd": lambda: tf_keras.optimizers.SGD(0.1),
    "sgd_momentum": lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: tf_keras.optimizers.Adam(0.1),
    # Fused kernels: ResourceApplyGradientDescent, ResourceApplyKerasMomentum,
    # ResourceApplyAdam.
    "legacy_sgd": lambda: tf_keras.optimizers.legacy.SGD(0.1),
    "legacy_sgd_momentum": lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9),
    "legacy_adam": lambda: tf_keras.optimizers.legacy.Adam(0.1),
}


def _build(opt, variables):
    if hasattr(opt, "build"):
        opt.build(variables)
    else:  # a legacy optimizer: its slots, iteration count and hyperparameter variables
        opt._create_all_weights(variables)


def _train(w0, make, tape_cls, lr=None):
    w = tf.Variable(w0, dtype=tf.float64)
    opt = make()
    _build(opt, [w])
    with tape_cls() as tape:
        if lr is not None:
            # tf_keras copies the learning rate into a variable of its own;
            # writing that variable from ours makes the step depend on it.
            opt.learning_rate.assign(lr)
        for _ in range(2):
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(tf.sin(w) * w)
            opt.apply_gradients([(inner.gradient(loss, w), w)])
        val = tf.reduce_sum(w * w)
    return tape, val, w


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_keras2_steps_are_differentiable_in_the_initial_weights(name):
    tape, val, w = _train(W0, OPTIMIZERS[name], AssignAwareTape)
    grad = tape.gradient(val, w).numpy()
    direction = np.array([0.3, -1.0, 0.8])
    fd = central_difference(
        lambda p: float(_train(p[0], OPTIMIZERS[name], tf.GradientTape)[1]), [W0], [direction], eps=1e-6
    )
    np.testing.assert_allclose(grad @ direction, fd, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_keras2_learning_rate_hypergradient(name):
    lr = tf.Variable(0.05)
    tape, val, _ = _train(W0, OPTIMIZERS[name], AssignAwareTape, lr=lr)
    d_lr = tape.gradient(val, lr)
    assert d_lr is not None
    # The learning-rate variable of tf_keras is float32: a wider step.
    fd = central_difference(
        lambda p: float(_train(W0, OPTIMIZERS[name], tf.GradientTape, lr=tf.constant(float(p[0]), tf.float32))[1]),
        [np.array(0.05)],
        [np.array(1.0)],
        eps=1e-3,
    )
    np.testing.assert_allclose(float(d_lr), fd, rtol=2e-3)


LEGACY = {
    "ResourceApplyGradientDescent": "legacy_sgd",
    "ResourceApplyKerasMomentum": "legacy_sgd_momentum",
    "ResourceApplyAdam": "legacy_adam",
}


@pytest.mark.parametrize("op_name", sorted(LEGACY))
def test_legacy_optimizers_step_through_their_fused_kernels(op_name):
    # The tests above differentiate what these kernels do: every step wrote the
    # weights (and each slot) through the kernel named, as new versions.
    tape, _, w = _train(W0, OPTIMIZERS[LEGACY[op_name]], AssignAwareTape)
    written = {name: [r.op for r in records] for name, records in tape.history().variables.items()}
    assert written.pop(w.name) == [None, op_name, op_name]
    # The slots: none, the momentum, and Adam's m and v.
    assert len(written) == {"ResourceApplyGradientDescent": 0, "ResourceApplyKerasMomentum": 1}.get(op_name, 2)
    assert all(ops == [None, op_name, op_name] for ops in written.values()), written
