"""Forward mode through ``sqrt`` at 0 with a tangent that is exactly zero.

TensorFlow's own forward mode gives NaN there (``0 * inf``: it transposes
``SqrtGrad``), where its reverse mode gives 0 (``SqrtGrad`` maps a zero
upstream gradient to zero) and the true derivative is finite: Adam's
``sqrt(v)`` of a weight whose gradient is exactly zero (an embedding row no
batch used). Inside a tape or accumulator of ours the tangent stays zero
(README "Semantics"). Expected values come from reverse mode (TensorFlow's
own ``SqrtGrad`` under ``AssignAwareTape``), float64 central differences of
fresh runs, and hand derivation; never from forward mode itself.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import modes, run

import assigntape
from assigntape import AssignAwareTape

ACCUMULATORS = ["assigntape alone", "tf around a tape", "tf inside a tape"]


def _jvp(accumulator: str, primal: Any, body: Callable[[], Any]) -> Any:
    """The jvp of ``body()`` by ``primal`` (tangent 1) under ``accumulator``."""
    one = tf.constant(1.0, primal.dtype)
    if accumulator == "assigntape alone":
        with assigntape.ForwardAccumulator(primal, one) as acc:
            out = body()
    elif accumulator == "tf around a tape":
        with tf.autodiff.ForwardAccumulator(primal, one) as acc:
            with AssignAwareTape():
                out = body()
    else:
        with AssignAwareTape():
            with tf.autodiff.ForwardAccumulator(primal, one) as acc:
                out = body()
    return acc.jvp(out)


# -- Keras Adam with an embedding row no batch uses ---------------------------------

ROWS, DIM = 5, 3
IDS = tf.constant([[0, 2], [2, 4]])  # rows 1 and 3 are never looked up


def _adam_problem():
    keras.utils.set_random_seed(3)
    embedding = keras.layers.Embedding(ROWS, DIM, dtype="float64")
    embedding.build((None, 2))
    table0 = np.random.default_rng(3).uniform(-1.0, 1.0, (ROWS, DIM))
    lr = tf.Variable(0.05, dtype=tf.float64)
    optimizer = keras.optimizers.Adam(learning_rate=lambda: lr)
    optimizer.build(embedding.trainable_variables)
    (table,) = embedding.trainable_variables

    def reset(lr_value: float = 0.05) -> None:
        table.assign(table0)
        lr.assign(lr_value)
        for slot in optimizer.variables:
            slot.assign(tf.zeros_like(slot))

    def steps() -> Any:
        # Two inner steps; the outer loss reads every row, the unused ones too.
        for _ in range(2):
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum((embedding(IDS) - 0.5) ** 2)
            optimizer.apply_gradients([(inner.gradient(loss, table.value), table)])
        return tf.reduce_sum(tf.sin(table.value))

    return reset, steps, lr, table


@modes
@pytest.mark.parametrize("accumulator", ACCUMULATORS)
def test_forward_hypergradient_through_adam_with_an_unused_embedding_row(mode, accumulator):
    reset, steps, lr, table = _adam_problem()

    def forward() -> Any:
        reset()
        return _jvp(accumulator, lr, steps)

    def reverse() -> Any:
        reset()
        with AssignAwareTape() as tape:
            final = steps()
        return tape.gradient(final, lr)

    def final_at(lr_value: float) -> float:
        reset(lr_value)
        return float(steps())

    h = 1e-5
    difference = (final_at(0.05 + h) - final_at(0.05 - h)) / (2 * h)
    jvp, grad = run(mode, forward), run(mode, reverse)
    assert np.isfinite(float(jvp)), f"forward mode gave {float(jvp)}"
    assert abs(float(grad)) > 1e-2
    np.testing.assert_allclose(float(jvp), float(grad), rtol=1e-10)
    np.testing.assert_allclose(float(jvp), difference, rtol=1e-6)
    reset()
    assert float(steps()) == pytest.approx(final_at(0.05))


# -- the rule on sqrt itself --------------------------------------------------------


@modes
@pytest.mark.parametrize("accumulator", ACCUMULATORS)
def test_sqrt_at_zero_keeps_a_zero_tangent_zero(mode, accumulator):
    # x = [0, 0, 4], tangent dx = [0, 1, 1] (x = x0 + t * [0, 1, 1] at t = 0):
    # d sqrt(x) = [0 (no change at all), inf (sqrt(t) at t = 0+), 1 / (2 * 2)].
    x0 = tf.constant([0.0, 0.0, 4.0], tf.float64)
    t = tf.Variable(0.0, dtype=tf.float64)
    c = tf.Variable([0.0, 0.0, 0.0], dtype=tf.float64)

    def body() -> Any:
        c.assign(x0 + t * tf.constant([0.0, 1.0, 1.0], tf.float64))  # through a write too
        return tf.sqrt(c.value())

    got = run(mode, lambda: _jvp(accumulator, t, body)).numpy()
    assert got[0] == 0.0 and got[1] == np.inf and got[2] == pytest.approx(0.25, rel=1e-15)


@modes
def test_sqrt_at_zero_is_reverse_modes_transpose(mode):
    # Reverse mode (TensorFlow's SqrtGrad, under our tape) gives 0 where the
    # upstream gradient is 0: forward mode agrees element by element, also
    # for a batch of tangents through a where it is zero only in places.
    x = tf.Variable([0.0, 1.0, 0.0, 9.0], dtype=tf.float64)

    def forward() -> Any:
        with assigntape.ForwardAccumulator(x, tf.constant([0.0, 2.0, 0.0, 3.0], tf.float64)) as acc:
            y = tf.sqrt(x * 1.0)
        return acc.jvp(y)

    def reverse() -> Any:
        with AssignAwareTape() as tape:
            y = tf.sqrt(x * 1.0)
        return tape.gradient(y, x, output_gradients=tf.constant([0.0, 2.0, 0.0, 3.0], tf.float64))

    np.testing.assert_array_equal(run(mode, forward).numpy(), run(mode, reverse).numpy())
    np.testing.assert_array_equal(run(mode, forward).numpy(), [0.0, 1.0, 0.0, 0.5])  # t / (2 sqrt x)


def test_outside_every_tape_forward_mode_is_tensorflows():
    # With no tape or accumulator of ours open, TensorFlow's own answer (NaN).
    x = tf.constant(0.0, tf.float64)
    with tf.autodiff.ForwardAccumulator(x, tf.constant(0.0, tf.float64)) as acc:
        y = tf.sqrt(x)
    assert np.isnan(float(acc.jvp(y)))


def test_forward_over_reverse_through_sqrt_at_zero_is_finite():
    # y = sum(sqrt(v) * m) with v = [0, 4 s] and m = [0, s]: the zero entry
    # has a zero tangent and a zero upstream gradient (TensorFlow's SqrtGrad
    # gives 0 there). dy/ds = d/ds (2 sqrt(s) s) = 3 sqrt(s) = 3 at s = 1,
    # and its tangent d/ds 3 sqrt(s) = 1.5 / sqrt(s) = 1.5.
    v = tf.Variable([0.0, 4.0], dtype=tf.float64)
    s = tf.Variable(1.0, dtype=tf.float64)
    with tf.autodiff.ForwardAccumulator(s, tf.constant(1.0, tf.float64)) as acc:
        with AssignAwareTape() as tape:
            v.assign(v * s)
            y = tf.reduce_sum(tf.sqrt(v) * tf.stack([tf.zeros([], tf.float64), s * 1.0]))
        g = tape.gradient(y, s)
    assert float(g) == pytest.approx(3.0, rel=1e-12)
    assert float(acc.jvp(g)) == pytest.approx(1.5, rel=1e-12)


@pytest.mark.parametrize("dtype", [tf.float64, tf.complex128])
def test_away_from_zero_the_tangents_are_tensorflows(dtype):
    # Where TensorFlow's forward mode is finite, ours is the same, for sqrt and
    # for its gradient op (forward over reverse), real and complex.
    from tensorflow.python.ops import gen_math_ops

    x = tf.cast(tf.constant([1.0 + 0.5j, 2.0 - 1j, 0.3 + 0.2j]), dtype)
    t = tf.cast(tf.constant([0.3 - 0.2j, 1.0 + 1j, -0.5 + 0.1j]), dtype)
    dy = tf.cast(tf.constant([1.5 + 0.2j, -0.5j, 2.0]), dtype)
    cases = [(tf.sqrt, [x], [t]), (gen_math_ops.sqrt_grad, [tf.sqrt(x), dy], [t, t * 3.0 - 0.5])]
    for fn, primals, tangents in cases:
        with tf.autodiff.ForwardAccumulator(primals, tangents) as acc:
            tensorflows = acc.jvp(fn(*primals))
        with AssignAwareTape():
            with tf.autodiff.ForwardAccumulator(primals, tangents) as acc:
                ours = acc.jvp(fn(*primals))
        np.testing.assert_allclose(ours.numpy(), tensorflows.numpy(), rtol=1e-14)


@pytest.mark.parametrize("accumulator", ACCUMULATORS)
def test_forward_hypergradient_through_the_fused_v1_adam_with_an_unused_row(accumulator):
    # tf.compat.v1's Adam runs the fused ResourceApplyAdam kernel, whose
    # rewrite takes sqrt of the second moment as Keras' does.
    w0 = np.array([[1.0, 2.0], [3.0, 4.0], [0.5, -0.5]])
    w = tf.Variable(w0)
    lr = tf.Variable(0.05, dtype=tf.float64)
    optimizer = tf.compat.v1.train.AdamOptimizer(learning_rate=lambda: lr)

    def steps() -> Any:
        for _ in range(2):
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum((tf.gather(w, [0, 2]) - 0.5) ** 2)  # row 1 unused
            optimizer.apply_gradients([(tf.convert_to_tensor(inner.gradient(loss, w)), w)])
        return tf.reduce_sum(tf.sin(w))

    steps()  # makes the slots

    def reset(lr_value: float = 0.05) -> None:
        w.assign(w0)
        lr.assign(lr_value)
        for slot in optimizer.variables():
            name = slot.name
            slot.assign(
                tf.fill(
                    tf.shape(slot),
                    tf.constant(0.9 if "beta1" in name else 0.999 if "beta2" in name else 0.0, slot.dtype),
                )
            )

    reset()
    jvp = _jvp(accumulator, lr, steps)
    reset()
    with AssignAwareTape() as tape:
        final = steps()
    grad = tape.gradient(final, lr)
    h = 1e-5
    reset(0.05 + h)
    plus = float(steps())
    reset(0.05 - h)
    minus = float(steps())
    assert np.isfinite(float(jvp)) and abs(float(grad)) > 1e-2
    np.testing.assert_allclose(float(jvp), float(grad), rtol=1e-10)
    np.testing.assert_allclose(float(jvp), (plus - minus) / (2 * h), rtol=1e-6)
