"""``unroll``: K steps in segments of ``checkpoint_every``, equal to the loop.

K = 1, 7, 64 with ``checkpoint_every`` not dividing K, SGD, momentum and
Adam, float32 and float64, eager and compiled; truncation against the loop
whose early steps run under the tape's ``stop_recording()``; and SGD against
the assignment-free rewrite under a plain ``tf.GradientTape``. The programs
are ``test_checkpointed``'s.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes
from test_checkpointed import XV, YV, X, Y, _compare, _initial, _meta

from assigntape import AssignAwareTape, unroll


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


def test_watched_variables_lists_every_variable_the_steps_touch():
    def listed(wrap):
        a, b, cnt = tf.Variable(1.0, name="a"), tf.Variable(2.0, name="b"), tf.Variable(0, name="cnt")

        def step():
            cnt.assign_add(1)
            b.assign(b * a)

        with AssignAwareTape() as tape:
            wrap(step)
            _ = b * 1.0
        return [v.name for v in tape.watched_variables()]

    def loop(step):
        for _ in range(2):
            step()

    assert listed(lambda step: unroll(step, 2)) == listed(loop)


def test_jacobian_without_pfor_through_a_segment_equals_the_loop():
    # (pfor cannot vectorize the re-run's writes; TensorFlow's error says to
    # pass experimental_use_pfor=False, which works.)
    def jac(wrap):
        w, lr = tf.Variable([1.0, 2.0], dtype=tf.float64), tf.Variable(0.1, dtype=tf.float64)

        def step():
            w.assign_sub(lr * w**2)

        with AssignAwareTape(persistent=True) as tape:
            wrap(step)
            y = w * 1.0
        return tape.jacobian(y, w, experimental_use_pfor=False)

    def loop(step):
        for _ in range(3):
            step()

    expected = jac(loop)
    np.testing.assert_allclose(jac(lambda step: unroll(step, 3, checkpoint_every=2)), expected, rtol=1e-12)


@pytest.mark.parametrize(
    "given", [{"steps": True}, {"steps": 3, "checkpoint_every": True}, {"steps": 3, "truncate": False}]
)
def test_a_bool_is_not_a_number_of_steps(given):
    """(A bool is an int to Python: unroll(fn, True) would run one step.)"""
    w = tf.Variable(1.0)
    with AssignAwareTape():
        with pytest.raises(TypeError, match="bool"):
            unroll(lambda: w.assign_add(1.0), **given)
    assert float(w) == 1.0


@pytest.mark.parametrize("every", [1, 2])
def test_a_written_value_that_overflows_to_infinity_is_not_taken_for_a_differing_rerun(every: int) -> None:
    # The re-run check compares fingerprints of the written values; inf - inf
    # is NaN, so a value that overflowed in both runs must count as the same
    # (the thorough profile found it: a complex128 sin(2z) iterated).
    # Oracle: the loop without unroll; d loss/d s = 2 (loss = 2 s).
    def run(wrapped: bool) -> tuple:
        v = tf.Variable(30.0)
        s = tf.Variable(1.0)
        with AssignAwareTape() as tape:

            def step() -> tf.Tensor:
                v.assign(tf.exp(v) * s)  # exp(30) ~ 1e13, then inf
                return s * 2.0

            if wrapped:
                y = unroll(step, 3, checkpoint_every=every)
            else:
                for _ in range(3):
                    y = step()
        return float(y), float(tape.gradient(y, s)), float(v.numpy())

    assert run(True) == run(False) == (2.0, 2.0, float("inf"))
