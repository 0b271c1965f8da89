"""``watched_variables()`` lists variables in TensorFlow's order, writes or not.

TensorFlow's tape keeps the variables it watched in a set ordered by the id
of the handle each was watched through: for variables made outside the
function, the order they were made in (not the order they were read: a
plain ``tf.GradientTape`` that reads ``b`` before ``w`` lists ``[w, b]``).
A version's handle is made when the variable is written, so a tape that read
versions listed them in the order of the writes. Code zips the list with
another: TensorFlow Probability's ``minimize`` carries
``[tf.identity(v) for v in tape.watched_variables()]`` through a ``tf.cond``,
whose branches then disagreed. The oracle is the same program with no
``AssignAwareTape`` (TensorFlow's own order).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List

import numpy as np
import pytest
import tensorflow as tf
from oracle import modes, run

from assigntape import AssignAwareTape


def _names(tape: Any) -> List[str]:
    return [v.name for v in tape.watched_variables()]


def _reads_b_then_w(w: tf.Variable, b: tf.Variable) -> Any:
    return b * 2.0 + w * 3.0


@modes
def test_a_plain_tape_and_ours_list_in_tensorflows_order_after_writes(mode):
    w, b = tf.Variable(1.0, name="w"), tf.Variable(2.0, name="b")
    listed = {}

    def program() -> Any:
        with tf.GradientTape() as plain:
            _reads_b_then_w(w, b)
        listed["plain"] = _names(plain)
        with AssignAwareTape() as ours:
            b.assign(b * 0.5)  # b's version is made before w's
            w.assign(w * 0.5)
            with tf.GradientTape() as inner:
                _reads_b_then_w(w, b)
            _reads_b_then_w(w, b)
        listed["inner"], listed["ours"] = _names(inner), _names(ours)
        return w + b

    run(mode, program)
    assert listed["plain"] == ["w:0", "b:0"]  # TensorFlow's: by handle, not by first read
    assert listed["inner"] == listed["plain"]
    assert listed["ours"] == listed["plain"]


def _loop_program(aware: bool) -> Callable[[], Any]:
    w, b = tf.Variable(1.0, name="w"), tf.Variable(2.0, name="b")
    listed: List[List[str]] = []

    def body(i: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = (w * 3.0 + b) ** 2
        listed.append(_names(tape))
        gw, gb = tape.gradient(loss, [w, b])
        w.assign_sub(0.01 * gw)
        b.assign_sub(0.01 * gb)
        return (i + 1,)

    @tf.function
    def program() -> Any:
        if aware:
            with AssignAwareTape() as tape:
                tf.while_loop(lambda i: i < 2, body, [tf.constant(0)])
                _reads_b_then_w(w, b)
            listed.append(_names(tape))
        else:
            tf.while_loop(lambda i: i < 2, body, [tf.constant(0)])
        return w + b

    def run() -> Any:
        program()
        return listed

    return run


def test_a_plain_tape_in_a_compiled_loop_body_that_writes_two_variables_lists_them_in_tensorflows_order():
    expected = _loop_program(aware=False)()
    assert expected and all(names == ["w:0", "b:0"] for names in expected)
    listed = _loop_program(aware=True)()
    # (The body is traced again for each variable it writes: every trace, and
    # the outer tape after the loop, list them as TensorFlow does.)
    assert listed and all(names == ["w:0", "b:0"] for names in listed), listed


@pytest.mark.parametrize("xla", [False, True], ids=["graph", "xla"])
def test_tfp_minimize_compiled_gives_the_hand_written_loops_hypergradient(xla):
    """``tfp.math.minimize``'s loop, compiled in the function where the tape
    is open: the hypergradient of the final loss with respect to the
    learning rate equals the assignment-free rewrite's (the same steps on
    tensors, under plain tapes). TFP's step function is a ``tf.function`` of
    its own (``autograph=False``), in whose graph a version could not leave:
    it is traced inline in the tape's graph, inside TFP's ``tf.while_loop``
    and ``tf.cond``, which the tape follows."""
    tfp = pytest.importorskip("tensorflow_probability")
    import keras

    minimize_module = sys.modules[tfp.math.minimize.__module__]
    made = minimize_module._make_stateful_optimizer_step_fn
    # (TFP's own step function, unchanged, a tf.function: checked here so
    # that a TFP that stops decorating it cannot make this test vacuous.)
    assert isinstance(made(lambda: 0.0, None, []), tf.types.experimental.PolymorphicFunction)
    x = tf.constant([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])
    y = tf.constant([1.0, -2.0, 0.3])
    w0, b0, lr0, steps = [0.2, -0.1], 0.05, 0.05, 4
    w, b, lr = tf.Variable(w0, name="w"), tf.Variable(b0, name="b"), tf.Variable(lr0, name="lr")

    def loss_of(w: Any, b: Any) -> Any:
        return tf.reduce_mean((tf.linalg.matvec(x, w) + b - y) ** 2)

    optimizer = keras.optimizers.SGD(learning_rate=lambda: lr)

    @tf.function(jit_compile=xla)
    def meta() -> Any:
        with AssignAwareTape() as tape:
            tfp.math.minimize(lambda: loss_of(w, b), num_steps=steps, optimizer=optimizer, trainable_variables=[w, b])
            final = loss_of(w, b)
        return final, tape.gradient(final, lr)

    def rewrite() -> Any:
        wt, bt, rate = tf.constant(w0), tf.constant(b0), tf.constant(lr0)
        with tf.GradientTape() as outer:
            outer.watch(rate)
            for _ in range(steps):
                with tf.GradientTape() as inner:
                    inner.watch([wt, bt])
                    loss = loss_of(wt, bt)
                gw, gb = inner.gradient(loss, [wt, bt])
                wt, bt = wt - rate * gw, bt - rate * gb
            final = loss_of(wt, bt)
        return final, outer.gradient(final, rate)

    expected = rewrite()
    got = meta()
    np.testing.assert_allclose([float(t) for t in got], [float(t) for t in expected], rtol=1e-5)
