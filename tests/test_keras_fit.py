"""Keras ``fit`` with an AssignAwareTape in an overridden ``train_step``: a learned
soft-update coefficient ``tau``, trained through ``target.assign((1 - tau) *
target + tau * online)``. Compiled (the default) and eager runs must agree."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from assigntape import AssignAwareTape


class SoftUpdateModel(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        init = keras.initializers.GlorotUniform(seed=3)
        self.online = keras.layers.Dense(1, kernel_initializer=init)
        self.target = keras.layers.Dense(1, kernel_initializer=keras.initializers.Zeros())
        self.target.trainable = False  # written by the soft update, not the optimizer
        self.tau_logit = self.add_weight(shape=(), initializer="zeros", name="tau_logit")

    def call(self, x):
        return self.target(x) + 0.0 * self.online(x)

    def train_step(self, data):
        x, y = data
        with AssignAwareTape() as tape:
            tau = tf.sigmoid(self.tau_logit)
            for t, o in zip(self.target.weights, self.online.weights):
                t.assign((1.0 - tau) * t + tau * o)
            loss = tf.reduce_mean((self.target(x) - y) ** 2) + tf.reduce_mean((self.online(x) - y) ** 2)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss, "tau": tau}


def _fit(run_eagerly: bool):
    keras.utils.set_random_seed(0)
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(32, 2)
    y = (x @ np.array([[1.5], [-2.0]], np.float32)) + 0.3
    model = SoftUpdateModel()
    model(x[:1])  # build both networks, so the first step already soft-updates
    model.compile(optimizer=keras.optimizers.Adam(0.05), run_eagerly=run_eagerly)
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    return history.history, float(tf.sigmoid(model.tau_logit))


def test_fit_compiled_matches_eager_and_learns_tau():
    compiled, tau_compiled = _fit(run_eagerly=False)
    eager, tau_eager = _fit(run_eagerly=True)
    np.testing.assert_allclose(compiled["loss"], eager["loss"], rtol=1e-5)
    np.testing.assert_allclose(tau_compiled, tau_eager, rtol=1e-5)
    assert abs(tau_compiled - 0.5) > 1e-2  # tau really moved: its gradient is not None


def test_plain_tape_would_not_train_tau():
    model = SoftUpdateModel()
    x = tf.ones([4, 2])
    model(x)
    with tf.GradientTape() as tape:
        tau = tf.sigmoid(model.tau_logit)
        for t, o in zip(model.target.weights, model.online.weights):
            t.assign((1.0 - tau) * t + tau * o)
        loss = tf.reduce_mean(model.target(x) ** 2)
    assert tape.gradient(loss, model.tau_logit) is None
