"""``checkpointed`` / ``unroll`` with a tape entered again, with variables a
called ``tf.function`` changes, and the wrapper's arguments: the values and
gradients of the same calls without the wrappers (the oracle).
"""

from __future__ import annotations

import inspect

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


def _noise(kind):
    """A tf.function the step calls that changes a variable it captures by an
    op that is no write: a generator's draw, an int counter's assign_add, a
    Keras Dropout's seed generator; and how to put that state back."""
    if kind == "generator":
        gen = tf.random.Generator.from_seed(3)
        return tf.function(lambda w: w + gen.normal([2], dtype=tf.float64)), lambda: gen.reset_from_seed(3)
    if kind == "counter":
        k = tf.Variable(0, dtype=tf.int64)

        @tf.function
        def decay(w):
            k.assign_add(1)
            return w * 0.5 ** tf.cast(k, tf.float64)

        return decay, lambda: k.assign(0)
    import keras

    layer = keras.layers.Dropout(0.5, seed=5, dtype="float64")
    state = layer.seed_generator.state
    start = state.numpy()
    return tf.function(lambda w: layer(w, training=True)), lambda: state.assign(start)


@modes
@pytest.mark.parametrize("wrap", ["unroll", "checkpointed"])
@pytest.mark.parametrize("kind", ["generator", "counter", "dropout"])
def test_state_a_called_function_changes_is_copied_before_the_call(mode, wrap, kind):
    """The step calls a tf.function that changes a variable it captures (the
    documented way to carry randomness): the checkpoint has that variable's
    value from before the call, so the re-run draws the same numbers (eagerly
    the copy was taken after the call: a false RecomputeError "a state no
    variable holds"). The oracle is the loop without the wrappers."""
    noisy, reset = _noise(kind)

    def gradient(wrap):
        reset()
        w = tf.Variable([1.0, -2.0], dtype=tf.float64)
        lr = tf.Variable(0.1, dtype=tf.float64)
        x = tf.constant([0.5, -1.5], dtype=tf.float64)

        def step():
            w.assign(w - lr * tf.sin(noisy(w)) * x)

        def program():
            with AssignAwareTape() as tape:
                _segments(step, wrap)
                y = tf.reduce_sum(w * w)
            return tape.gradient(y, [w, lr])

        return run(mode, program)

    want, got = gradient("loop"), gradient(wrap)
    assert_grads_close(got, want, rtol=1e-10, atol=1e-12)


@modes
def test_arguments_by_name_are_given_by_position(mode):
    """``checkpointed(step)(x, c=...)`` calls ``step(x, b's default, c)``
    and its re-run the same (a TypeError naming ``step`` before): the
    gradient is the loop's, for a watched tensor given by name too."""
    w = tf.Variable([1.0, 2.0], dtype=tf.float64)
    lr = tf.Variable(0.1, dtype=tf.float64)
    x0 = tf.constant([0.5, -1.5], dtype=tf.float64)

    def step(x, b=2.0, c=1.0):
        w.assign(w - lr * tf.sin(w * x) * b * c)
        return tf.reduce_sum(w * x)

    def gradient(call):
        def program():
            w.assign([1.0, 2.0])
            with AssignAwareTape() as tape:
                tape.watch(x0)
                out = call(x0, c=tf.constant(3.0, tf.float64)) + call(x=x0 * 2.0)
                y = tf.reduce_sum(w * w) + out
            return tape.gradient(y, [w, lr, x0])

        return run(mode, program)

    assert_grads_close(gradient(checkpointed(step)), gradient(step), rtol=1e-10, atol=1e-12)
    # Outside every tape, the same call.
    w.assign([1.0, 2.0])
    want = float(step(x0, 2.0, 3.0))
    w.assign([1.0, 2.0])
    assert float(checkpointed(step)(x=x0, c=3.0)) == want


def test_keyword_only_arguments_are_refused_and_not_in_the_signature():
    """The wrapper passes arguments by position: a keyword-only one is a
    TypeError that says so (and what to do), and its signature lists only
    what it can pass; a name ``step`` does not take names ``checkpointed``."""

    def step(a, b=1.0, *, c=2.0):
        return a * b * c

    wrapped = checkpointed(step)
    assert list(inspect.signature(wrapped).parameters) == ["a", "b"]
    with pytest.raises(TypeError, match=r"checkpointed\(step\) passes the step's arguments by position.*\['c'\]"):
        wrapped(1.0, c=3.0)
    with pytest.raises(TypeError, match=r"checkpointed\(step\): .*'d'"):
        wrapped(1.0, d=3.0)
    assert wrapped(1.0, b=4.0) == 8.0
