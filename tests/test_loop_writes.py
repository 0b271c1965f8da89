"""Writes inside graph loops (``tf.while_loop``, autograph ``for _ in tf.range(n)``
and ``while`` on tensors), with the tape opened in the ``tf.function``: each
written variable is carried as loop state, and the gradients equal those of the
eager program, whose loop is Python, and of the functional rewrite."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close

from assigntape import AssignAwareTape

ZERO = tf.UnconnectedGradients.ZERO


@pytest.mark.parametrize("n", [0, 1, 3])
def test_autograph_range_loop_matches_eager_and_rewrite(n):
    v, w, a = tf.Variable(1.0), tf.Variable([0.5, -1.0]), tf.Variable(1.5)

    def program(n):
        v.assign(1.0)
        w.assign([0.5, -1.0])
        with AssignAwareTape() as tape:
            v.assign_add(a)
            for _ in tf.range(n) if isinstance(n, tf.Tensor) else range(n):
                v.assign(v * a)  # a read of the carried state, then a write
                w.assign_sub(w * v * 0.1)
            y = v * v + tf.reduce_sum(tf.sin(w))
        return tape.gradient(y, [v, w, a], unconnected_gradients=ZERO)

    def rewrite():
        v, w, a = tf.constant(1.0), tf.constant([0.5, -1.0]), tf.constant(1.5)
        with tf.GradientTape() as tape:
            tape.watch([v, w, a])
            v1, w1 = v + a, w
            for _ in range(n):
                v1 = v1 * a
                w1 = w1 - w1 * v1 * 0.1
            y = v1 * v1 + tf.reduce_sum(tf.sin(w1))
        return tape.gradient(y, [v, w, a], unconnected_gradients=ZERO)

    expected = rewrite()
    assert_grads_close(program(n), expected)
    assert_grads_close(tf.function(program)(tf.constant(n)), expected)


def test_compiled_maml_inner_loop_with_tf_range():
    """The inner loop of MAML as a graph loop: k SGD steps, each with its own
    inner tape, inside the meta-tape."""
    w, lr = tf.Variable([[0.5], [-0.3]]), tf.Variable(0.05)
    x, y = tf.constant([[1.0, 2.0], [0.5, -1.0], [2.0, 0.1]]), tf.constant([[1.0], [0.0], [2.0]])

    def meta_step(k):
        w.assign([[0.5], [-0.3]])
        with AssignAwareTape() as outer:
            for _ in tf.range(k) if isinstance(k, tf.Tensor) else range(k):
                with tf.GradientTape() as inner:
                    inner_loss = tf.reduce_mean((x @ w - y) ** 2)
                w.assign_sub(lr * inner.gradient(inner_loss, w))
            outer_loss = tf.reduce_mean((x @ w - 2.0 * y) ** 2)
        return outer.gradient(outer_loss, [lr, w])

    compiled = tf.function(meta_step)
    for k in (1, 4):
        assert_grads_close(compiled(tf.constant(k)), meta_step(k), rtol=1e-5)
    assert compiled.experimental_get_tracing_count() == 1


def test_explicit_while_loop_with_loop_vars_and_a_cond_inside():
    v, a = tf.Variable(2.0), tf.Variable(0.5)

    def program(limit):
        v.assign(2.0)
        with AssignAwareTape() as tape:

            def body(i, acc):
                if i % 2 == 0:  # a cond inside the loop body, writing
                    v.assign(v * a + 1.0)
                else:
                    v.assign_sub(a)
                return i + 1, acc + v

            if isinstance(limit, tf.Tensor):
                _, acc = tf.while_loop(lambda i, acc: i < limit, body, [tf.constant(0), tf.constant(0.0)])
            else:
                i, acc = 0, 0.0
                while i < limit:
                    i, acc = body(i, acc)
            y = acc + v * v
        return tape.gradient(y, [v, a], unconnected_gradients=ZERO)

    for limit in (0, 1, 4):
        assert_grads_close(tf.function(program)(tf.constant(limit)), program(limit), rtol=1e-5)


@pytest.mark.parametrize("kind", ["scatter_add", "scatter_update", "slice"])
def test_partial_writes_in_a_loop(kind):
    v, a = tf.Variable([1.0, 2.0, 3.0]), tf.Variable(0.7)

    def program(n):
        v.assign([1.0, 2.0, 3.0])
        with AssignAwareTape() as tape:
            for _ in tf.range(n) if isinstance(n, tf.Tensor) else range(n):
                if kind == "scatter_add":
                    v.scatter_add(tf.IndexedSlices(tf.stack([a, a * v[2]]), [0, 2]))
                elif kind == "scatter_update":
                    v.scatter_update(tf.IndexedSlices(tf.reshape(v[0] * a, [1]), [1]))
                else:
                    v[1:].assign(v[:2] * a)
            y = tf.reduce_sum(tf.sin(v) * v)
        return tape.gradient(y, [v, a], unconnected_gradients=ZERO)

    assert_grads_close(tf.function(program)(tf.constant(3)), program(3), rtol=1e-5)


def test_nested_loops_and_a_loop_in_a_branch():
    v, a = tf.Variable(1.0), tf.Variable(1.1)

    def program(p, n, m):
        v.assign(1.0)
        with AssignAwareTape() as tape:
            if p:
                for _ in tf.range(n) if isinstance(n, tf.Tensor) else range(n):
                    for _ in tf.range(m) if isinstance(m, tf.Tensor) else range(m):
                        v.assign(v * a + 0.1)
            y = v * v
        return tape.gradient(y, [v, a], unconnected_gradients=ZERO)

    compiled = tf.function(program)
    for p, n, m in [(True, 2, 3), (False, 2, 3), (True, 0, 3)]:
        assert_grads_close(compiled(tf.constant(p), tf.constant(n), tf.constant(m)), program(p, n, m), rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["tf.function", "xla"])
def test_loop_writes_under_xla(jit):
    v, a = tf.Variable([1.0, -1.0]), tf.Variable(0.9)

    def program(n):
        v.assign([1.0, -1.0])
        with AssignAwareTape() as tape:
            for _ in tf.range(n) if isinstance(n, tf.Tensor) else range(n):
                v.assign(tf.tanh(v * a) + a)
            y = tf.reduce_sum(v * v)
        return tape.gradient(y, [v, a])

    assert_grads_close(tf.function(program, jit_compile=jit)(tf.constant(4)), program(4), rtol=1e-5)


def test_history_and_nothing_left_behind():
    v, a = tf.Variable(1.0, name="looped"), tf.Variable(2.0)
    found = []

    @tf.function
    def f(n):
        with AssignAwareTape() as tape:
            for _ in tf.range(n):
                v.assign(v * a)
            y = v * 1.0
        found.append(tape.history())
        return tape.gradient(y, a)

    v.assign(1.0)
    assert float(f(tf.constant(3))) == 12.0  # d (a^3) / da
    assert [r.op for r in found[-1].variables["looped:0"]] == [None, "tf.while_loop"]
    assert v.handle is v.__dict__["_handle"]


def test_loop_that_only_reads_is_untouched():
    v, a = tf.Variable(3.0), tf.Variable(2.0)

    @tf.function
    def f(n):
        with AssignAwareTape() as tape:
            acc = tf.constant(0.0)
            for _ in tf.range(n):
                acc += v * a
        return tape.gradient(acc, [v, a])

    d_v, d_a = f(tf.constant(4))
    np.testing.assert_allclose([float(d_v), float(d_a)], [8.0, 12.0])


def test_loop_variable_first_defined_inside_the_loop():
    """AutoGraph stages such a body once in a throwaway graph; the real trace,
    in the loop, is the one tracked."""
    v, a = tf.Variable([1.0, 2.0, 3.0]), tf.Variable(2.0)

    def program(n):
        v.assign([1.0, 2.0, 3.0])
        with AssignAwareTape() as tape:
            for _ in tf.range(n) if isinstance(n, tf.Tensor) else range(n):
                v.assign(v * a)
                last = tf.reduce_sum(tf.gather(v, [0, 2]) * a)  # defined in the loop
            y = tf.reduce_sum(v) + last
        return tape.gradient(y, a)

    # v = v0 a^2, last = 4 a^3: dy/da = 12 a + 12 a^2 = 72 at a = 2.
    assert float(program(2)) == 72.0
    assert float(tf.function(program)(tf.constant(2))) == 72.0


def test_a_write_in_a_loop_body_inside_the_users_try_except_exception():
    # The body's write asks the loop to trace again, carrying the variable;
    # the request passes through the user's code. An ``except Exception``
    # there (logging and going on) must not see it: plain TensorFlow raises
    # nothing there. Rewrite: v = x^3 after three steps, dy/dx = 3x^2 = 12.
    x, v = tf.Variable(2.0), tf.Variable(1.0)
    caught = []

    def write(value):
        try:
            v.assign(value)
        except Exception as error:
            caught.append(error)

    @tf.function
    def f():
        v.assign(1.0)
        with AssignAwareTape() as tape:
            tf.while_loop(lambda i: i < 3, lambda i: (write(v * x), i + 1)[1], [0])
            y = v * 1.0
        return y, tape.gradient(y, x)

    y, grad = f()
    assert caught == []
    assert float(y) == 8.0 and grad is not None and float(grad) == 12.0
