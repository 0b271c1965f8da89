"""A ``tf.function`` that writes, called in the graph of a tape's function, is
traced inline there (``_functions.inline``): its writes are differentiated as
if the function were undecorated. Crossed with what a ``tf.function`` can be:
AutoGraph control flow on tensors, a method, an input signature, what it
returns, nesting, ``jit_compile``, a Keras optimizer step; each against the
assignment-free rewrite under a plain tape."""

from __future__ import annotations

from typing import Any, List

import keras
import numpy as np
import pytest
import tensorflow as tf

from assigntape import AssignAwareTape

pytestmark = pytest.mark.parametrize("xla", [False, True], ids=["graph", "xla"])


def _ops(fn: Any, *args: Any) -> List[str]:
    return [op.type for op in fn.get_concrete_function(*args).graph.get_operations()]


def test_autograph_if_on_a_tensor_inside_the_called_function(xla: bool) -> None:
    v, a = tf.Variable([1.0, -2.0], name="v"), tf.Variable(1.5, name="a")

    @tf.function
    def inner(x: Any) -> None:
        if tf.reduce_sum(x) > 0.0:  # AutoGraph: a tf.cond whose branches write
            v.assign(v * a * x)
        else:
            v.assign_add(a * x)

    @tf.function(jit_compile=xla)
    def outer(x: Any) -> Any:
        with AssignAwareTape() as tape:
            inner(x)
            y = tf.reduce_sum(v * v)
        return tape.gradient(y, [a, v])

    for x0 in ([1.0, 2.0], [-1.0, -2.0]):
        v.assign([1.0, -2.0])
        x = tf.constant(x0)
        got = outer(x)
        v0, at = tf.constant([1.0, -2.0]), tf.constant(1.5)
        with tf.GradientTape() as rewrite:
            rewrite.watch([at, v0])
            w = v0 * at * x if sum(x0) > 0 else v0 + at * x
            y = tf.reduce_sum(w * w)
        expected = rewrite.gradient(y, [at, v0])
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6)


def test_a_method_with_an_input_signature_returning_the_written_value(xla: bool) -> None:
    class Scaler(tf.Module):
        def __init__(self) -> None:
            self.w = tf.Variable(2.0, name="w")

        @tf.function(input_signature=[tf.TensorSpec([], tf.float32)])
        def scale(self, factor: Any) -> Any:
            return self.w.assign(self.w * factor)

    m, a = Scaler(), tf.Variable(3.0, name="a")

    @tf.function(jit_compile=xla)
    def outer() -> Any:
        with AssignAwareTape() as tape:
            out = m.scale(a * 1.0)
            y = out * m.w  # (w0 a)^2
        return out, tape.gradient(y, a)

    out, grad = outer()
    # The rewrite: w = w0 a, y = w0^2 a^2, dy/da = 2 w0^2 a = 24.
    assert isinstance(out, tf.Tensor) and float(out) == 6.0
    assert float(grad) == 24.0


def test_two_calls_deep_in_a_graph_loop(xla: bool) -> None:
    w, lr = tf.Variable([0.5, -1.0], name="w"), tf.Variable(0.1, name="lr")

    @tf.function
    def sgd(g: Any) -> None:
        w.assign_sub(lr * g)

    @tf.function
    def step() -> None:
        with tf.GradientTape() as inner:
            loss = tf.reduce_sum(w**2 * w)
        sgd(inner.gradient(loss, w))

    @tf.function(jit_compile=xla)
    def outer() -> Any:
        with AssignAwareTape() as tape:
            for _ in tf.range(3):
                step()
            y = tf.reduce_sum(w * w)
        return tape.gradient(y, [lr, w])

    got = outer()
    w0, rate = tf.constant([0.5, -1.0]), tf.constant(0.1)
    with tf.GradientTape() as rewrite:
        rewrite.watch([rate, w0])
        wt = w0
        for _ in range(3):
            wt = wt - rate * 3.0 * wt**2  # d/dw sum(w^3) = 3 w^2
        y = tf.reduce_sum(wt * wt)
    expected = rewrite.gradient(y, [rate, w0])
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5)


def test_a_keras_optimizer_step_in_a_called_jit_function(xla: bool) -> None:
    w = tf.Variable([[0.3, -0.2], [0.1, 0.4]], name="w")
    lr = tf.Variable(0.05, name="lr")
    opt = keras.optimizers.SGD(learning_rate=lambda: lr, momentum=0.9)
    opt.build([w])
    x = tf.constant([[1.0, 2.0], [-1.0, 0.5]])

    @tf.function(jit_compile=True)
    def inner_step() -> None:
        with tf.GradientTape() as inner:
            loss = tf.reduce_sum(tf.tanh(x @ w))
        opt.apply_gradients([(inner.gradient(loss, w), w)])

    @tf.function(jit_compile=xla)
    def outer() -> Any:
        with AssignAwareTape() as tape:
            inner_step()
            inner_step()
            y = tf.reduce_sum(tf.tanh(x @ w) ** 2)
        return tape.gradient(y, [lr, w])

    got = outer()
    w0, rate = tf.constant([[0.3, -0.2], [0.1, 0.4]]), tf.constant(0.05)
    with tf.GradientTape() as rewrite:
        rewrite.watch([rate, w0])
        wt, m = w0, tf.zeros_like(w0)
        for _ in range(2):
            with tf.GradientTape() as g:
                g.watch(wt)
                loss = tf.reduce_sum(tf.tanh(x @ wt))
            m = 0.9 * m - rate * g.gradient(loss, wt)  # Keras SGD momentum
            wt = wt + m
        y = tf.reduce_sum(tf.tanh(x @ wt) ** 2)
    expected = rewrite.gradient(y, [rate, w0])
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5)


def test_a_function_that_only_reads_is_called_as_itself(xla: bool) -> None:
    v = tf.Variable(2.0, name="v")

    @tf.function
    def read() -> Any:
        return v * 3.0

    @tf.function(jit_compile=xla)
    def outer() -> Any:
        with AssignAwareTape() as tape:
            v.assign(v * 2.0)
            y = read()
        return tape.gradient(y, v)

    assert float(outer()) == 6.0  # y = 3 (2 v0): dy/dv0 = 6
    if not xla:
        assert "StatefulPartitionedCall" in _ops(outer) or "PartitionedCall" in _ops(outer)


def test_a_writing_function_whose_first_call_makes_a_variable_from_its_argument_is_refused_inline(xla: bool) -> None:
    # Traced inline in the tape's function, the call TensorFlow makes to
    # initialize such a variable (a cond in the function's own graph) is not
    # made: the variable stayed uninitialized and reads gave an empty tensor,
    # silently (y = [] where the rewrite has 18). Refused by name instead; a
    # variable with a constant initial value is initialized by TensorFlow
    # before the call, and inlining is right (y = 6, dy/dx = 2).
    import assigntape

    for from_argument in (True, False):
        x, holder = tf.Variable(3.0), []

        @tf.function
        def make(a: Any) -> Any:
            if not holder:
                holder.append(tf.Variable(a * 1.0 if from_argument else 2.0))
            holder[0].assign(holder[0] * 1.0)
            return tf.constant(0.0)

        @tf.function(jit_compile=xla)
        def outer(a: Any) -> Any:
            with AssignAwareTape() as tape:
                make(a)
                y = holder[0] * x
            return y, tape.gradient(y, x)

        if from_argument:
            with pytest.raises(assigntape.ControlFlowWriteError, match="from an argument"):
                outer(tf.constant(2.0))
        else:
            y, grad = outer(tf.constant(2.0))
            assert (float(y), float(grad)) == (6.0, 2.0)
