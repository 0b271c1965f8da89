"""What the tests compare against: never the code under test.

* ``run``: the same test body eager, or traced with ``tf.function``.
* ``central_difference``: directional finite differences in float64.
* ``assert_grads_close``: gradient structures compared leaf by leaf, with
  ``None`` only where the oracle has ``None``.
* ``inner_sgd_gradient``: the rewrite of inner SGD steps (MAML) on tensors,
  under plain tapes.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pytest
import tensorflow as tf

MODES = ("eager", "function")

modes = pytest.mark.parametrize("mode", MODES)


def run(mode: str, fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` eagerly, or as a freshly traced ``tf.function``."""
    if mode == "eager":
        return fn()
    if mode == "function":
        return tf.function(fn)()
    raise ValueError(mode)


def to_numpy(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, tf.IndexedSlices):
        x = tf.convert_to_tensor(x)
    return np.asarray(x)


def assert_grads_close(actual: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    tf.nest.assert_same_structure(actual, expected)
    for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected)):
        if e is None:
            assert a is None, f"expected no gradient, got {a}"
            continue
        assert a is not None, f"expected {to_numpy(e)}, got None"
        np.testing.assert_allclose(to_numpy(a), to_numpy(e), rtol=rtol, atol=atol)


def central_difference(
    f: Callable[[Sequence[np.ndarray]], float],
    point: Sequence[np.ndarray],
    direction: Sequence[np.ndarray],
    eps: float = 1e-4,
) -> float:
    """d/dt f(point + t * direction) at t = 0, by central differences."""
    plus = [p + eps * d for p, d in zip(point, direction)]
    minus = [p - eps * d for p, d in zip(point, direction)]
    return (float(f(plus)) - float(f(minus))) / (2 * eps)


def finite_difference_grad(
    f: Callable[[Sequence[np.ndarray]], float], point: Sequence[np.ndarray], eps: float = 1e-4
) -> list:
    """The full gradient of ``f`` at ``point`` (one array per input), in float64."""
    point = [np.asarray(p, dtype=np.float64) for p in point]
    grads = []
    for i, p in enumerate(point):
        g = np.zeros_like(p)
        for idx in np.ndindex(p.shape):
            d = [np.zeros_like(q) for q in point]
            d[i][idx] = 1.0
            g[idx] = central_difference(f, point, d, eps)
        grads.append(g)
    return grads


def inner_sgd_gradient(
    start: Any, steps: int, lr: float, inner_loss: Callable[[Any], Any], outer_loss: Callable[[Any], Any]
) -> Any:
    """The assignment-free rewrite of ``steps`` inner SGD steps (``params <-
    params - lr * d inner_loss(params) / d params``) from ``start`` (a tensor
    or a nest of them), each under its own plain tape, all under an outer
    one: the gradient of ``outer_loss`` of the final params with respect to
    ``start``."""
    with tf.GradientTape() as outer:
        outer.watch(start)
        params = start
        for _ in range(steps):
            with tf.GradientTape() as inner:
                inner.watch(params)
                loss = inner_loss(params)
            grads = inner.gradient(loss, params)
            params = tf.nest.map_structure(lambda p, g: p - lr * g, params, grads)
        final = outer_loss(params)
    return outer.gradient(final, start)


@contextlib.contextmanager
def tape_open_in_another_thread() -> Iterator[None]:
    """Runs the block while another thread has an AssignAwareTape open (it
    wrote a variable of its own)."""
    from assigntape import AssignAwareTape

    opened, release = threading.Event(), threading.Event()

    def hold() -> None:
        v = tf.Variable(1.0)
        with AssignAwareTape():
            v.assign(v * 2.0)
            opened.set()
            release.wait(120)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert opened.wait(60)
        yield
    finally:
        release.set()
        thread.join(60)
