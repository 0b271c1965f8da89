"""The shipped examples: their gradients against hand-written functional versions,
and each example end to end in a small configuration (with its plot)."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import inner_sgd_gradient, modes, run

from assigntape.examples import hypergradient_lr, maml_sine, soft_update_tau

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == PNG_MAGIC


# -- maml_sine -----------------------------------------------------------------------


def _mlp(params, x):
    """maml_sine's 1-40-40-1 ReLU model on the weights as tensors."""
    h = tf.nn.relu(x @ params[0] + params[1])
    h = tf.nn.relu(h @ params[2] + params[3])
    return h @ params[4] + params[5]


def _functional_maml(weights, step_sizes, batch):
    """MAML written with the weights as tensors: no variables, no writes."""
    xs, ys, xq, yq = (tf.constant(a) for a in batch)
    theta = [tf.constant(w) for w in weights]
    alphas = [tf.constant(a) for a in step_sizes]

    with tf.GradientTape() as outer:
        outer.watch(theta + alphas)
        losses = []
        for t in range(xs.shape[0]):
            with tf.GradientTape() as inner:
                inner.watch(theta)
                support = tf.reduce_mean((_mlp(theta, xs[t]) - ys[t]) ** 2)
            grads = inner.gradient(support, theta)
            adapted = [p - a * g for p, a, g in zip(theta, alphas, grads)]
            losses.append(tf.reduce_mean((_mlp(adapted, xq[t]) - yq[t]) ** 2))
        meta_loss = tf.add_n(losses) / len(losses)
    return meta_loss, outer.gradient(meta_loss, theta + alphas)


@modes
@pytest.mark.parametrize("variant", ["maml", "meta_sgd"])
def test_first_meta_gradient_equals_functional_maml(mode, variant):
    config = maml_sine.Config(seed=3)
    batch = maml_sine.SineTasks(7).meta_batch(5, config.shots)
    model = maml_sine.build_model(config.seed)
    weights = [w.numpy() for w in model.trainable_variables]
    rng = np.random.default_rng(1)
    if variant == "maml":
        optimizer = keras.optimizers.SGD(config.inner_lr)
        optimizer.build(model.trainable_variables)
        step_sizes, alphas = None, [np.float32(config.inner_lr)] * len(weights)
    else:
        optimizer = None
        # Per-parameter step sizes, all different, so a mix-up would show.
        alphas = [rng.uniform(0.005, 0.02, w.shape).astype(np.float32) for w in weights]
        step_sizes = [tf.Variable(a) for a in alphas]

    def body():
        return maml_sine.meta_gradients(model, [tf.constant(a) for a in batch], optimizer, step_sizes)

    loss, grads = run(mode, body)
    expected_loss, expected = _functional_maml(weights, alphas, batch)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-5)
    for got, want in zip(grads, expected[: len(grads)]):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    # The tape put every weight back: the meta-batch left the model unchanged.
    for w, w0 in zip(model.trainable_variables, weights):
        np.testing.assert_array_equal(w.numpy(), w0)


def test_evaluation_equals_adapting_the_keras_model():
    """The vectorised held-out evaluation against one SGD step per task on the
    Keras model itself, with a plain tape."""
    config = maml_sine.Config(seed=5, eval_tasks=6, eval_points=20)
    held_out = maml_sine._held_out(config)
    model = maml_sine.build_model(config.seed)
    weights = [w.numpy() for w in model.trainable_variables]
    curve = maml_sine.evaluate(weights, None, config.inner_lr, held_out, steps=1)
    xs, ys, xq, yq = held_out
    before, after = [], []
    for t in range(config.eval_tasks):
        for w, w0 in zip(model.trainable_variables, weights):
            w.assign(w0)
        before.append(float(tf.reduce_mean((model(xq[t]) - yq[t]) ** 2)))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xs[t]) - ys[t]) ** 2)
        for w, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            w.assign_sub(config.inner_lr * g)
        after.append(float(tf.reduce_mean((model(xq[t]) - yq[t]) ** 2)))
    np.testing.assert_allclose(curve, [np.mean(before), np.mean(after)], rtol=1e-5)


def test_maml_sine_small_run(tmp_path):
    config = maml_sine.Config(
        iterations=40,
        baseline_iterations=40,
        meta_batch=4,
        eval_tasks=30,
        eval_steps=3,
        plot=str(tmp_path / "maml.png"),
        progress=False,
    )
    results = maml_sine.run(config)
    methods = results["methods"]
    assert set(methods) == {"MAML", "Meta-SGD", "pretrained"}
    for name, method in methods.items():
        assert len(method["curve"]) == 4 and len(method["train_loss"]) == 40
        assert all(math.isfinite(v) for v in method["curve"][:2]), name
    # Meta-SGD's step sizes were trained: they moved away from alpha.
    assert any(np.abs(a - config.inner_lr).max() > 1e-6 for a in methods["Meta-SGD"]["step_sizes"])
    _assert_png(results["plot"])
    text = maml_sine.report(results)
    assert "MAML after 1 step" in text and "Meta-SGD after 1 step" in text


def test_maml_long_unroll_meta_gradient_equals_the_rewrite(capsys):
    """``--inner-steps 6 --unroll``: the first task's meta-gradient through 6
    inner SGD steps taken under ``unroll`` (segments of 3) against the
    assignment-free rewrite: the weights as tensors, theta <- theta - lr g,
    under a plain tape; and the plain loop's, the example's other figure."""
    results = maml_sine.main(["--inner-steps", "6", "--unroll", "--meta-steps", "2", "--quiet"])
    config = maml_sine.UnrollConfig()
    assert results["config"]["inner_steps"] == 6 and len(results["train_loss"]) == 2
    model = maml_sine.build_model(config.seed)  # (the example builds its model so, before training)
    task = [a[0] for a in maml_sine.SineTasks(config.seed + 1).meta_batch(1, config.shots)]
    xs, ys, xq, yq = (tf.constant(a) for a in task)
    theta = [tf.constant(w.numpy()) for w in model.trainable_variables]

    expected = inner_sgd_gradient(
        theta,
        6,
        config.inner_lr,
        lambda params: tf.reduce_mean((_mlp(params, xs) - ys) ** 2),
        lambda params: tf.reduce_mean((_mlp(params, xq) - yq) ** 2),
    )
    for how in ("unroll", "plain"):
        for got, want in zip(results["first_gradients"][how], expected):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-6)
    assert results["max_relative_difference"] < 1e-6
    assert "peak resident memory" in capsys.readouterr().out


def test_maml_report_says_diverged_and_no_target():
    """A run that blew up is reported in words (Meta-SGD's step sizes repeated ten
    times overshoot: the full run's 10-step column is NaN), and the report states
    results, not the project's goals."""
    curve = {"MAML": [2.9, 0.4, 0.25], "Meta-SGD": [2.9, 0.24, float("nan")], "pretrained": [2.9, 1.867, float("inf")]}
    results = {
        "config": {
            "eval_steps": 2,
            "eval_tasks": 600,
            "shots": 10,
            "inner_lr": 0.01,
            "iterations": 15000,
            "compiled": True,
        },
        "methods": {name: {"curve": c} for name, c in curve.items()},
        "seconds": 1.0,
    }
    text = maml_sine.report(results)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[3:6]}
    assert rows["Meta-SGD"] == ["2.900", "0.240", "diverged"]
    assert rows["pretrained"] == ["2.900", "1.867", "diverged"]
    assert "nan" not in text.lower().split() and "inf" not in text.lower().split()
    assert "target" not in text.lower()
    assert "MAML after 1 step: 0.400; the pretrained baseline after 1 step: 1.867 (4.7x MAML's)" in text


# -- hypergradient_lr ----------------------------------------------------------------


@modes
@pytest.mark.parametrize("hypergradient", ["reverse", "forward"])
def test_hypergradient_is_minus_grad_dot_previous_grad(mode, hypergradient):
    model = hypergradient_lr._model(0)
    lr = tf.Variable(0.3)
    optimizer = keras.optimizers.SGD(learning_rate=lambda: lr)
    optimizer.build(model.trainable_variables)
    x, y = hypergradient_lr._data(0, n=64)
    rng = np.random.default_rng(2)
    previous = [tf.constant(rng.normal(size=w.shape).astype(np.float32)) for w in model.trainable_variables]
    start = [w.numpy() for w in model.trainable_variables]

    loss, grads, d_lr = run(
        mode, lambda: hypergradient_lr.hypergradient_step(model, optimizer, lr, previous, x, y, hypergradient)
    )
    # By hand: the weights after the step, and the gradient there.
    after = [tf.constant(w0) - 0.3 * p for w0, p in zip(start, previous)]
    with tf.GradientTape() as tape:
        tape.watch(after)
        h = tf.tanh(tf.constant(x) @ after[0] + after[1])
        expected_loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ after[2] + after[3]))
    expected_grads = tape.gradient(expected_loss, after)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-5)
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-4, atol=1e-6)
    hand = -sum(float(tf.reduce_sum(g * p)) for g, p in zip(expected_grads, previous))
    np.testing.assert_allclose(float(d_lr), hand, rtol=1e-4)


@pytest.mark.parametrize("hypergradient", ["reverse", "forward"])
def test_hypergradient_lr_small_run_moves_bad_rates(tmp_path, hypergradient):
    config = hypergradient_lr.Config(
        steps=80, plot=str(tmp_path / "hd.png"), progress=False, hypergradient=hypergradient
    )
    results = hypergradient_lr.run(config)
    runs = results["runs"]
    small = runs["SGD-HD, lr0 10x too small (0.1)"]["lr"]
    large = runs["SGD-HD, lr0 10x too large (10)"]["lr"]
    assert small[-1] > 1.5 * small[0]  # a rate that is too small grows
    assert large[-1] < 0.8 * large[0]  # a rate that is too large shrinks
    assert runs["SGD, lr0 10x too large (10)"]["lr"] == [10.0] * 80  # plain SGD keeps its rate
    _assert_png(results["plot"])
    assert "SGD-HD, lr0 10x too large (10)" in hypergradient_lr.report(results)


# -- soft_update_tau -----------------------------------------------------------------


def test_soft_update_compiled_fit_matches_eager():
    config = soft_update_tau.Config(steps=60, plot=None, progress=False)
    compiled = soft_update_tau._fit(config, drifting=True, tau0=0.1, learn_tau=True)
    eager = soft_update_tau._fit(
        soft_update_tau.Config(steps=60, plot=None, progress=False, run_eagerly=True), True, 0.1, True
    )
    np.testing.assert_allclose(compiled["tau"], eager["tau"], rtol=1e-5)
    np.testing.assert_allclose(compiled["target_loss"], eager["target_loss"], rtol=1e-4)
    assert abs(compiled["tau"][-1] - 0.1) > 1e-3  # tau really learned


def test_soft_update_fixed_tau_stays_fixed():
    config = soft_update_tau.Config(steps=30, plot=None, progress=False)
    fixed = soft_update_tau._fit(config, drifting=True, tau0=0.3, learn_tau=False)
    np.testing.assert_allclose(fixed["tau"], 0.3, rtol=1e-6)


def test_soft_update_tau_small_run(tmp_path):
    config = soft_update_tau.Config(steps=120, plot=str(tmp_path / "tau.png"), progress=False)
    results = soft_update_tau.run(config)
    drifting = results["streams"]["drifting"]
    # Drift favours a larger tau: the learned one rises from its start at 0.1.
    assert drifting["learned"]["tau"][-1] > 0.12
    assert set(drifting["fixed"]) == set(soft_update_tau.FIXED_TAUS)
    _assert_png(results["plot"])
