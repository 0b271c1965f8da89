"""``checkpointed`` steps and ``unroll``: the same values and gradients as the loop without them.

Each case runs K inner Keras steps (a forward pass, a plain tape's gradient,
``apply_gradients``) inside an ``AssignAwareTape`` and differentiates a
validation loss (plus the last step's returned loss) with respect to the
learning rate (a ``tf.Variable`` behind a callable) and the initial weights.
The oracle is the same loop without the wrappers under ``AssignAwareTape``;
for SGD also the assignment-free rewrite under a plain ``tf.GradientTape``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape, RecomputeError, checkpointed, unroll

RTOL = {"float32": (1e-5, 1e-6), "float64": (1e-10, 1e-12)}
X = np.linspace(-1.0, 1.0, 24).reshape(8, 3)
Y = np.sin(X.sum(axis=1, keepdims=True))
XV, YV = X[::-1] * 0.5, Y[::-1]


def _initial(bn):
    rng = np.random.default_rng(7)
    ws = [rng.normal(size=(3, 4)) * 0.5, rng.normal(size=(4,)) * 0.1]
    if bn:
        ws += [np.ones(4), np.zeros(4), np.zeros(4), np.ones(4)]
    return ws + [rng.normal(size=(4, 1)) * 0.5, np.zeros((1,))]


def _setup(opt_name, dtype, bn=False, lr0=0.05):
    layers = [keras.Input((3,), dtype=dtype), keras.layers.Dense(4, activation="tanh", dtype=dtype)]
    if bn:
        layers.append(keras.layers.BatchNormalization(dtype=dtype, momentum=0.8))
    layers.append(keras.layers.Dense(1, dtype=dtype))
    model = keras.Sequential(layers)
    model.set_weights(_initial(bn))
    lr_var = tf.Variable(lr0, dtype=dtype)
    lr = lambda: lr_var  # noqa: E731  Keras 3 rejects a tf.Variable learning rate
    opt = {
        "sgd": lambda: keras.optimizers.SGD(learning_rate=lr),
        "momentum": lambda: keras.optimizers.SGD(learning_rate=lr, momentum=0.9),
        # (epsilon 1e-3: with Keras' 1e-7, Adam's first steps divide by the
        # root of second moments near 0 and the hypergradient is so ill
        # conditioned that the same loop eager and compiled differ at 1e-6.)
        "adam": lambda: keras.optimizers.Adam(learning_rate=lr, epsilon=1e-3),
    }[opt_name]()
    opt.build(model.trainable_variables)
    return model, lr_var, opt


def _meta(opt_name, dtype, how, k, every=None, bn=False, truncate=None):
    """The program: K steps made ``how`` ("loop", "checkpointed", "unroll"),
    then the validation loss; its value, gradients and the variables after."""
    model, lr_var, opt = _setup(opt_name, dtype, bn)
    x, y = tf.constant(X, dtype), tf.constant(Y, dtype)
    xv, yv = tf.constant(XV, dtype), tf.constant(YV, dtype)
    weights = model.trainable_variables

    def step():
        with tf.GradientTape() as inner:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = inner.gradient(loss, weights)
        opt.apply_gradients(zip(grads, weights))
        return loss

    def program():
        with AssignAwareTape() as tape:
            if how == "loop":
                last = None
                if truncate is not None:
                    with tape.stop_recording():
                        for _ in range(k - truncate):
                            last = step()
                for _ in range(k if truncate is None else truncate):
                    last = step()
            elif how == "checkpointed":
                wrapped = checkpointed(step)
                for _ in range(k):
                    last = wrapped()
            else:
                last = unroll(step, k, checkpoint_every=every, truncate=truncate)
            val = tf.reduce_mean((model(xv, training=False) - yv) ** 2) + 0.1 * last
        return val, tape.gradient(val, [lr_var, *[w.value for w in weights]])

    return program, model, opt


def _compare(mode, opt_name, dtype, how, k, every=None, bn=False, truncate=None):
    program, model, opt = _meta(opt_name, dtype, "loop", k, bn=bn, truncate=truncate)
    expected = run(mode, program)
    expected_state = [v.numpy() for v in model.variables + opt.variables]
    program, model, opt = _meta(opt_name, dtype, how, k, every, bn=bn, truncate=truncate)
    actual = run(mode, program)
    rtol, atol = RTOL[dtype]
    assert_grads_close(actual, expected, rtol=rtol, atol=atol)
    for a, e in zip([v.numpy() for v in model.variables + opt.variables], expected_state):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)
    return actual


@modes
@pytest.mark.parametrize("opt_name", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_checkpointed_steps_equal_the_loop(mode, opt_name, dtype):
    _compare(mode, opt_name, dtype, "checkpointed", 3)


@modes
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_batch_normalization_moving_statistics(mode, opt_name):
    _compare(mode, opt_name, "float64", "checkpointed", 3, bn=True)
    _compare(mode, opt_name, "float64", "unroll", 7, every=3, bn=True)


# -- what a re-run reproduces, and what is refused --------------------------------


def _dropout_program(how, mode_seed):
    """A step with dropout drawn from state held in a variable: Keras 3's
    SeedGenerator, or a tf.random.Generator."""
    w = tf.Variable(np.linspace(-1.0, 1.0, 12).reshape(3, 4), dtype="float64")
    lr = tf.Variable(0.1, dtype="float64")
    x = tf.constant(X, "float64")
    if mode_seed == "keras":
        layer = keras.layers.Dropout(0.5, seed=11, dtype="float64")

        def drop(h):
            return layer(h, training=True)
    else:
        gen = tf.random.Generator.from_seed(11)

        def drop(h):
            return h * tf.cast(gen.uniform(tf.shape(h), dtype=tf.float64) > 0.5, tf.float64) * 2.0

    def step():
        with tf.GradientTape() as inner:
            loss = tf.reduce_mean(drop(tf.tanh(tf.matmul(x, w))) ** 2)
        w.assign_sub(lr * inner.gradient(loss, w))
        return loss

    def program():
        with AssignAwareTape() as tape:
            if how == "loop":
                for _ in range(4):
                    last = step()
            else:
                last = unroll(step, 4, checkpoint_every=3)
            val = tf.reduce_sum(w) + last
        return val, tape.gradient(val, [lr, w])

    return program


@modes
@pytest.mark.parametrize("source", ["keras", "generator"])
def test_randomness_held_in_a_variable_is_drawn_again_the_same(mode, source):
    expected = run(mode, _dropout_program("loop", source))
    actual = run(mode, _dropout_program("unroll", source))
    assert_grads_close(actual, expected, rtol=1e-10, atol=1e-12)


@modes
def test_random_op_without_a_generator_is_refused(mode):
    w = tf.Variable(1.0)

    def step():
        w.assign(w * 2.0)  # written, then put back by the refusal
        return w.assign(w * tf.random.uniform([]))

    def program():
        with AssignAwareTape() as tape:
            checkpointed(step)()
        return tape

    with pytest.raises(RecomputeError, match="RandomUniform"):
        run(mode, program)
    assert float(w) == 1.0


def test_variable_created_in_the_step_is_refused():
    w = tf.Variable(1.0)
    made = []

    def step():
        made.append(tf.Variable(2.0, name="inside"))
        return w.assign(w * made[-1])

    with AssignAwareTape():
        with pytest.raises(RecomputeError, match="created a variable.*inside"):
            checkpointed(step)()


def test_python_side_effect_changing_what_the_rerun_touches_is_refused():
    a, b = tf.Variable(1.0, name="a"), tf.Variable(2.0, name="b")
    w = tf.Variable(3.0, name="w")
    calls = []

    def step():
        calls.append(1)
        source = a if len(calls) == 1 else b  # the re-run reads another variable
        return w.assign(w * source)

    with AssignAwareTape() as tape:
        loss = checkpointed(step)() * 1.0
    with pytest.raises(RecomputeError, match="'b:0'"):
        tape.gradient(loss, a)


def test_plain_tape_recording_around_is_refused():
    w = tf.Variable(1.0)
    with tf.GradientTape(), AssignAwareTape():
        with pytest.raises(RecomputeError, match="plain tf.GradientTape"):
            checkpointed(lambda: w.assign(2.0 * w))()
    assert float(w) == 1.0


def test_tensor_steps_are_refused():
    @tf.function
    def program(n):
        with AssignAwareTape():
            unroll(lambda: None, n)

    with pytest.raises(RecomputeError, match="Python int"):
        program(tf.constant(3))


def test_write_from_another_thread_during_the_step_is_refused():
    import threading

    from assigntape import AssignTapeError

    w = tf.Variable(1.0, name="w_thread")
    errors = []

    def other():
        try:
            w.assign(5.0)
        except AssignTapeError as error:
            errors.append(error)

    def step():
        value = w.assign(2.0 * w)
        t = threading.Thread(target=other)
        t.start()
        t.join()
        return value

    with AssignAwareTape():
        checkpointed(step)()
    assert errors and float(w) == 2.0


@modes
def test_tensor_arguments_are_differentiated(mode):
    """A watched tensor reaches the step as an argument (one it closed over
    would be a constant to it)."""

    def program(wrap):
        w = tf.Variable(2.0, dtype="float64")

        def body():
            x = tf.constant(3.0, "float64")
            with AssignAwareTape() as tape:
                tape.watch(x)
                out = wrap(lambda t: w.assign(w * t) * t)(x)
                loss = out + w
            return tape.gradient(loss, [x, w])

        return body

    expected = run(mode, program(lambda f: f))
    actual = run(mode, program(checkpointed))
    assert_grads_close(actual, expected, rtol=1e-12, atol=0)


@modes
def test_watched_tensor_the_step_closes_over_is_refused(mode):
    w = tf.Variable(2.0)

    def program():
        x = tf.constant(3.0)
        with AssignAwareTape() as tape:
            tape.watch(x)
            y = x * 2.0
            checkpointed(lambda: w.assign(w * y))()

    with pytest.raises(RecomputeError, match="closes over"):
        run(mode, program)


def test_forward_accumulator_around_is_refused():
    from assigntape import ForwardAccumulator

    w, x = tf.Variable(1.0), tf.constant(2.0)
    with ForwardAccumulator(x, tf.constant(1.0)), AssignAwareTape():
        with pytest.raises(RecomputeError, match="ForwardAccumulator"):
            checkpointed(lambda: w.assign(x * w))()
    assert float(w) == 1.0


def test_docstring_examples():
    import doctest

    from assigntape import _checkpoint, _unroll

    globs = {"tf": tf, "AssignAwareTape": AssignAwareTape, "checkpointed": checkpointed, "unroll": unroll}
    for module in (_checkpoint, _unroll):
        failures, tried = doctest.testmod(module, globs=globs)
        assert tried >= 1 and failures == 0


def test_refusal_leaves_the_tape_as_before_the_step():
    w = tf.Variable(1.0)
    with AssignAwareTape() as tape:
        w.assign(3.0 * w)
        with pytest.raises(RecomputeError):
            checkpointed(lambda: [w.assign(w * 2.0), tf.random.normal([])])()
        loss = w * 1.0
    assert float(loss) == 3.0 and len(tape.versions(w)) == 2
    assert float(tape.gradient(loss, w)) == 3.0


# --- the re-run is not the same computation: refused, never a different gradient


@tf.function
def _noise():
    return tf.random.uniform([])


@modes
def test_random_op_in_a_function_traced_before_is_refused(mode):
    _noise()  # traced before the step: its op callback sees only the call
    w = tf.Variable(1.0)

    def program():
        with AssignAwareTape():
            checkpointed(lambda: w.assign(w * (1.0 + _noise())))()

    with pytest.raises(RecomputeError, match=r"RandomUniform \(in "):
        run(mode, program)


@modes
def test_candidate_sampler_is_refused(mode):
    w = tf.Variable(tf.ones([10, 1], tf.float64))

    def step():
        s, _, _ = tf.random.uniform_candidate_sampler(tf.zeros([1, 1], tf.int64), 1, 3, True, 10)
        return w.assign(w + tf.scatter_nd(s[:, None], tf.ones([3, 1], tf.float64), [10, 1]))

    def program():
        with AssignAwareTape():
            checkpointed(step)()

    with pytest.raises(RecomputeError, match="UniformCandidateSampler"):
        run(mode, program)


@modes
def test_next_of_an_iterator_made_before_the_step_is_refused(mode):
    it = iter(tf.data.Dataset.range(1, 9).map(lambda i: tf.cast(i, tf.float64)).repeat())
    w = tf.Variable(1.0, dtype=tf.float64)

    def program():
        with AssignAwareTape():
            unroll(lambda: w.assign_sub(0.1 * next(it) * w), 2, checkpoint_every=2)

    with pytest.raises(RecomputeError, match="IteratorGetNext"):
        run(mode, program)


def test_rerun_computing_another_value_fails_the_gradient_eagerly():
    # A Python side effect the up-front checks cannot see: the re-run
    # multiplies by another number. Without the check the gradient would be
    # that of w * 2 (2.0); the loop's is 1.0 (w * 1).
    w = tf.Variable(3.0, name="w")
    calls = []

    def step():
        calls.append(1)
        return w.assign(w * float(len(calls)))

    with AssignAwareTape() as tape:
        checkpointed(step)()
        loss = w * 1.0
    with pytest.raises(RecomputeError, match="computed another value of the variable 'w"):
        tape.gradient(loss, w)


def test_rerun_computing_another_value_fails_the_gradient_in_a_function():
    w = tf.Variable(3.0, name="w")
    calls = []

    def step():
        calls.append(1)  # at trace time: the re-run is traced with another constant
        return w.assign(w * float(len(calls)))

    @tf.function
    def program():
        with AssignAwareTape() as tape:
            out = checkpointed(step)()
            loss = w * 1.0 + out
        return tape.gradient(loss, w)

    with pytest.raises(tf.errors.InvalidArgumentError, match="computed another value of the variable"):
        program()


# --- segments inside graph control flow: refused, naming the body


@pytest.mark.parametrize("body", ["cond", "loop"])
def test_segment_inside_a_graph_cond_or_loop_is_refused(body):
    w = tf.Variable([1.0, 2.0], dtype=tf.float64)
    step = checkpointed(lambda: tf.reduce_sum(w.assign_sub(0.1 * w**2)))

    @tf.function
    def program(p):
        with AssignAwareTape():
            if body == "cond":
                tf.cond(p > 0, step, lambda: tf.constant(0.0, tf.float64))
            else:
                for _ in tf.range(p):
                    step()

    with pytest.raises(RecomputeError, match="tf.cond branch" if body == "cond" else "loop body"):
        program(tf.constant(2))


# --- returned tensors the step did not make: themselves, not the op's outputs


@modes
@pytest.mark.parametrize("returned", ["argument", "closed_over"])
def test_tensor_from_before_the_step_returned_as_is(mode, returned):
    w = tf.Variable(2.0)

    def program(wrap):
        def body():
            x = tf.constant(3.0)
            with AssignAwareTape() as tape:
                tape.watch(x)
                s = 3.0 * x

                def step(a):
                    w.assign_sub(0.1 * w * a)
                    return a if returned == "argument" else s

                r = wrap(step)(x)
                loss = r * w
            out = tape.gradient(loss, [x, w])
            w.assign(2.0)
            return out

        return body

    expected = run(mode, program(lambda f: f))
    actual = run(mode, program(checkpointed))
    assert_grads_close(actual, expected, rtol=1e-6, atol=0)


# --- what the step made or was given, and what it closes over


@pytest.mark.parametrize("layer", ["tf_keras_dense", "tanh"])
def test_variable_passed_to_an_op_in_an_inner_tape_is_not_refused(layer):
    # The read TensorFlow's C fast path makes of a variable passed to an op
    # (tf.nn.bias_add, tf.tanh) is made in the step, though no op callback
    # sees it: not a watched tensor the step closes over.
    import tf_keras

    def program(wrap):
        dense = tf_keras.layers.Dense(2)
        dense.build((None, 2))
        dense.set_weights([np.array([[0.3, -0.2], [0.5, 0.1]], np.float32), np.array([0.1, -0.3], np.float32)])
        x, lr = tf.ones([4, 2]), tf.Variable(0.1)
        f = dense if layer == "tf_keras_dense" else lambda x: tf.tanh(dense.bias) * x
        ws = dense.trainable_variables

        def step():
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(f(x) ** 2)
            for v, g in zip(ws, inner.gradient(loss, ws)):
                if g is not None:
                    v.assign_sub(lr * g)

        with AssignAwareTape() as tape:
            wrap(step)()
            y = tf.reduce_sum(f(x))
        return y, tape.gradient(y, [lr, *ws])

    assert_grads_close(program(checkpointed), program(lambda f: f), rtol=1e-6, atol=1e-7)


@modes
def test_watched_tensor_a_called_function_captures_is_refused(mode):
    x = tf.constant(2.0, tf.float64)
    v = tf.Variable(1.0, dtype=tf.float64)

    def program():
        with AssignAwareTape() as tape:
            tape.watch(x)
            xs = x * 1.0
            use = tf.function(lambda: xs * 3.0)
            checkpointed(lambda: v.assign(v * use()))()

    with pytest.raises(RecomputeError, match="closes over"):
        run(mode, program)


@pytest.mark.parametrize("write_between", [False, True], ids=["reentered", "written-while-closed"])
def test_a_tape_entered_again_between_segments_goes_on_from_its_versions(write_between):
    """A persistent tape exited and entered again between two steps: the
    second segment starts from the version the tape goes on from (the first
    segment's), or, after a write while it was closed, from a version with no
    gradient path (rule 7), as the loop without the wrapper does. The loop is
    the oracle; with no write between, dlr also equals finite differences of
    w <- w - lr w^2 twice, y = sum(w^2): -16.86258."""

    def run(wrap):
        w = tf.Variable([1.0, 2.0], dtype=tf.float64)
        lr = tf.Variable(0.1, dtype=tf.float64)

        def step():
            w.assign_sub(lr * w**2)

        call = checkpointed(step) if wrap else step
        tape = AssignAwareTape(persistent=True)
        with tape:
            call()
        if write_between:
            w.assign(w * 2.0)
        with tape:
            call()
            y = tf.reduce_sum(w**2)
        return tape.gradient(y, [w, lr])

    want, got = run(False), run(True)
    for g_want, g_got in zip(want, got):
        assert (g_want is None) == (g_got is None)
        if g_want is not None:
            np.testing.assert_allclose(g_got.numpy(), g_want.numpy(), rtol=1e-10)
    if not write_between:
        np.testing.assert_allclose(got[1].numpy(), -16.86258, rtol=1e-6)
