"""``tape.restoring(variables)``: the variables get their entry values back, as a
tracked write, so later gradients still reach the start-of-tape versions."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import tensorflow as tf
from oracle import modes, run

import assigntape._tape
from assigntape import AssignAwareTape, NotAVariableError


@modes
def test_tasks_adapt_from_the_same_start(mode):
    w, x = tf.Variable([1.0, -2.0]), tf.Variable(0.5)

    def body():
        w.assign([1.0, -2.0])
        with AssignAwareTape() as tape:
            losses = []
            for scale in (1.0, 3.0):
                with tape.restoring([w]):
                    w.assign_sub(0.1 * scale * w * x)
                    losses.append(tf.reduce_sum(w * w))
            loss = losses[0] + losses[1]
        return tape.gradient(loss, [w, x]), w.read_value()

    (d_w, d_x), after = run(mode, body)
    np.testing.assert_array_equal(np.asarray(after), [1.0, -2.0])
    # Rewrite: w_k = (1 - 0.1 s_k x) w0, loss = sum_k (1 - 0.1 s_k x)^2 |w0|^2.
    w0, x0 = np.array([1.0, -2.0]), 0.5
    factors = [1 - 0.1 * s * x0 for s in (1.0, 3.0)]
    np.testing.assert_allclose(d_w, 2 * sum(f * f for f in factors) * w0, rtol=1e-6)
    expected_dx = sum(2 * f * (-0.1 * s) * np.sum(w0 * w0) for f, s in zip(factors, (1.0, 3.0)))
    np.testing.assert_allclose(float(d_x), expected_dx, rtol=1e-6)


def test_restores_on_an_exception_too():
    w = tf.Variable(2.0)
    with AssignAwareTape() as tape:
        with pytest.raises(ZeroDivisionError):
            with tape.restoring([w]):
                w.assign(5.0)
                1 / 0
        assert float(w) == 2.0
        loss = w * 3.0
    assert float(tape.gradient(loss, w)) == 3.0  # the restore carries the gradient back


def test_keras_variables_and_nested_structures():
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    start = [v.numpy() for v in model.weights]
    with AssignAwareTape() as tape:
        with tape.restoring({"model": model.trainable_variables}):
            for v in model.trainable_variables:
                v.assign(v * 0.0)
    for v, v0 in zip(model.weights, start):
        np.testing.assert_array_equal(v.numpy(), v0)
    assert len(tape.versions(model.trainable_variables[0])) == 3  # the write, then the restore


def test_rejects_tensors():
    with AssignAwareTape() as tape:
        with pytest.raises(NotAVariableError, match="restoring"):
            with tape.restoring([tf.constant(1.0)]):
                pass


def test_docstring_examples():
    # The examples in the tape's docstrings (restoring, explain, history) hold.
    failures, tried = doctest.testmod(assigntape._tape, globs={"tf": tf, "AssignAwareTape": AssignAwareTape})
    assert tried >= 10 and failures == 0
