"""What a checkpointed segment's backward pass shares with the rest of the program.

Its re-run writes the checkpoint and the step's values into the live
variables until it puts them back: a tape open in another thread that read one
of them would read those values, so the gradient is refused with a
``RecomputeError`` naming the step and the variable, before anything is
written (it was an ``UntrackedWriteError`` about a write the program never
made, with advice that did not apply). And its re-run's tape watches what the
step's reads would have had watched, no more.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape, RecomputeError, checkpointed, unroll


def test_gradient_while_another_threads_tape_read_the_variable_is_refused_clearly():
    """(f04) Thread A takes the gradient of an unroll while thread B has a
    tape open that read w. Refused before any write: w keeps its final value
    and B's tape its gradient (d sum(w) / dw = 1)."""
    w = tf.Variable([1.0, 2.0])
    lr = tf.Variable(0.1)
    x = tf.constant([0.5, -1.5])

    def step():
        w.assign(w - lr * tf.sin(w) * x)

    with AssignAwareTape(persistent=True) as tape:
        unroll(step, steps=6, checkpoint_every=2)
        y = tf.reduce_sum(w * w)
    final = w.numpy().copy()
    got = {}

    def gradient():
        try:
            got["g"] = tape.gradient(y, [w, lr])
        except Exception as error:  # noqa: BLE001 - the test looks at it
            got["error"] = error

    with AssignAwareTape() as other:
        z = tf.reduce_sum(w)
        thread = threading.Thread(target=gradient)
        thread.start()
        thread.join()
    assert isinstance(got.get("error"), RecomputeError), got
    message = str(got["error"])
    assert "unroll(step)" in message and "'Variable:0'" in message and "another thread" in message
    np.testing.assert_array_equal(w.numpy(), final)
    np.testing.assert_array_equal(other.gradient(z, w).numpy(), [1.0, 1.0])
    # With no other tape open, the same gradient: the loop's (oracle: the same
    # steps under a plain tape on tensors, the assignment-free rewrite).
    w0 = tf.constant([1.0, 2.0])
    with tf.GradientTape() as plain:
        plain.watch([w0, lr])
        v = w0
        for _ in range(6):
            v = v - lr * tf.sin(v) * x
        expected = plain.gradient(tf.reduce_sum(v * v), [w0, lr])
    w.assign(final)
    for a, e in zip(tape.gradient(y, [w, lr]), expected):
        np.testing.assert_allclose(a.numpy(), e.numpy(), rtol=1e-5)


@modes
@pytest.mark.parametrize("later", [False, True], ids=["raw-only", "read-after"])
def test_raw_read_through_a_kept_handle_in_the_step_is_watched_as_in_the_loop(mode, later):
    """(f06) The step reads v only by a raw op through a handle kept from
    before: TensorFlow's rule (semantics 6d) watches nothing for it, so the
    loop's dy/dv is None (or, with v read after the step, only that read's
    3); the re-run's tape watched every touched variable up front and gave
    5.6 (8.6): it now watches only those the first run read through the
    variable. (Oracle: the loop without the wrapper.)"""

    def program(wrap):
        w = tf.Variable([1.0, 2.0])
        v = tf.Variable(0.5)
        kept = v.handle

        def step():
            r = tf.raw_ops.ReadVariableOp(resource=kept, dtype=tf.float32)
            w.assign(w * r + 0.1)

        def body():
            with AssignAwareTape() as tape:
                (checkpointed(step) if wrap else step)()
                y = tf.reduce_sum(w * w) + (v * 3.0 if later else 0.0)
            return tape.gradient(y, [v, w])

        return run(mode, body)

    expected = program(False)
    assert (expected[0] is None) == (not later)
    assert_grads_close(program(True), expected)
