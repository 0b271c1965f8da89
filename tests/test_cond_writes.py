"""Writes inside ``tf.cond`` branches (and autograph ``if`` on a tensor), with the
tape opened in the ``tf.function``: the same gradients as the eager program (whose
``if`` is Python) and as the functional rewrite, for whichever branch runs.

In a graph, a source read only by the branch that did not run gets zeros rather
than None (as with TensorFlow's own ``tf.cond``), so the comparisons fill
unconnected gradients with zeros on both sides."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close

from assigntape import AssignAwareTape

ZERO = tf.UnconnectedGradients.ZERO


def _both(body, *args):
    """body(*args) eagerly, and traced, for tensors ``args``."""
    eager = body(*args)
    compiled = tf.function(body)(*args)
    return eager, compiled


def _program_and_rewrite():
    v, a, b = tf.Variable(1.0), tf.Variable(2.0), tf.Variable(5.0)

    def program(n):
        for var, value in ((v, 1.0), (a, 2.0), (b, 5.0)):
            var.assign(value)
        with AssignAwareTape() as tape:
            v.assign_add(a)  # a version made before the cond
            if n > 1:
                v.assign(v * a)
                y0 = v * 3.0  # a read after the write, in the branch
                v.assign_add(b * a)
            else:
                y0 = v * 1.0
                b.assign_sub(a)
            y = v * v + y0 + b * 10.0
        return tape.gradient(y, [v, a, b], unconnected_gradients=ZERO)

    def rewrite(n):
        v, a, b = tf.constant(1.0), tf.constant(2.0), tf.constant(5.0)
        with tf.GradientTape() as tape:
            tape.watch([v, a, b])
            v1 = v + a
            if int(n) > 1:
                v2 = v1 * a
                y0 = v2 * 3.0
                v3, b1 = v2 + b * a, b
            else:
                y0, v3, b1 = v1 * 1.0, v1, b - a
            y = v3 * v3 + y0 + b1 * 10.0
        return tape.gradient(y, [v, a, b], unconnected_gradients=ZERO)

    return program, rewrite


@pytest.mark.parametrize("n", [0, 2], ids=["false_branch", "true_branch"])
def test_cond_writes_match_eager_and_rewrite(n):
    program, rewrite = _program_and_rewrite()
    eager, compiled = _both(program, tf.constant(n))
    expected = rewrite(n)
    assert_grads_close(eager, expected)
    assert_grads_close(compiled, expected)


def test_the_same_trace_serves_both_branches():
    program, rewrite = _program_and_rewrite()
    f = tf.function(program)
    for n in (2, 0, 2):  # one trace, both branches taken at run time
        assert_grads_close(f(tf.constant(n)), rewrite(n))
    assert f.experimental_get_tracing_count() == 1


def test_explicit_tf_cond_with_outputs_and_one_writing_branch():
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(3.0)

    @tf.function
    def f(p):
        v.assign([1.0, 2.0])
        with AssignAwareTape() as tape:
            out = tf.cond(p, lambda: (v.assign_sub(a * v), a * 2.0)[1], lambda: tf.constant(0.5))
            y = tf.reduce_sum(v * v) * out
        return tape.gradient(y, [v, a])

    # p true: v1 = (1 - a) v, y = 2a |v1|^2 = 2a (1 - a)^2 |v|^2, |v|^2 = 5.
    d_v, d_a = f(tf.constant(True))
    np.testing.assert_allclose(d_v.numpy(), 2 * 3.0 * 4.0 * 2 * np.array([1.0, 2.0]), rtol=1e-6)
    np.testing.assert_allclose(float(d_a), 5 * (2 * 4.0 + 2 * 3.0 * 2 * (3.0 - 1)), rtol=1e-6)
    # p false: v untouched, y = 0.5 |v|^2, and a only in the branch not taken.
    d_v, d_a = f(tf.constant(False))
    np.testing.assert_allclose(d_v.numpy(), [1.0, 2.0], rtol=1e-6)
    assert d_a is None or float(d_a) == 0.0


def test_conditional_keras_sgd_step():
    """A Keras optimizer step taken only when a tensor flag says so."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.1)
    opt.build(model.trainable_variables)
    x, y = tf.constant([[1.0, 2.0], [0.5, -1.0]]), tf.constant([[1.0], [0.0]])
    start = [w.numpy() for w in model.trainable_variables]

    def step(flag):
        for w, w0 in zip(model.trainable_variables, start):
            w.assign(w0)
        with AssignAwareTape() as tape:
            with tf.GradientTape() as inner:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = inner.gradient(loss, model.trainable_variables)
            if flag:
                opt.apply_gradients(zip(grads, model.trainable_variables))
            outer = tf.reduce_mean((model(x) - 2.0 * y) ** 2)
        return tape.gradient(outer, model.trainable_variables, unconnected_gradients=ZERO)

    for flag in (True, False):
        eager = step(flag)
        compiled = tf.function(step)(tf.constant(flag))
        assert_grads_close(compiled, eager, rtol=1e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["tf.function", "xla"])
def test_cond_writes_under_xla(jit):
    program, rewrite = _program_and_rewrite()
    f = tf.function(program, jit_compile=jit)
    for n in (0, 2):
        assert_grads_close(f(tf.constant(n)), rewrite(n), rtol=1e-5)


def test_versions_and_history_after_a_cond():
    v, a = tf.Variable(1.0, name="cv"), tf.Variable(2.0)
    found = []

    @tf.function
    def f(p):
        with AssignAwareTape(persistent=True) as tape:
            if p:
                v.assign(a * 4.0)
            y = v * 1.0
        found.append(tape.history())
        versions = tape.versions(v)
        return tape.gradient(y, versions[-1]), tape.gradient(y, a, unconnected_gradients=ZERO)

    d_last, d_a = f(tf.constant(True))
    assert float(d_last) == 1.0 and float(d_a) == 4.0
    assert [r.op for r in found[-1].variables["cv:0"]] == [None, "tf.cond"]
    assert v.handle is v.__dict__["_handle"]  # nothing left behind


WRITES = {
    "scatter_update": lambda v, a: v.scatter_update(tf.IndexedSlices(tf.stack([a, a * a]), [2, 0])),
    "scatter_add": lambda v, a: v.scatter_add(tf.IndexedSlices(tf.stack([a, 2.0 * a]), [1, 1])),
    "scatter_sub": lambda v, a: v.scatter_sub(tf.IndexedSlices(tf.reshape(a, [1]), [3])),
    "scatter_mul": lambda v, a: v.scatter_mul(tf.IndexedSlices(tf.stack([a, 3.0]), [0, 3])),
    "scatter_div": lambda v, a: v.scatter_div(tf.IndexedSlices(tf.stack([a, 4.0]), [1, 2])),
    "scatter_max": lambda v, a: v.scatter_max(tf.IndexedSlices(tf.stack([a * 2.0, -5.0]), [0, 1])),
    "scatter_min": lambda v, a: v.scatter_min(tf.IndexedSlices(tf.stack([a * 2.0, -5.0]), [0, 1])),
    "scatter_nd_update": lambda v, a: v.scatter_nd_update([[1], [3]], tf.stack([a, -a])),
    "scatter_nd_add": lambda v, a: v.scatter_nd_add([[0], [0]], tf.stack([a, a * a])),
    "scatter_nd_sub": lambda v, a: v.scatter_nd_sub([[2]], tf.reshape(a * 3.0, [1])),
    "slice": lambda v, a: v[1:3].assign(tf.stack([a, a * a])),
    "strided_slice": lambda v, a: v[::2].assign(tf.stack([a, 5.0])),
}


# The same writes on a tensor: the functional rewrite, written independently.
REWRITES = {
    "scatter_update": lambda t, a: tf.tensor_scatter_nd_update(t, [[2], [0]], tf.stack([a, a * a])),
    "scatter_add": lambda t, a: tf.tensor_scatter_nd_add(t, [[1], [1]], tf.stack([a, 2.0 * a])),
    "scatter_sub": lambda t, a: tf.tensor_scatter_nd_sub(t, [[3]], tf.reshape(a, [1])),
    "scatter_mul": lambda t, a: tf.tensor_scatter_nd_update(t, [[0], [3]], tf.gather(t, [0, 3]) * tf.stack([a, 3.0])),
    "scatter_div": lambda t, a: tf.tensor_scatter_nd_update(t, [[1], [2]], tf.gather(t, [1, 2]) / tf.stack([a, 4.0])),
    "scatter_max": lambda t, a: tf.tensor_scatter_nd_update(
        t, [[0], [1]], tf.maximum(tf.gather(t, [0, 1]), tf.stack([a * 2.0, -5.0]))
    ),
    "scatter_min": lambda t, a: tf.tensor_scatter_nd_update(
        t, [[0], [1]], tf.minimum(tf.gather(t, [0, 1]), tf.stack([a * 2.0, -5.0]))
    ),
    "scatter_nd_update": lambda t, a: tf.tensor_scatter_nd_update(t, [[1], [3]], tf.stack([a, -a])),
    "scatter_nd_add": lambda t, a: tf.tensor_scatter_nd_add(t, [[0], [0]], tf.stack([a, a * a])),
    "scatter_nd_sub": lambda t, a: tf.tensor_scatter_nd_sub(t, [[2]], tf.reshape(a * 3.0, [1])),
    "slice": lambda t, a: tf.concat([t[:1], tf.stack([a, a * a]), t[3:]], 0),
    "strided_slice": lambda t, a: tf.tensor_scatter_nd_update(t, [[0], [2]], tf.stack([a, 5.0])),
}


@pytest.mark.parametrize("kind", sorted(WRITES))
@pytest.mark.parametrize("taken", [True, False], ids=["branch_taken", "other_branch"])
def test_partial_writes_in_a_branch_match_eager(kind, taken):
    v, a = tf.Variable([0.5, 1.5, -2.0, 3.0]), tf.Variable(1.25)

    def body(p):
        v.assign([0.5, 1.5, -2.0, 3.0])
        with AssignAwareTape() as tape:
            v.assign(v * a)  # a version from before the cond, read by the write
            if p:
                WRITES[kind](v, a)
                inside = tf.reduce_sum(v * v)  # read after the write, in the branch
            else:
                v.assign_add(tf.fill([4], a))
                inside = tf.reduce_sum(v)
            y = tf.reduce_sum(tf.sin(v) * v) + inside
        return tape.gradient(y, [v, a], unconnected_gradients=ZERO)

    def rewrite():
        v0, a = tf.constant([0.5, 1.5, -2.0, 3.0]), tf.constant(1.25)
        with tf.GradientTape() as tape:
            tape.watch([v0, a])
            t = v0 * a
            if taken:
                t = REWRITES[kind](t, a)
                inside = tf.reduce_sum(t * t)
            else:
                t = t + tf.fill([4], a)
                inside = tf.reduce_sum(t)
            y = tf.reduce_sum(tf.sin(t) * t) + inside
        return tape.gradient(y, [v0, a], unconnected_gradients=ZERO)

    expected = rewrite()
    assert_grads_close(body(taken), expected, rtol=1e-5)
    assert_grads_close(tf.function(body)(tf.constant(taken)), expected, rtol=1e-5)


def test_duplicate_indices_in_a_branch_are_refused_before_the_write():
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(2.0)

    @tf.function
    def f(p):
        with AssignAwareTape() as tape:
            if p:
                v.scatter_update(tf.IndexedSlices(tf.stack([a, 3.0]), [0, 0]))
            y = tf.reduce_sum(v)
        return tape.gradient(y, a, unconnected_gradients=ZERO)

    with pytest.raises(tf.errors.InvalidArgumentError, match="duplicate indices"):
        f(tf.constant(True))
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])  # nothing was written
    assert float(f(tf.constant(False))) == 0.0


@pytest.mark.parametrize("p", [True, False])
@pytest.mark.parametrize("q", [True, False])
def test_nested_conds_match_eager(p, q):
    v, w, a = tf.Variable(1.0), tf.Variable([1.0, -1.0]), tf.Variable(2.0)

    def body(p, q):
        v.assign(1.0)
        w.assign([1.0, -1.0])
        with AssignAwareTape() as tape:
            v.assign_add(a)
            if p:
                v.assign(v * a)
                if q:
                    w.scatter_add(tf.IndexedSlices(tf.reshape(v * a, [1]), [1]))
                    v.assign_sub(a * a)
                    if q:  # three deep
                        w[0].assign(v + a)
                else:
                    w.assign(w * v)
                inner = v * tf.reduce_sum(w)  # reads after the nested cond, in the branch
            else:
                if q:
                    v.assign(a * 3.0)
                inner = v * 1.0
            y = v * v + tf.reduce_sum(tf.sin(w) * w) + inner
        return tape.gradient(y, [v, w, a], unconnected_gradients=ZERO)

    eager = body(p, q)
    compiled = tf.function(body)(tf.constant(p), tf.constant(q))
    assert_grads_close(compiled, eager, rtol=1e-5)


def test_loop_inside_a_branch_matches_eager():
    v, a = tf.Variable(1.0), tf.Variable(2.0)

    def body(p, n):
        v.assign(1.0)
        with AssignAwareTape() as tape:
            if p:
                for _ in tf.range(n) if isinstance(n, tf.Tensor) else range(n):
                    v.assign(v * a)
            y = v * 1.0
        return tape.gradient(y, [v, a], unconnected_gradients=ZERO)

    for p in (True, False):
        assert_grads_close(tf.function(body)(tf.constant(p), tf.constant(3)), body(p, 3))


def test_cond_without_writes_is_untouched():
    v = tf.Variable(3.0)

    @tf.function
    def f(p):
        with AssignAwareTape() as tape:
            y = tf.cond(p, lambda: v * 2.0, lambda: v * v)
        return tape.gradient(y, v)

    assert float(f(tf.constant(True))) == 2.0 and float(f(tf.constant(False))) == 6.0


def test_partial_write_in_a_branch_of_a_never_read_variable():
    # Found by the random programs: assign_add keeps the old value, so the
    # variable must be watched even though nothing read it before.
    v = tf.Variable(0.3)

    @tf.function
    def f(p):
        with AssignAwareTape() as tape:
            tf.cond(p, lambda: (v.assign_add(0.25), tf.constant(0.0))[1], lambda: tf.constant(0.0))
            loss = tf.sin(v)
        return tape.gradient(loss, v)

    v.assign(0.3)
    np.testing.assert_allclose(float(f(tf.constant(True))), np.cos(0.55), rtol=1e-6)
    v.assign(0.3)
    np.testing.assert_allclose(float(f(tf.constant(False))), np.cos(0.3), rtol=1e-6)


def test_write_under_stop_recording_in_a_branch_has_no_gradient_path():
    v, a = tf.Variable(1.0), tf.Variable(2.0)

    def body(p):
        v.assign(1.0)
        with AssignAwareTape() as tape:
            if p:
                with tape.stop_recording():
                    v.assign_add(a)
            y = v * a
        return tape.gradient(y, [v, a], unconnected_gradients=ZERO)

    eager = body(True)
    compiled = tf.function(body)(tf.constant(True))
    assert_grads_close(compiled, eager)
    assert float(eager[1]) == 3.0  # only the read after the write: d (v + a) a / da with v + a fixed
