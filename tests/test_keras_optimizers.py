"""Hypergradients through Keras 3 optimizer steps taken inside the tape.

Each case trains a small Keras model for two steps with ``apply_gradients``
inside an ``AssignAwareTape`` and differentiates the validation loss after
them with respect to the learning rate (a ``tf.Variable`` behind a callable)
and the initial weights. The oracles: the same two steps written out as tensor
updates under ``tf.GradientTape`` (the formulas of Keras 3's optimizers), and
central differences of the real Keras program in float64.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, central_difference, modes, run

from assigntape import AssignAwareTape

DTYPE = "float64"
STEPS = 2
X = np.linspace(-1.0, 1.0, 24).reshape(8, 3)
Y = np.sin(X.sum(axis=1, keepdims=True))
XV, YV = X[::-1] * 0.5, Y[::-1]


def _make_optimizer(name, lr_var):
    lr = lambda: lr_var  # noqa: E731  Keras 3 rejects a tf.Variable learning rate
    return {
        "sgd": lambda: keras.optimizers.SGD(learning_rate=lr),
        "sgd_momentum": lambda: keras.optimizers.SGD(learning_rate=lr, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(learning_rate=lr),
        "rmsprop": lambda: keras.optimizers.RMSprop(learning_rate=lr),
    }[name]()


def _forward(params, x):
    w1, b1, w2, b2 = params
    return tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2) + b2


def _mse(pred, y):
    return tf.reduce_mean((pred - y) ** 2)


def _initial_params():
    rng = np.random.default_rng(7)
    return [rng.normal(size=(3, 4)) * 0.5, rng.normal(size=(4,)) * 0.1, rng.normal(size=(4, 1)) * 0.5, np.zeros((1,))]


def _keras_setup(name, lr0):
    model = keras.Sequential(
        [
            keras.Input((3,), dtype=DTYPE),
            keras.layers.Dense(4, activation="tanh", dtype=DTYPE),
            keras.layers.Dense(1, dtype=DTYPE),
        ]
    )
    model.set_weights(_initial_params())
    lr_var = tf.Variable(lr0, dtype=DTYPE)
    opt = _make_optimizer(name, lr_var)
    opt.build(model.trainable_variables)
    return model, lr_var, opt


def _train_and_validate(model, opt, tape_cls, data=(X, Y, XV, YV), sparse=False):
    """STEPS optimizer steps inside ``tape_cls``, then the validation loss."""
    x, y, xv, yv = data
    with tape_cls() as outer:
        for _ in range(STEPS):
            with tf.GradientTape() as inner:
                loss = _mse(model(x), y)
            grads = inner.gradient(loss, model.trainable_variables)
            assert isinstance(grads[0], tf.IndexedSlices) == sparse
            opt.apply_gradients(zip(grads, model.trainable_variables))
        val = _mse(model(xv), yv)
    return outer, val


_F32 = lambda x: float(np.float32(x))  # noqa: E731


def _functional(name, params, lr):
    """The same STEPS updates, as tensors, following Keras 3's update_step.

    Keras casts some hyperparameters through float32 (``ops.cast(0.9, float64)``
    converts 0.9 to float32 first); the rewrite does the same.
    """
    slots = [[tf.zeros_like(p), tf.zeros_like(p)] for p in params]
    for step in range(1, STEPS + 1):
        with tf.GradientTape() as inner:
            inner.watch(params)
            loss = _mse(_forward(params, X), Y)
        grads = inner.gradient(loss, params)
        new = []
        for p, g, s in zip(params, grads, slots):
            if name == "sgd":
                p = p - lr * g
            elif name == "sgd_momentum":
                s[0] = s[0] * _F32(0.9) - g * lr
                p = p + s[0]
            elif name == "adam":
                b1p, b2p = _F32(0.9) ** step, _F32(0.999) ** step
                alpha = lr * tf.sqrt(1 - tf.constant(b2p, DTYPE)) / (1 - b1p)
                s[0] = s[0] + (g - s[0]) * (1 - 0.9)
                s[1] = s[1] + (g * g - s[1]) * (1 - 0.999)
                p = p - s[0] * alpha / (tf.sqrt(s[1]) + 1e-7)
            elif name == "rmsprop":
                s[1] = 0.9 * s[1] + (1 - 0.9) * g * g
                p = p - lr * g / tf.sqrt(s[1] + 1e-7)
            new.append(p)
        params = new
    return _mse(_forward(params, XV), YV)


OPTIMIZERS = ["sgd", "sgd_momentum", "adam", "rmsprop"]
LR0 = {"sgd": 0.3, "sgd_momentum": 0.1, "adam": 0.05, "rmsprop": 0.01}


@modes
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_hypergradient_matches_functional_update(mode, name):
    model, lr_var, opt = _keras_setup(name, LR0[name])

    def body():
        tape, val = _train_and_validate(model, opt, AssignAwareTape)
        return val, tape.gradient(val, [lr_var] + list(model.trainable_variables))

    val, grads = run(mode, body)
    params0 = [tf.constant(p) for p in _initial_params()]
    lr0 = tf.constant(LR0[name], DTYPE)
    with tf.GradientTape() as oracle:
        oracle.watch([lr0] + params0)
        expected_val = _functional(name, params0, lr0)
    expected = oracle.gradient(expected_val, [lr0] + params0)
    np.testing.assert_allclose(float(val), float(expected_val), rtol=1e-10)
    assert_grads_close(grads, expected, rtol=1e-7, atol=1e-10)
    assert abs(float(grads[0])) > 1e-6  # the learning rate really matters here


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_hypergradient_matches_finite_differences(name):
    def val_at(lr_and_first_kernel):
        lr, k = lr_and_first_kernel
        m, lv, o = _keras_setup(name, float(lr))
        weights = m.get_weights()
        weights[0] = k
        m.set_weights(weights)
        _, val = _train_and_validate(m, o, tf.GradientTape)
        return float(val)

    model, lr_var, opt = _keras_setup(name, LR0[name])
    tape, val = _train_and_validate(model, opt, AssignAwareTape)
    d_lr, d_kernel = tape.gradient(val, [lr_var, model.trainable_variables[0]])
    point = [np.array(LR0[name]), _initial_params()[0]]
    rng = np.random.default_rng(3)
    for _ in range(2):
        direction = [np.array(rng.normal()), rng.normal(size=(3, 4))]
        fd = central_difference(val_at, point, direction, eps=1e-6)
        analytic = float(d_lr) * float(direction[0]) + float(np.sum(d_kernel.numpy() * direction[1]))
        np.testing.assert_allclose(analytic, fd, rtol=1e-5, atol=1e-9)


def test_plain_tape_gives_no_hypergradient():
    model, lr_var, opt = _keras_setup("sgd", 0.3)
    tape, val = _train_and_validate(model, opt, tf.GradientTape)
    assert tape.gradient(val, lr_var) is None


IDS = np.array([[0, 3, 3], [5, 1, 3], [2, 2, 0]])
TARGETS = np.linspace(-1.0, 1.0, 3).reshape(3, 1)


def _embedding_setup(name, lr0):
    emb = keras.layers.Embedding(6, 2, dtype=DTYPE)
    head = keras.layers.Dense(1, dtype=DTYPE)
    model = keras.Sequential(
        [keras.Input((3,), dtype="int32"), emb, keras.layers.GlobalAveragePooling1D(dtype=DTYPE), head]
    )
    rng = np.random.default_rng(5)
    model.set_weights([rng.normal(size=(6, 2)), rng.normal(size=(2, 1)), np.zeros(1)])
    lr_var = tf.Variable(lr0, dtype=DTYPE)
    opt = _make_optimizer(name, lr_var)
    opt.build(model.trainable_variables)
    return model, lr_var, opt


def _embedding_run(model, opt, tape_cls):
    return _train_and_validate(model, opt, tape_cls, (IDS, TARGETS, IDS[::-1], TARGETS), sparse=True)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_sparse_embedding_gradients_hypergradient_matches_finite_differences(name):
    model, lr_var, opt = _embedding_setup(name, LR0[name])
    tape, val = _embedding_run(model, opt, AssignAwareTape)
    d_lr = tape.gradient(val, lr_var)
    assert d_lr is not None

    def val_at(point):
        m, _, o = _embedding_setup(name, float(point[0]))
        return float(_embedding_run(m, o, tf.GradientTape)[1])

    fd = central_difference(val_at, [np.array(LR0[name])], [np.array(1.0)], eps=1e-6)
    np.testing.assert_allclose(float(d_lr), fd, rtol=1e-5, atol=1e-9)
    assert abs(fd) > 1e-4
