"""A read of a variable in a ``tf.function`` after the ``AssignAwareTape`` that
wrote it there exited is a read of the variable's own handle: it has no
gradient path to the tape's writes. Differentiated from outside (a plain tape
or TensorFlow's accumulator around a call of the function, traced before),
the answer would miss the writes: refused, never silently wrong. The same
value computed inside the tape is differentiated right.

The rewrite (by hand): v1 = v0 + z^2, y = v1^2, so dy/dz = 2 v1 * 2 z; with
v0 = 2 and z = 3, v1 = 11 and dy/dz = 132.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from assigntape import AssignAwareTape, ControlFlowWriteError


def _function(inside: bool, in_cond: bool, v: tf.Variable):
    @tf.function
    def g(z):
        with AssignAwareTape():
            if in_cond:
                tf.cond(z > 0.0, lambda: v.assign_add(z * z).read_value(), lambda: v.read_value())
            else:
                v.assign_add(z * z)
            if inside:
                y = v * v
        if not inside:
            y = v * v  # read after the tape exited
        return y

    g(tf.constant(1.0))  # traced before, with no recorder around
    v.assign(2.0)
    return g


def _reverse(g, z):
    with tf.GradientTape() as tape:
        tape.watch(z)
        y = g(z)
    return tape.gradient(y, z)


def _forward(g, z):
    with tf.autodiff.ForwardAccumulator(z, tf.constant(1.0)) as acc:
        y = g(z)
    return acc.jvp(y)


RECORDERS = {"plain_tape": _reverse, "accumulator": _forward}


@pytest.mark.parametrize("recorder", sorted(RECORDERS))
@pytest.mark.parametrize("in_cond", [False, True], ids=["top", "cond"])
def test_a_read_after_the_tape_differentiated_around_the_call_is_refused(recorder, in_cond):
    v = tf.Variable(2.0)
    g = _function(False, in_cond, v)
    with pytest.raises(ControlFlowWriteError, match="after the AssignAwareTape"):
        RECORDERS[recorder](g, tf.constant(3.0))


@pytest.mark.parametrize("recorder", sorted(RECORDERS))
@pytest.mark.parametrize("in_cond", [False, True], ids=["top", "cond"])
def test_the_same_read_inside_the_tape_is_differentiated_around_the_call(recorder, in_cond):
    v = tf.Variable(2.0)
    g = _function(True, in_cond, v)
    assert float(RECORDERS[recorder](g, tf.constant(3.0))) == 132.0


def _graph_gradient(wrt_variable: bool):
    v = tf.Variable(2.0)

    @tf.function
    def g(z):
        with AssignAwareTape():
            v.assign_add(z * z)
        y = v * v  # read after the tape exited
        return tf.gradients(y, v if wrt_variable else z)[0]

    return g(tf.constant(3.0))


def test_tf_gradients_through_a_read_after_the_tape_is_refused():
    with pytest.raises(ControlFlowWriteError, match="after the AssignAwareTape"):
        _graph_gradient(False)


def test_tf_gradients_with_respect_to_the_variable_after_the_tape_is_still_plain():
    # With respect to the variable itself, after the tape, it is its last
    # version (module _graph_gradients): y = v1^2, dy/dv1 = 2 v1 = 22.
    assert float(_graph_gradient(True)) == 22.0
