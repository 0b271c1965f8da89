"""``checkpointed`` steps and ``unroll``: the same values and gradients as the loop without them.

Each case runs K inner Keras steps (a forward pass, a plain tape's gradient,
``apply_gradients``) inside an ``AssignAwareTape`` and differentiates a
validation loss (plus the last step's returned loss) with respect to the
learning rate (a ``tf.Variable`` behind a callable) and the initial weights.
The oracle is the same loop without the wrappers under ``AssignAwareTape``;
for SGD also the assignment-free rewrite under a plain ``tf.GradientTape``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape, RecomputeError, checkpointed, unroll

RTOL = {"float32": (1e-5, 1e-6), "float64": (1e-10, 1e-12)}
X = np.linspace(-1.0, 1.0, 24).reshape(8, 3)
Y = np.sin(X.sum(axis=1, keepdims=True))
XV, YV = X[::-1] * 0.5, Y[::-1]


def _initial(bn):
    rng = np.random.default_rng(7)
    ws = [rng.normal(size=(3, 4)) * 0.5, rng.normal(size=(4,)) * 0.1]
    if bn:
        ws += [np.ones(4), np.zeros(4), np.zeros(4), np.ones(4)]
    return ws + [rng.normal(size=(4, 1)) * 0.5, np.zeros((1,))]


def _setup(opt_name, dtype, bn=False, lr0=0.05):
    layers = [keras.Input((3,), dtype=dtype), keras.layers.Dense(4, activation="tanh", dtype=dtype)]
    if bn:
        layers.append(keras.layers.BatchNormalization(dtype=dtype, momentum=0.8))
    layers.append(keras.layers.Dense(1, dtype=dtype))
    model = keras.Sequential(layers)
    model.set_weights(_initial(bn))
    lr_var = tf.Variable(lr0, dtype=dtype)
    lr = lambda: lr_var  # noqa: E731  Keras 3 rejects a tf.Variable learning rate
    opt = {
        "sgd": lambda: keras.optimizers.SGD(learning_rate=lr),
        "momentum": lambda: keras.optimizers.SGD(learning_rate=lr, momentum=0.9),
        # (epsilon 1e-3: with Keras' 1e-7, Adam's first steps divide by the
        # root of second moments near 0 and the hypergradient is so ill
        # conditioned that the same loop eager and compiled differ at 1e-6.)
        "adam": lambda: keras.optimizers.Adam(learning_rate=lr, epsilon=1e-3),
    }[opt_name]()
    opt.build(model.trainable_variables)
    return model, lr_var, opt


def _meta(opt_name, dtype, how, k, every=None, bn=False, truncate=None):
    """The program: K steps made ``how`` ("loop", "checkpointed", "unroll"),
    then the validation loss; its value, gradients and the variables after."""
    model, lr_var, opt = _setup(opt_name, dtype, bn)
    x, y = tf.constant(X, dtype), tf.constant(Y, dtype)
    xv, yv = tf.constant(XV, dtype), tf.constant(YV, dtype)
    weights = model.trainable_variables

    def step():
        with tf.GradientTape() as inner:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = inner.gradient(loss, weights)
        opt.apply_gradients(zip(grads, weights))
        return loss

    def program():
        with AssignAwareTape() as tape:
            if how == "loop":
                last = None
                if truncate is not None:
                    with tape.stop_recording():
                        for _ in range(k - truncate):
                            last = step()
                for _ in range(k if truncate is None else truncate):
                    last = step()
            elif how == "checkpointed":
                wrapped = checkpointed(step)
                for _ in range(k):
                    last = wrapped()
            else:
                last = unroll(step, k, checkpoint_every=every, truncate=truncate)
            val = tf.reduce_mean((model(xv, training=False) - yv) ** 2) + 0.1 * last
        return val, tape.gradient(val, [lr_var, *[w.value for w in weights]])

    return program, model, opt


def _compare(mode, opt_name, dtype, how, k, every=None, bn=False, truncate=None):
    program, model, opt = _meta(opt_name, dtype, "loop", k, bn=bn, truncate=truncate)
    expected = run(mode, program)
    expected_state = [v.numpy() for v in model.variables + opt.variables]
    program, model, opt = _meta(opt_name, dtype, how, k, every, bn=bn, truncate=truncate)
    actual = run(mode, program)
    rtol, atol = RTOL[dtype]
    assert_grads_close(actual, expected, rtol=rtol, atol=atol)
    for a, e in zip([v.numpy() for v in model.variables + opt.variables], expected_state):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)
    return actual


@modes
@pytest.mark.parametrize("opt_name", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_checkpointed_steps_equal_the_loop(mode, opt_name, dtype):
    _compare(mode, opt_name, dtype, "checkpointed", 3)


@modes
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_batch_normalization_moving_statistics(mode, opt_name):
    _compare(mode, opt_name, "float64", "checkpointed", 3, bn=True)
    _compare(mode, opt_name, "float64", "unroll", 7, every=3, bn=True)


@modes
@pytest.mark.parametrize(
    "opt_name, dtype, k, every",
    [
        ("sgd", "float32", 1, None),
        ("momentum", "float64", 7, 3),
        ("adam", "float32", 7, None),
        ("momentum", "float32", 64, None),
    ],
)
def test_unroll_equals_the_loop(mode, opt_name, dtype, k, every):
    _compare(mode, opt_name, dtype, "unroll", k, every)


def test_long_adam_unroll_equals_the_loop():
    """(Eagerly only: tracing 64 Adam steps twice costs a minute and a half.)"""
    _compare("eager", "adam", "float64", "unroll", 64, 5)


@modes
def test_truncated_unroll_equals_the_loop_with_early_steps_stopped(mode):
    grads = _compare(mode, "momentum", "float64", "unroll", 9, every=2, truncate=4)
    assert grads[1][0] is not None


def test_sgd_unroll_equals_the_assignment_free_rewrite():
    """The rewrite: weights as tensors, w <- w - lr * g, under a plain tape."""
    k = 5
    program, _, _ = _meta("sgd", "float64", "unroll", k, every=2)
    actual = program()
    ws0 = [tf.constant(w) for w in _initial(False)]
    lr = tf.constant(0.05, tf.float64)
    x, y, xv, yv = (tf.constant(a, tf.float64) for a in (X, Y, XV, YV))

    def forward(ws, inp):
        return tf.matmul(tf.tanh(tf.matmul(inp, ws[0]) + ws[1]), ws[2]) + ws[3]

    with tf.GradientTape() as tape:
        tape.watch([lr, *ws0])
        ws = list(ws0)
        for _ in range(k):
            with tf.GradientTape() as inner:
                inner.watch(ws)
                loss = tf.reduce_mean((forward(ws, x) - y) ** 2)
            gs = inner.gradient(loss, ws)
            ws = [w - lr * g for w, g in zip(ws, gs)]
        val = tf.reduce_mean((forward(ws, xv) - yv) ** 2) + 0.1 * loss
    expected = (val, tape.gradient(val, [lr, *ws0]))
    assert_grads_close(actual, expected, rtol=1e-10, atol=1e-12)
