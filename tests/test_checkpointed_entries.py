"""``checkpointed`` / ``unroll`` with a tape entered again, with variables a
called ``tf.function`` changes, and the wrapper's arguments: the values and
gradients of the same calls without the wrappers (the oracle).
"""

from __future__ import annotations

import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape, checkpointed, unroll


def _segments(step, wrap):
    if wrap == "unroll":
        unroll(step, steps=4, checkpoint_every=2)
    elif wrap == "checkpointed":
        for _ in range(4):
            checkpointed(step)()
    else:
        for _ in range(4):
            step()


@modes
@pytest.mark.parametrize("wrap", ["unroll", "checkpointed"])
@pytest.mark.parametrize("entries", [2, 3])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "non-persistent"])
@pytest.mark.parametrize(
    "how", ["closed", "closed+w", "stop_recording", "other_tape", "other_tape+w", "inner_tape", "none"]
)
def test_tape_entered_again_after_a_write_of_a_variable_the_step_reads(mode, wrap, entries, persistent, how):
    """A tape entered again; before each later entry's segments ``lr``,
    which the step only reads (``+w``: and ``w``, which it writes), is
    written (while the tape is closed, under its stop_recording, under
    another tape while it is closed, under an inner tape of it, or not at
    all): a segment whose first read of ``lr`` resolved such a write (rule 6)
    is not a step that writes ``lr`` (its re-run was refused, a false
    RecomputeError "a Python side effect"). The oracle is the loop without
    the wrappers."""

    def gradient(wrap):
        w = tf.Variable([1.0, 2.0], dtype=tf.float64)
        lr = tf.Variable(0.1, dtype=tf.float64)
        x = tf.constant([0.5, -1.5], dtype=tf.float64)

        def step():
            w.assign(w - lr * tf.sin(w) * x)

        return run(mode, lambda: program(wrap, w, lr, step))

    def program(wrap, w, lr, step):
        def write():
            lr.assign(lr * 3.0)
            if how.endswith("+w"):
                w.assign(w * 0.5)

        tape = AssignAwareTape(persistent=persistent)
        for entry in range(entries):
            if entry and how.startswith("closed"):
                write()
            elif entry and how.startswith("other_tape"):
                with AssignAwareTape():
                    write()
            with tape:
                if entry and how == "stop_recording":
                    with tape.stop_recording():
                        write()
                elif entry and how == "inner_tape":
                    with AssignAwareTape():
                        write()
                _segments(step, wrap)
                if entry == entries - 1:
                    y = tf.reduce_sum(w * w) * lr
        return tape.gradient(y, [w, lr])

    want, got = gradient("loop"), gradient(wrap)
    assert_grads_close(got, want, rtol=1e-10, atol=1e-12)
