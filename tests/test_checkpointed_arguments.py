"""``checkpointed(fn)`` called with keyword arguments: put in their places."""

from __future__ import annotations

import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape, checkpointed


@modes
def test_keyword_arguments_are_passed_as_the_step_names_them(mode):
    """(f09) step(a, b) called as checkpointed(step)(a=..., b=...): the
    values and gradients (for w and the watched tensors) of step(a=..., b=...)
    without the wrapper; it was a TypeError naming step."""
    w = tf.Variable([1.0, 2.0])

    def step(a, b):
        w.assign(w * a - b)
        return tf.reduce_sum(w * b)

    def program(wrap):
        w.assign([1.0, 2.0])
        a, b = tf.constant(2.0), tf.constant(0.5)
        with AssignAwareTape() as tape:
            tape.watch([a, b])
            out = (checkpointed(step) if wrap else step)(b=b, a=a)
            y = tf.reduce_sum(w * w) + out
        return y, tape.gradient(y, [w, a, b])

    assert_grads_close(run(mode, lambda: program(True)), run(mode, lambda: program(False)))
    assert float(checkpointed(step)(a=tf.constant(1.0), b=tf.constant(0.0))) == float(tf.reduce_sum(w * 0.0))


def test_keyword_only_arguments_are_refused_by_name():
    def step(a, *, b):
        return a * b

    with pytest.raises(TypeError, match=r"checkpointed\(step\).*by position.*\['b'\]"):
        checkpointed(step)(tf.constant(1.0), b=tf.constant(2.0))
