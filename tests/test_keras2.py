"""Legacy Keras 2 (tf_keras) optimizers.

The optimizers of ``tf_keras.optimizers`` update with assign ops, so their steps
are differentiable. Those of ``tf_keras.optimizers.legacy`` call fused
``ResourceApply*`` kernels, which the tape refuses, pointing to Keras 3.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from assigntape import AssignAwareTape, UntrackedWriteError
from oracle import central_difference

W0 = np.array([1.0, 2.0, -0.5])

OPTIMIZERS = {
    "sgd": lambda: tf_keras.optimizers.SGD(0.1),
    "sgd_momentum": lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: tf_keras.optimizers.Adam(0.1),
}


def _train(w0, make, tape_cls, lr=None):
    w = tf.Variable(w0, dtype=tf.float64)
    opt = make()
    opt.build([w])
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
        [np.array(0.05)], [np.array(1.0)], eps=1e-3,
    )
    np.testing.assert_allclose(float(d_lr), fd, rtol=2e-3)


LEGACY = {
    "ResourceApplyGradientDescent": lambda: tf_keras.optimizers.legacy.SGD(0.1),
    "ResourceApplyKerasMomentum": lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9),
    "ResourceApplyAdam": lambda: tf_keras.optimizers.legacy.Adam(0.1),
}


@pytest.mark.parametrize("op_name", sorted(LEGACY))
def test_legacy_fused_optimizers_are_refused(op_name):
    w = tf.Variable([1.0, 2.0], name="dense_kernel")
    opt = LEGACY[op_name]()
    with AssignAwareTape():
        with tf.GradientTape() as inner:
            loss = tf.reduce_sum(w * w)
        grads = inner.gradient(loss, [w])
        with pytest.raises(UntrackedWriteError) as info:
            opt.apply_gradients(zip(grads, [w]))
    message = str(info.value)
    assert op_name in message and "dense_kernel" in message and "Keras 3 optimizer" in message
    np.testing.assert_array_equal(w.numpy(), [1.0, 2.0])
