"""Variables made inside a compiled tape: a ``tf.function``'s first trace
makes them initialize themselves with a write in its graph (inside a
``tf.cond``), which is creation, not a write the tape differentiates. Keras
layers and optimizers built lazily inside the tape are the common case,
``fit`` with a ``train_step`` that steps an inner optimizer the usual one."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import modes, run

from assigntape import AssignAwareTape


@modes
def test_a_layer_built_inside_the_tape_gets_its_gradients(mode):
    dense = keras.layers.Dense(2, kernel_initializer="ones", bias_initializer="ones")
    x = tf.constant([[1.0, 2.0, 3.0]])

    lost = []

    def program():
        with AssignAwareTape():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(dense(x) ** 2)  # the first call builds the layer
            grads = tape.gradient(loss, dense.trainable_variables)
        # tf.function traces twice when the first trace makes variables; the
        # first trace's gradients must be there too (Keras raises on None).
        lost.append([g is None for g in grads])
        return grads

    kernel, bias = run(mode, program)
    assert not any(any(trace) for trace in lost), lost
    # loss = sum over 2 units of (x . 1 + 1)^2 = 2 * 7^2: d/dkernel = 2 * 7 * x, d/dbias = 2 * 7.
    np.testing.assert_allclose(kernel.numpy(), np.tile(14.0 * np.array([[1.0], [2.0], [3.0]]), (1, 2)))
    np.testing.assert_allclose(bias.numpy(), [14.0, 14.0])


@modes
def test_a_variable_made_inside_the_tape_is_not_a_write(mode):
    made = []

    def program():
        with AssignAwareTape() as tape:
            if not made:
                made.append(tf.Variable(3.0))
            v = made[0]
            y = v * v
        return tape.gradient(y, v), len(tape.versions(v))

    grad, versions = run(mode, program)
    assert float(grad) == 6.0 and int(versions) == 1  # no version for the initialization


@pytest.mark.parametrize("compiled", [False, True])
def test_fit_with_an_inner_optimizer_built_inside_the_tape(compiled):
    """A model whose layer and inner Keras optimizer are built in the first
    train step, inside the tape (tests/helpers/mirrored_fit.py, on one
    device): compiled fit trains as the eager one does."""
    from helpers.mirrored_fit import train

    eager = train(tf.distribute.get_strategy(), run_eagerly=True)
    got = train(tf.distribute.get_strategy(), run_eagerly=not compiled)
    assert eager["lr"] != 0.05  # the learning rate moved
    np.testing.assert_allclose(got["lr"], eager["lr"], rtol=1e-5)
    np.testing.assert_allclose(got["kernel"], eager["kernel"], rtol=1e-5)
