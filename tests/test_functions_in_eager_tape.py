"""An eager tape calling tf.functions: traced before the tape, inside it, or in
an earlier tape, the function reads the current version; a function that writes
a tracked variable is refused (or cut), never silently wrong."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from assigntape import AssignAwareTape, UntrackedWriteError


def _reader():
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(2.0)

    @tf.function
    def f(scale):
        return tf.reduce_sum(tf.square(v) * scale)

    return v, a, f


def _expected(a0=2.0, k=3.0, scale=0.5):
    # v = k a [1, 1] -> sum(v^2) * scale = 2 k^2 a^2 scale; d/da = 4 k^2 a scale
    return 4 * k * k * a0 * scale


@pytest.mark.parametrize("traced", ["before", "inside", "earlier_tape"])
def test_function_reads_the_current_version(traced):
    v, a, f = _reader()
    if traced == "before":
        f(tf.constant(0.5))
    if traced == "earlier_tape":
        with AssignAwareTape() as earlier:
            v.assign(a * tf.ones([2]))
            f(tf.constant(0.5))
        assert earlier.gradient(f(tf.constant(0.5)), a) is None  # outside the context
    with AssignAwareTape() as tape:
        v.assign(3.0 * a * tf.ones([2]))
        y = f(tf.constant(0.5))
    np.testing.assert_allclose(float(y), 2 * 36.0 * 0.5)
    np.testing.assert_allclose(float(tape.gradient(y, a)), _expected())
    assert f.experimental_get_tracing_count() == 1  # versions do not retrace


def test_function_taking_the_variable_as_an_argument():
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(2.0)

    @tf.function
    def f(x):
        return tf.reduce_sum(x * 7.0)

    f(v)
    with AssignAwareTape() as tape:
        v.assign(a * tf.ones([2]))
        y = f(v)
    assert float(tape.gradient(y, a)) == 14.0


def test_function_that_writes_a_tracked_variable_is_refused():
    v, a = tf.Variable([1.0, 2.0], name="written_in_fn"), tf.Variable(2.0)

    @tf.function
    def step():
        v.assign_add(tf.ones([2]))
        return tf.reduce_sum(v)

    step()
    with AssignAwareTape() as tape:
        v.assign(a * tf.ones([2]))
        before = v.numpy()
        with pytest.raises(UntrackedWriteError) as info:
            step()
        np.testing.assert_array_equal(v.numpy(), before)  # refused before running
        loss = tf.reduce_sum(v)
    message = str(info.value)
    assert "written_in_fn" in message and "step" in message and "inside the function" in message
    assert float(tape.gradient(loss, a)) == 2.0


def _nested_writers(v):
    """Functions that write ``v`` only through what they call (or through
    an identity of its handle)."""

    @tf.function
    def inner():
        v.assign_add(tf.ones([2]))

    @tf.function
    def calls_a_function():
        inner()
        return tf.reduce_sum(v)

    @tf.function
    def calls_it_two_deep():
        calls_a_function()
        return tf.constant(0.0)

    @tf.function
    def writes_in_a_cond(flag):
        if flag > 0:  # autograph: a tf.cond whose branch writes
            v.assign_add(tf.ones([2]))
        return tf.reduce_sum(v)

    @tf.function
    def writes_in_a_loop(n):
        for _ in tf.range(n):
            v.assign_add(tf.ones([2]))
        return tf.reduce_sum(v)

    @tf.function
    def writes_through_an_identity():
        # (Its handle passed on, then written by a raw op: was not seen.)
        tf.raw_ops.AssignVariableOp(resource=tf.identity(v.handle), value=v + 1.0)
        return tf.reduce_sum(v)

    return {
        "writes_through_an_identity": lambda: writes_through_an_identity(),
        "calls_a_function": lambda: calls_a_function(),
        "calls_it_two_deep": lambda: calls_it_two_deep(),
        "writes_in_a_cond": lambda: writes_in_a_cond(tf.constant(1)),
        "writes_in_a_loop": lambda: writes_in_a_loop(tf.constant(2)),
    }


@pytest.mark.parametrize(
    "name",
    ["writes_through_an_identity", "calls_a_function", "calls_it_two_deep", "writes_in_a_cond", "writes_in_a_loop"],
)
def test_writes_nested_in_called_functions_are_refused(name):
    v, a = tf.Variable([1.0, 2.0], name="nested_write"), tf.Variable(2.0)
    call = _nested_writers(v)[name]
    call()  # traced before the tape
    with AssignAwareTape() as tape:
        v.assign(a * tf.ones([2]))
        before = v.numpy()
        with pytest.raises(UntrackedWriteError, match="nested_write"):
            call()
        np.testing.assert_array_equal(v.numpy(), before)  # refused before running
        loss = tf.reduce_sum(v)
    assert float(tape.gradient(loss, a)) == 2.0


def test_nested_function_that_only_reads_is_not_refused():
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(2.0)

    @tf.function
    def inner():
        return tf.reduce_sum(v * v)

    @tf.function
    def outer():
        return inner() + 1.0

    outer()
    with AssignAwareTape() as tape:
        v.assign(a * tf.ones([2]))
        loss = outer()  # reads the current version, through the nested call
    assert float(tape.gradient(loss, a)) == 8.0  # d (2 a^2) / da = 4 a


def test_function_write_cut_by_option():
    v, a = tf.Variable([1.0, 2.0], name="cut_in_fn"), tf.Variable(2.0)

    @tf.function
    def step():
        v.assign_add(tf.ones([2]))

    with AssignAwareTape(untracked_writes="cut") as tape:
        v.assign(a * tf.ones([2]))
        with pytest.warns(UserWarning, match="cut_in_fn"):
            step()
        loss = tf.reduce_sum(v * a)
    np.testing.assert_array_equal(v.numpy(), [3.0, 3.0])
    assert len(tape.versions(v)) == 3
    assert float(tape.gradient(loss, a)) == 6.0  # only the read after the cut


def test_function_writing_a_variable_the_tape_has_not_seen_is_refused():
    # The tape cannot see into the function, and the variable's value after it
    # may depend on what the tape watches (here v := 4x): a later read would be
    # credited to the start value, so the call is refused like any other write.
    x, v = tf.Variable(2.0), tf.Variable(3.0, name="unseen")

    @tf.function
    def write():
        v.assign(x * 4.0)

    with AssignAwareTape() as tape:
        x.assign_add(0.0)
        with pytest.raises(UntrackedWriteError, match="unseen") as info:
            write()
        assert "write" in str(info.value)
    assert float(v) == 3.0  # refused before the function ran
    assert tape.versions(v) == (v.handle,)


def test_function_writing_an_unseen_variable_with_cut_makes_a_version_without_gradient():
    counter, v, a = tf.Variable(0.0), tf.Variable(1.0), tf.Variable(2.0)

    @tf.function
    def bump():
        counter.assign_add(a)

    with pytest.warns(UserWarning, match="untracked_writes='cut'"):
        with AssignAwareTape(untracked_writes="cut") as tape:
            v.assign(a * 3.0)
            bump()
            loss = v * 1.0 + counter * 5.0
    assert float(counter) == 2.0 and len(tape.versions(counter)) == 2
    # The counter's new version has no gradient path; v's write keeps its own.
    assert float(tape.gradient(loss, a)) == 3.0


def test_keras_model_called_through_a_function():
    import keras

    layer = keras.layers.Dense(2)
    x = tf.ones([3, 4])
    layer(x)
    z = tf.Variable(tf.fill([4, 2], 0.1))
    call = tf.function(lambda inputs: tf.reduce_sum(layer(inputs) ** 2))
    call(x)
    with AssignAwareTape() as tape:
        layer.kernel.assign(z * 2.0)
        loss = call(x)
    z0 = tf.constant(z.numpy())
    with tf.GradientTape() as oracle:
        oracle.watch(z0)
        expected = tf.reduce_sum((x @ (z0 * 2.0) + layer.bias) ** 2)
    np.testing.assert_allclose(tape.gradient(loss, z), oracle.gradient(expected, z0), rtol=1e-5)


def test_function_reading_with_a_raw_op_is_remapped():
    # The variable is not in the function's graph.variables: the capture alone
    # says which variable it reads.
    x, v = tf.Variable(2.0), tf.Variable(3.0)

    @tf.function
    def read_raw():
        return tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32) * 1.0

    read_raw()  # traced before the tape
    with AssignAwareTape() as tape:
        v.assign(x * 6.0)
        y = read_raw()
    assert float(y) == 12.0 and float(tape.gradient(y, x)) == 6.0


# A tf.function that makes its variable on its first call, called first under
# an eager tape: the variable's initialization is creation, not a write
# (semantics, rule 5), whether TensorFlow lifts it out of the trace (an
# ``initialize_variables`` function of its own) or, when the initial value
# depends on an argument, runs it in a cond in the call. Both were refused as
# a function that writes, and the variable stayed uninitialized for good.
# Rewrite: w a new variable (its initial value not differentiated); y = x w.


class _LazyScale(tf.Module):
    def __init__(self, from_argument: bool) -> None:
        self.w = None
        self.from_argument = from_argument

    @tf.function
    def __call__(self, x):
        if self.w is None:
            self.w = tf.Variable(x * 2.0 if self.from_argument else 2.0)
        return x * self.w


@pytest.mark.parametrize("from_argument", [False, True], ids=["lifted", "in_the_call"])
def test_a_function_making_its_variable_on_its_first_call_under_an_eager_tape(from_argument):
    module, x = _LazyScale(from_argument), tf.Variable(3.0)
    with AssignAwareTape() as tape:
        y = module(x)
    w = 6.0 if from_argument else 2.0
    assert float(y) == 3.0 * w and float(tape.gradient(y, x)) == w
    assert float(module(tf.constant(1.0))) == w  # outside every tape, later


def test_a_keras_layer_built_in_its_first_call_of_a_function_under_an_eager_tape():
    import keras

    layer = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")
    apply = tf.function(lambda x: layer(x))
    x = tf.Variable([[1.0, 2.0]])
    with AssignAwareTape() as tape:
        y = tf.reduce_sum(apply(x))
    # y = x . kernel + bias with kernel ones: 3, dy/dx = kernel^T = [1, 1].
    assert float(y) == 3.0
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), [[1.0, 1.0]])
    np.testing.assert_array_equal(apply(tf.constant([[1.0, 1.0]])).numpy(), [[2.0]])


def test_an_initial_value_computed_by_writing_another_variable_is_that_variables_write():
    # Only the new variable's own initialization is creation: w.assign(x) in
    # its initial value is a write of w, made in a function called from the
    # eager tape: refused (it passed, and dy/dx was 3 for the rewrite's 6).
    w, x, holder = tf.Variable(2.0), tf.Variable(3.0), []

    @tf.function
    def make():
        if not holder:
            holder.append(tf.Variable(lambda: w.assign(x * 1.0) * 1.0))
        return holder[0] * 1.0

    with pytest.raises(UntrackedWriteError, match="writes variable"):
        with AssignAwareTape():
            make()
    assert float(w) == 2.0
