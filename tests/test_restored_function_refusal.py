"""A loaded SavedModel's writing function called under an AssignAwareTape is
refused with advice that works for a restored function (no Python body to
inline; run_functions_eagerly does not make it run its body)."""

from __future__ import annotations

import pytest
import tensorflow as tf

from assigntape import AssignAwareTape, ControlFlowWriteError, UntrackedWriteError


class _Module(tf.Module):
    def __init__(self) -> None:
        self.v = tf.Variable(1.0)
        self.x = tf.Variable(2.0)

    @tf.function(input_signature=[tf.TensorSpec([], tf.float32)])
    def step(self, a):
        self.v.assign(self.v * a + self.x)
        return self.v * 2.0


@pytest.fixture
def loaded(tmp_path):
    tf.saved_model.save(_Module(), str(tmp_path))
    return tf.saved_model.load(str(tmp_path))


@pytest.mark.parametrize("eagerly", [False, True])
def test_the_refusal_says_it_is_restored_and_what_works(loaded, eagerly):
    def body():
        with AssignAwareTape() as tape:
            y = loaded.step(loaded.x * 1.0)
        return tape.gradient(y, loaded.x)

    tf.config.run_functions_eagerly(eagerly)
    try:
        with pytest.raises((ControlFlowWriteError, UntrackedWriteError)) as raised:
            tf.function(body)()
    finally:
        tf.config.run_functions_eagerly(False)
    message = str(raised.value)
    assert "restored from a SavedModel" in message and "Call it outside the tape" in message, message
    assert "undecorated" not in message and "run tf.functions eagerly:" not in message, message


def test_the_advice_works_calling_it_outside_the_tape(loaded):
    @tf.function
    def body():
        loaded.step(loaded.x * 1.0)  # v <- v * x + x = 4, outside the tape
        with AssignAwareTape() as tape:
            y = loaded.v * loaded.x
        return tape.gradient(y, loaded.x)

    # Rewrite: y = v * x with v = 4 already written, so dy/dx = v = 4.
    assert float(body()) == 4.0
