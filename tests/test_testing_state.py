"""``assigntape.testing.check_gradients``: every state fn changes is put back
between runs (whatever made it and whatever its dtype), and differences that
cannot be trusted (fn not reproducible, an error bound as large as the
gradient, non-finite entries) never let a gradient pass."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from assigntape.testing import check_gradients

# Three optimizer steps on v (loss (v-1)^2 + lam v^2), then (v-2)^2: the meta
# gradient by lam.
_START = np.array([0.5, -1.0])


def _inner_loss(v, lam):
    return tf.reduce_sum((v - 1.0) ** 2) + lam * tf.reduce_sum(v**2)


def _steps(make_variable, make_optimizer, lam_value, build):
    """Fresh variables and optimizer; returns (v, lam, opt, meta)."""
    v = make_variable(_START, "v")
    lam = tf.Variable(lam_value, dtype=tf.float64, name="lam")
    opt = make_optimizer()
    if build:
        opt.build([v])

    @tf.function
    def step():
        with tf.GradientTape() as inner:
            loss = _inner_loss(v, lam)
        opt.apply_gradients(zip(inner.gradient(loss, [v]), [v]))

    def meta():
        for _ in range(3):
            step()
        return tf.reduce_sum((v - 2.0) ** 2)

    return v, lam, opt, meta


def _oracle(make_variable, make_optimizer, build, h=1e-4):
    """Central differences with a fresh optimizer for every evaluation: the
    meta gradient from the start state (plain TensorFlow, no tape)."""
    values = [float(_steps(make_variable, make_optimizer, 0.3 + s, build)[3]()) for s in (h, -h)]
    return (values[0] - values[1]) / (2 * h)


def _tf_keras():
    import tf_keras

    return (lambda value, name: tf.Variable(value, dtype=tf.float64, name=name)), (
        lambda: tf_keras.optimizers.Adam(0.1)
    )


def _keras3():
    import keras

    return (lambda value, name: keras.Variable(value, dtype="float64", name=name)), (lambda: keras.optimizers.Adam(0.1))


@pytest.mark.parametrize("library, build", [("tf_keras", True), ("keras", False)])
def test_an_optimizer_step_in_its_own_tf_function_is_put_back(library, build):
    # tf_keras, built before: the step's tf.function writes the optimizer's
    # integer `iterations`, which the tape does not version; it must be put
    # back all the same (before: left at 21, the tape's gradient taken from
    # a drifted state, 0.0585 against 0.19891, and passed). Keras 3, built
    # lazily inside the compiled step: its slots are made by the function's
    # first call (before: a ValueError putting back an empty value).
    make_variable, make_optimizer = _tf_keras() if library == "tf_keras" else _keras3()
    expected = _oracle(make_variable, make_optimizer, build=build)
    v, lam, opt, meta = _steps(make_variable, make_optimizer, 0.3, build=build)
    analytic, numeric = check_gradients(meta, [lam], compiled=True)
    np.testing.assert_allclose(analytic[0], expected, rtol=1e-6)
    np.testing.assert_allclose(numeric[0], expected, rtol=1e-6)
    assert int(opt.iterations) == 0
    np.testing.assert_array_equal(np.array(v), _START)


@pytest.mark.parametrize("compiled", [False, True])
def test_an_unreproducible_function_is_reported_not_passed(compiled):
    # fn's value drifts with a Python counter that nothing puts back: the
    # differences mean nothing. d/dw (w^2) = 2w = 3 at w = 1.5, and the
    # tape's answer there is right too: still not a pass.
    w = tf.Variable(1.5, dtype=tf.float64, name="w")
    calls = [0]

    def fn():
        calls[0] += 1
        return w**2 + 0.01 * calls[0] * w

    with pytest.raises(AssertionError, match="finite differences are unreliable here: fn.. run twice"):
        check_gradients(fn, [w], compiled=compiled)


def test_differences_with_an_error_bound_as_large_as_the_gradient_do_not_pass():
    # A staircase of step 1e-3 on a parabola: the steps of the differences
    # (1e-3, 5e-4) cross its stairs, their error bound is larger than the
    # gradient (2w = 3), and a wrong tape gradient (30 instead of 3: the
    # custom gradient) would be within it.
    w = tf.Variable(1.5 + 3e-4, dtype=tf.float64, name="w")

    @tf.custom_gradient
    def wrong_square(x):
        return x * x, lambda g: g * 20.0 * x

    def fn():
        stairs = tf.stop_gradient(tf.floor(w * 1000.0)) * 0.5
        return wrong_square(tf.convert_to_tensor(w)) + stairs

    with pytest.raises(AssertionError, match="finite differences are unreliable here: source 'w:0' at index"):
        check_gradients(fn, [w])


def test_a_non_finite_gradient_entry_fails_naming_source_and_entry():
    # d/dw (w^2) = 2w = [2, 3]; the tape gives [inf, 30] (custom gradient).
    w = tf.Variable([1.0, 1.5], dtype=tf.float64, name="w")
    c = tf.Variable([0.0, 0.0], dtype=tf.float64, name="c")

    @tf.custom_gradient
    def wrong(x):
        return x * x, lambda g: g * tf.constant([np.inf, 20.0], tf.float64) * x

    def fn():
        c.assign(wrong(tf.convert_to_tensor(w)))
        return tf.reduce_sum(c)

    with pytest.raises(AssertionError, match=r"w:0 +inf +inf +\(0,\) +inf +2 "):
        check_gradients(fn, [w])
