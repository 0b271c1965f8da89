"""Second order through a ``checkpointed`` segment is refused, first order is not.

A segment's backward pass runs the step again with every recorder paused, so
a tape or accumulator recording that backward pass would not see how the
gradient depends on the segment's start: the second derivative would be
silently wrong (``None``). Every path that differentiates a gradient through
a segment's backward pass raises ``RecomputeError`` naming the step; a
first-order gradient, also one a persistent tape takes inside its own block
(which records it), is the loop's.

The step: w <- sin(w) w, twice, then loss = c(w) with c(w) = w^2 or w
(linear: the gradient flowing into the segment is then a constant, and the
refusal must still come from the segment's own outputs).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape, RecomputeError, checkpointed, unroll

W0 = 0.7


def _two_steps(w, how, step=None):
    if step is None:

        def step():
            return w.assign(tf.sin(w) * w)

    if how == "unroll":
        unroll(step, 2, checkpoint_every=2)
    else:
        wrapped = checkpointed(step) if how == "checkpointed" else step
        wrapped()
        wrapped()


def _loss(w, linear):
    return w * 1.0 if linear else w * w


@modes
@pytest.mark.parametrize("how", ["checkpointed", "unroll"])
@pytest.mark.parametrize("linear", [False, True], ids=["square", "linear"])
def test_tape_gradient_of_a_gradient_through_a_segment_is_refused(mode, how, linear):
    w = tf.Variable(W0, dtype=tf.float64)

    def program():
        with AssignAwareTape() as outer:
            with AssignAwareTape() as tape:
                _two_steps(w, how)
                loss = _loss(w, linear)
            g = tape.gradient(loss, w)
        return outer.gradient(g, w)

    with pytest.raises(RecomputeError, match=rf"{how}\(step\).*second-order"):
        run(mode, program)


def test_the_loop_second_derivative_is_not_none():
    """(The loop's second derivative, against central differences of its
    gradient: what the refusal stands in for, nonzero and not None.)"""

    def gradient(w0):
        w = tf.Variable(w0, dtype=tf.float64)
        with AssignAwareTape() as tape:
            _two_steps(w, "loop")
            loss = _loss(w, False)
        return float(tape.gradient(loss, w))

    w = tf.Variable(W0, dtype=tf.float64)
    with AssignAwareTape() as outer:
        with AssignAwareTape() as tape:
            _two_steps(w, "loop")
            loss = _loss(w, False)
        g = tape.gradient(loss, w)
    second = outer.gradient(g, w)
    h = 1e-5
    expected = (gradient(W0 + h) - gradient(W0 - h)) / (2 * h)
    np.testing.assert_allclose(float(second), expected, rtol=1e-6)


@modes
def test_jacobian_of_a_gradient_through_a_segment_is_refused(mode):
    w = tf.Variable([0.7, -0.4], dtype=tf.float64)

    def program():
        with AssignAwareTape(persistent=True) as outer:
            with AssignAwareTape() as tape:
                _two_steps(w, "checkpointed")
                loss = tf.reduce_sum(w * w)
            g = tape.gradient(loss, w)
        return outer.jacobian(g, w, experimental_use_pfor=mode == "eager")

    with pytest.raises(RecomputeError, match="second-order"):
        run(mode, program)


@modes
def test_forward_over_reverse_through_a_segment_is_refused(mode):
    """A ForwardAccumulator around the gradient's computation (one around
    the segment's call is refused there, test_checkpointed): the tangent of
    the gradient of sum(w x) with respect to w along x, d/dx (J^T x) v =
    J^T v, would pass through the segment's backward pass."""
    w = tf.Variable([0.7, -0.4], dtype=tf.float64)

    def program():
        x = tf.constant([1.5, 2.0], tf.float64) * 1.0  # (made here: in a function, not a capture)
        with AssignAwareTape() as tape:
            _two_steps(w, "checkpointed")
            loss = tf.reduce_sum(w * x)
        # (the backward pass of w * x multiplies by x: its tangent flows in)
        with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)) as acc:
            g = tape.gradient(loss, w)
        return acc.jvp(g)

    with pytest.raises(RecomputeError, match="second-order"):
        run(mode, program)


@modes
@pytest.mark.parametrize("how", ["checkpointed", "unroll"])
def test_first_order_gradients_with_a_tape_recording_the_backward_pass_are_the_loops(mode, how):
    """A persistent tape's gradient inside its own block (which records it),
    then another of its gradients; an outer tape's first-order gradient of
    the loss: each the loop's."""

    def program(how):
        w.assign(W0)
        with AssignAwareTape() as outer:
            with AssignAwareTape(persistent=True) as tape:
                _two_steps(w, how)
                loss = _loss(w, False)
                inside = tape.gradient(loss, w)
                cube = loss * w
            again = tape.gradient(cube, w)
        return inside, again, outer.gradient(cube, w)

    w = tf.Variable(W0, dtype=tf.float64)
    expected = run(mode, lambda: program("loop"))
    assert_grads_close(run(mode, lambda: program(how)), expected, rtol=1e-10)


def _lr_program(how, linear):
    """A tf.function: two steps w <- w - lr sin(w) x from w0 = [0.7, -0.4]
    (``lr`` read, never written: ``tf.gradients`` may take it as a source
    after the tape), the loss, the tape's gradient with respect to lr and
    tf.gradients of that gradient with respect to lr."""
    w = tf.Variable([W0, -0.4], dtype=tf.float64)
    lr = tf.Variable(0.3, dtype=tf.float64)
    x = tf.constant([0.5, -1.5], tf.float64)

    def step():
        return w.assign(w - lr * tf.sin(w) * x)

    @tf.function
    def program(lr0):
        w.assign([W0, -0.4])
        lr.assign(lr0)
        with AssignAwareTape() as tape:
            _two_steps(w, how, step)
            loss = tf.reduce_sum(w if linear else w * w)
        g = tape.gradient(loss, lr)
        return g, tf.gradients(g, lr)[0]

    return program


@pytest.mark.parametrize("how", ["checkpointed", "unroll"])
@pytest.mark.parametrize("linear", [False, True], ids=["square", "linear"])
def test_tf_gradients_of_a_gradient_through_a_segment_is_refused(how, linear):
    """``tf.gradients`` (symbolic: no tape or accumulator records) of a
    tape's gradient inside a tf.function: the same refusal (it was silently
    the derivative of the backward pass without the re-run's dependence)."""
    program = _lr_program(how, linear)
    with pytest.raises(RecomputeError, match=rf"{how}\(step\).*second-order"):
        program(tf.constant(0.3, tf.float64))


@pytest.mark.parametrize("linear", [False, True], ids=["square", "linear"])
def test_the_loop_tf_gradients_second_derivative(linear):
    """(What the refusal stands in for: the loop's second derivative by
    tf.gradients, nonzero, against central differences of its gradient.)"""
    program = _lr_program("loop", linear)
    h = 1e-5
    up, down = (float(program(tf.constant(0.3 + d, tf.float64))[0]) for d in (h, -h))
    second = float(program(tf.constant(0.3, tf.float64))[1])
    assert abs(second) > 1e-3
    np.testing.assert_allclose(second, (up - down) / (2 * h), rtol=1e-6)


@pytest.mark.parametrize("how", ["checkpointed", "unroll"])
def test_first_order_gradients_in_a_function_are_the_loops(how):
    """First order in a tf.function (where the guard is now always built):
    the tape's gradients with respect to lr and w0 are the loop's."""
    w = tf.Variable(W0, dtype=tf.float64)

    @tf.function
    def program(how):
        w.assign(W0)
        with AssignAwareTape() as tape:
            _two_steps(w, how)
            loss = _loss(w, False)
        return tape.gradient(loss, w), loss

    assert_grads_close(program(how), program("loop"), rtol=1e-10)
