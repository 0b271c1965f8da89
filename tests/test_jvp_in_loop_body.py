"""``ForwardAccumulator.jvp`` inside a compiled loop body that writes a
variable: the variable's value there is loop state, whose tangent TensorFlow
does not hand the body. A jvp there of a value computed from it is refused,
never silently wrong (it dropped the tangent of the variable's version at the
loop's start: adversarial finding f03). After the loop, and for an accumulator
made in the body, the jvp is the rewrite's.

The rewrite (by hand), x = 3: v1 = 2 x (written under the accumulator:
tangent 2), in the loop (one iteration) v2 = v1 x (tangent 2 x + v1 = 12),
y = v2^2: jvp 2 v2 12 = 432. An accumulator made in the body knows v1 as a
constant: tangent of v2 is v1 = 6, jvp 216.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

import assigntape
from assigntape import AssignAwareTape, ControlFlowWriteError

ACCUMULATORS = {"tf": tf.autodiff.ForwardAccumulator, "ours": assigntape.ForwardAccumulator}


def _program(arrangement: str, kind: str):
    x, v = tf.Variable(3.0), tf.Variable(2.0)
    make = ACCUMULATORS[kind]

    @tf.function
    def f():
        v.assign(2.0)
        with AssignAwareTape():
            xx = x.read_value()
            s = tf.zeros([])
            if arrangement == "made_in_body":
                v.assign(v * xx)
                for _ in tf.range(1):
                    acc = make(xx, tf.constant(1.0))
                    with acc:
                        v.assign(v * xx)
                        s += acc.jvp(v * v, unconnected_gradients="zero")
                return s
            acc = make(xx, tf.constant(1.0))
            if arrangement == "entered_again_in_body":
                with acc:
                    v.assign(v * xx)
                for _ in tf.range(1):
                    with acc:
                        v.assign(v * xx)
                        s += acc.jvp(v * v, unconnected_gradients="zero")
                return s
            with acc:
                v.assign(v * xx)
                for _ in tf.range(1):
                    v.assign(v * xx)
                    if arrangement == "around_jvp_in_body":
                        s += acc.jvp(v * v, unconnected_gradients="zero")
                if arrangement == "around_jvp_after":
                    s = acc.jvp(v * v, unconnected_gradients="zero")
            return s

    return f


@pytest.mark.parametrize("kind", ["tf", "ours"])
@pytest.mark.parametrize("arrangement", ["around_jvp_in_body", "entered_again_in_body"])
def test_a_jvp_in_a_writing_loop_body_of_the_written_variable_is_refused(arrangement, kind):
    with pytest.raises(ControlFlowWriteError, match="(?s)jvp inside a compiled loop body.*Take the jvp after"):
        _program(arrangement, kind)()


@pytest.mark.parametrize("kind", ["tf", "ours"])
def test_a_jvp_after_the_loop_is_the_rewrites(kind):
    assert float(_program("around_jvp_after", kind)()) == 432.0


@pytest.mark.parametrize("kind", ["tf", "ours"])
def test_an_accumulator_made_in_the_body_is_not_refused(kind):
    assert float(_program("made_in_body", kind)()) == 216.0
