"""Tapes opened inside a ``tf.cond`` branch or a graph loop body of a compiled
program whose own ``AssignAwareTape`` is open: the inner tape's gradient
through writes in the body, and the outer tape's gradient through it, equal
the functional rewrite's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from assigntape import AssignAwareTape

INNER = {"plain": tf.GradientTape, "aware": AssignAwareTape}


def _inner_step(w: Any, x: Any, inner_cls: Any) -> Any:
    with inner_cls() as inner:
        w.assign(x * x + w * 0.5)
        y = w * 2.0 + tf.sin(x)
    return inner.gradient(y, x)


@pytest.mark.parametrize("inner", sorted(INNER))
@pytest.mark.parametrize("where", ["cond", "loop"])
def test_a_tape_inside_a_body_and_the_outer_tape_through_it(where, inner):
    w, x = tf.Variable(0.25, dtype=tf.float64), tf.Variable(1.5, dtype=tf.float64)

    @tf.function
    def program() -> Any:
        w.assign(0.25)
        with AssignAwareTape() as outer:
            if where == "cond":
                g = tf.cond(x > 0, lambda: _inner_step(w, x, INNER[inner]), lambda: tf.constant(0.0, tf.float64))
            else:
                g = tf.constant(0.0, tf.float64)
                for _ in tf.range(2):
                    g += _inner_step(w, x, INNER[inner])
            target = w * g
        return g, outer.gradient(target, x)

    g, d_outer = program()

    # The rewrite: w <- x^2 + w/2 per step; the inner gradient is d(2w + sin x)/dx
    # with the step's w as a function of x (a plain tape inside the body sees the
    # write as the AssignAwareTape does: Semantics, 6).
    def rewrite(x: Any) -> Any:
        value = tf.constant(0.25, tf.float64)
        total = tf.constant(0.0, tf.float64)
        for _ in range(1 if where == "cond" else 2):
            with tf.GradientTape() as inner_tape:
                inner_tape.watch(x)
                value = x * x + value * 0.5
                y = value * 2.0 + tf.sin(x)
            total += inner_tape.gradient(y, x)
        return total, value * total

    x0 = tf.constant(1.5, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(x0)
        g_ref, target_ref = rewrite(x0)
    np.testing.assert_allclose(float(g), float(g_ref), rtol=1e-12)
    np.testing.assert_allclose(float(d_outer), float(tape.gradient(target_ref, x0)), rtol=1e-12)


@pytest.mark.parametrize("where", ["cond", "loop"])
def test_an_aware_tape_inside_a_body_names_versions_as_anywhere(where):
    # A variable target is its latest version; a variable source its value when
    # the inner tape was entered (after the earlier iteration's write).
    w, x = tf.Variable(0.25, dtype=tf.float64), tf.Variable(1.5, dtype=tf.float64)

    def step() -> Any:
        with AssignAwareTape() as inner:
            w.assign(x * w + x)
            w.assign_add(w * w)
        return tf.stack(inner.gradient(w, [x, w]))

    @tf.function
    def program() -> Any:
        w.assign(0.25)
        with AssignAwareTape():
            if where == "cond":
                return tf.cond(x > 0, step, lambda: tf.zeros(2, tf.float64))
            total = tf.zeros(2, tf.float64)
            for _ in tf.range(2):
                total += step()
            return total

    def rewrite(w0: float) -> Any:
        xs, ws = tf.constant(1.5, tf.float64), tf.constant(w0, tf.float64)
        with tf.GradientTape() as tape:
            tape.watch([xs, ws])
            u = xs * ws + xs
            u = u + u * u
        return u, np.array([float(g) for g in tape.gradient(u, [xs, ws])])

    first, expected = rewrite(0.25)
    if where == "loop":
        expected = expected + rewrite(float(first))[1]
    np.testing.assert_allclose(program().numpy(), expected, rtol=1e-12)


def test_hmc_through_a_layer_that_writes_its_weight_matches_the_functional_chain():
    # tensorflow#54532: a Keras layer's call assigns its weight from the input
    # and returns a log-probability; TensorFlow Probability's HMC differentiates
    # it with its own tape (eagerly) or tf.gradients (in a graph) inside its
    # while loop. With an AssignAwareTape open, the chain must be the chain of
    # the same log-probability written without the variable.
    import keras
    import tensorflow_probability as tfp

    mean, scale = tf.constant([1.0, -2.0]), tf.constant([0.5, 2.0])

    class Posterior(keras.layers.Layer):
        def build(self, shape: Any) -> None:
            self.w = self.add_weight(shape=(2,), initializer="zeros", name="w")

        def call(self, state: Any) -> Any:
            self.w.assign(state)
            return -0.5 * tf.reduce_sum((self.w - mean) ** 2 / scale)

    layer = Posterior()
    layer.build((2,))

    def chain(log_prob: Any, tape: bool) -> Any:
        kernel = tfp.mcmc.HamiltonianMonteCarlo(log_prob, step_size=0.3, num_leapfrog_steps=3)

        def sample() -> Any:
            return tfp.mcmc.sample_chain(6, tf.constant([0.0, 0.0]), kernel=kernel, trace_fn=None, seed=(4, 2))

        if not tape:
            return sample()
        with AssignAwareTape():
            return sample()

    expected = chain(lambda s: -0.5 * tf.reduce_sum((s - mean) ** 2 / scale), tape=False).numpy()
    assert np.ptp(expected, axis=0).min() > 0.0  # the chain moves
    np.testing.assert_array_equal(chain(layer, tape=True).numpy(), expected)
    np.testing.assert_array_equal(tf.function(lambda: chain(layer, tape=True))().numpy(), expected)
