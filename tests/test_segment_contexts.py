"""``checkpointed`` / ``unroll`` crossed with contexts: graph control flow in
a step, ops TensorFlow declares stateful that are deterministic, XLA, a
loaded SavedModel's function, MirroredStrategy replicas (issue #39, the
fourth adversary's findings f01..f06).

The oracle is the same program without the wrappers (the loop) in the same
mode, and for the small variable programs the assignment-free rewrite on
tensors under a plain ``tf.GradientTape``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import helper_output
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape, RecomputeError, checkpointed, unroll

W0 = [1.0, 2.0]


def _cond_reads(w, lr):
    return w.assign_sub(lr * tf.cond(tf.reduce_sum(w) > 0, lambda: 2.0 * w, lambda: -w))


def _cond_writes(w, lr):
    return tf.cond(tf.reduce_sum(w) > 0, lambda: w.assign_sub(lr * 2.0 * w), lambda: w.assign_add(lr * w))


def _while_reads(w, lr):
    twice = tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, a + w), (0, tf.zeros(2)))[1]
    return w.assign_sub(lr * twice)


def _map_fn_reads(w, lr):
    # (the body reads the variable: TensorFlow's map_fn is a while loop)
    return w.assign_sub(lr * tf.map_fn(lambda i: 2.0 * w[i], tf.range(2), fn_output_signature=tf.float32))


def _check_numerics(w, lr):
    return w.assign_sub(lr * 2.0 * tf.debugging.check_numerics(w, "w"))


def _dataset_in_step(w, lr):
    # A dataset made in the step (a TensorSliceDataset / RangeDataset source,
    # stateful in its op_def) is made again the same by the re-run.
    total = tf.data.Dataset.range(3).reduce(tf.constant(0, tf.int64), lambda a, b: a + b)
    return w.assign_sub(lr * 2.0 * w * tf.cast(total, tf.float32) / 3.0)


TWO = tf.data.Dataset.from_tensors(2.0)  # made before any step


def _single_element_of_a_dataset_made_before(w, lr):
    # (DatasetToSingleElement: stateful in its op_def, a value of the dataset)
    return w.assign_sub(lr * TWO.get_single_element() * w)


STEPS = {
    "cond_reads": _cond_reads,
    "cond_writes": _cond_writes,
    "while_reads": _while_reads,
    "map_fn_reads": _map_fn_reads,
    "check_numerics": _check_numerics,
    "dataset_in_step": _dataset_in_step,
    "single_element": _single_element_of_a_dataset_made_before,
}


def _program(step, wrap):
    w, lr = tf.Variable(W0), tf.Variable(0.1)

    def body():
        with AssignAwareTape() as tape:
            if wrap:
                unroll(lambda: step(w, lr), 3, checkpoint_every=2)
            else:
                for _ in range(3):
                    step(w, lr)
            y = tf.reduce_sum(w**2)
        return y, tape.gradient(y, lr)

    return body


@modes
@pytest.mark.parametrize("name", list(STEPS))
def test_control_flow_and_deterministic_stateful_ops_in_a_step(mode, name):
    # Each step is w <- w - 2 lr w (every branch taken is the first, the loop
    # adds w twice, the dataset's sum 0+1+2 is 3): the rewrite on tensors.
    with tf.GradientTape() as plain:
        lr = tf.constant(0.1)
        plain.watch(lr)
        w = tf.constant(W0)
        for _ in range(3):
            w = w - lr * 2.0 * w
        y = tf.reduce_sum(w**2)
    rewrite = (y, plain.gradient(y, lr))
    loop = run(mode, _program(STEPS[name], False))
    got = run(mode, _program(STEPS[name], True))
    assert_grads_close(got, loop, rtol=1e-5)
    assert_grads_close(got, rewrite, rtol=1e-5)


@pytest.mark.parametrize("which", ["accumulation", "loss_scale"])
def test_keras_optimizers_whose_update_is_a_cond_compiled(which):
    """The long-unrolls page's program in a tf.function, with an optimizer
    whose update is a tf.cond (f03)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    lr = tf.Variable(0.05)
    sgd = lambda **k: keras.optimizers.SGD(learning_rate=lambda: lr, momentum=0.9, **k)  # noqa: E731
    opt = sgd(gradient_accumulation_steps=2) if which == "accumulation" else keras.optimizers.LossScaleOptimizer(sgd())
    opt.build(model.trainable_variables)
    state = list(model.variables) + list(opt.variables)
    init = [v.numpy() for v in state]
    x = tf.constant(np.linspace(-1, 1, 24).reshape(8, 3), tf.float32)
    y = tf.sin(tf.reduce_sum(x, 1, keepdims=True))

    def step():
        with tf.GradientTape() as inner:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(zip(inner.gradient(loss, model.trainable_variables), model.trainable_variables))

    def program(wrap):
        def body():
            with AssignAwareTape() as tape:
                if wrap:
                    unroll(step, 4)
                else:
                    for _ in range(4):
                        step()
                val = tf.reduce_mean((model(x) - y) ** 2)
            return val, tape.gradient(val, [lr, *model.trainable_variables])

        for v, a in zip(state, init):
            v.assign(a)
        return tf.function(body)()

    assert_grads_close(program(True), program(False), rtol=1e-5)


@modes
@pytest.mark.parametrize("op", ["random_uniform", "random_in_a_cond", "random_dataset"])
def test_random_ops_are_still_refused(mode, op):
    w, lr = tf.Variable(W0), tf.Variable(0.1)
    draw = {
        "random_uniform": lambda: tf.random.uniform([2]),
        "random_in_a_cond": lambda: tf.cond(lr > 0, lambda: tf.random.uniform([2]), lambda: tf.zeros(2)),
        "random_dataset": lambda: tf.cast(next(iter(tf.data.Dataset.random().take(1))) % 2, tf.float32) * w,
    }[op]

    def body():
        with AssignAwareTape():
            unroll(lambda: w.assign_sub(lr * draw()), 2)

    expected = "RandomDataset" if op == "random_dataset" else "RandomUniform"
    with pytest.raises(RecomputeError, match=expected):
        run(mode, body)


@pytest.mark.parametrize("compiled", ["jit_compile", "by_an_outer_jit_compile"])
@pytest.mark.parametrize("differs", [True, False])
def test_rerun_computing_another_value_under_xla_gives_nan_gradients(differs, compiled):
    """XLA drops assertions: where the re-run computes another value (a
    Python counter read at trace time), every element of every gradient
    through the segment is NaN instead (f01). The run's own gradient would be
    d(w - lr*1*w)/dlr = -w0 = -2 and the re-run's -4: neither is given. Also
    for a function traced without XLA, then called (its trace reused) by a
    ``jit_compile`` function: nothing in its trace knew it (were -4, 0.8)."""
    w, lr = tf.Variable(2.0), tf.Variable(0.1)
    calls = []

    def step():
        calls.append(1)
        w.assign_sub(lr * float(len(calls) if differs else 1) * w)

    @tf.function(jit_compile=compiled == "jit_compile")
    def program():
        with AssignAwareTape() as tape:
            checkpointed(step)()
            y = w * 1.0
        return y, tape.gradient(y, [lr, w])

    if compiled == "by_an_outer_jit_compile":
        inner = program
        inner.get_concrete_function()  # traced without XLA
        program = tf.function(lambda: inner(), jit_compile=True)
    y, (d_lr, d_w) = program()
    assert float(y) == pytest.approx(1.8)  # the first run: 2 - 0.1 * 1 * 2
    if differs:
        assert np.isnan(d_lr.numpy()) and np.isnan(d_w.numpy())
    else:  # d/dlr of w0 (1 - lr) at the start: -w0; d/dw0: 1 - lr
        assert_grads_close([d_lr, d_w], [tf.constant(-2.0), tf.constant(0.9)], rtol=1e-5)


def test_mirrored_replicas_unroll_steps_updating_in_merge_call():
    """MirroredStrategy, a tape in each replica, ``unroll`` of Keras 3
    SGD(momentum) steps and of steps with a ``merge_call`` of one's own (f05):
    each replica's gradient and w's components as the loop's. Were: eagerly
    an UntrackedWriteError (each replica's segment noted the other's ops:
    TensorFlow's op callback list is shared by the replica threads);
    compiled, a false "closes over" refusal or re-run assertion (the second
    callback in that list got None for the op's outputs)."""
    out = helper_output("mirrored_unroll")
    for key, got in out.items():
        assert isinstance(got["loop"], dict), (key, got["loop"])
        assert isinstance(got["unroll"], dict), (key, got["unroll"])
        np.testing.assert_allclose(got["unroll"]["d_lr"], got["loop"]["d_lr"], rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(got["unroll"]["w"], got["loop"]["w"], rtol=1e-6, err_msg=key)


@modes
def test_step_calling_a_loaded_savedmodel_function(mode, tmp_path):
    """A step calling a loaded SavedModel's function, which reads its restored
    variable through its captures (f06): compiled, the first run noted that
    variable nowhere (a call op reaches no graph op callback, and the paused
    tapes had TensorFlow note no access), the re-run did: refused as a Python
    side effect. The loop's values and gradients, for lr and the restored
    variable too."""

    class Scale(tf.Module):
        def __init__(self):
            self.v = tf.Variable([0.5, -0.5])

        @tf.function(input_signature=[tf.TensorSpec([2])])
        def f(self, a):
            return a * self.v

    tf.saved_model.save(Scale(), str(tmp_path))
    loaded = tf.saved_model.load(str(tmp_path))
    w, lr = tf.Variable(W0), tf.Variable(0.1)

    def program(wrap):
        def body():
            with AssignAwareTape() as tape:
                if wrap:
                    unroll(lambda: w.assign_sub(lr * loaded.f(w)), 3, checkpoint_every=2)
                else:
                    for _ in range(3):
                        w.assign_sub(lr * loaded.f(w))
                y = tf.reduce_sum(w**2)
            return y, tape.gradient(y, [lr, loaded.v])

        w.assign(W0)
        return run(mode, body)

    # The rewrite: w <- w (1 - lr v), three times; y = sum(w^2).
    with tf.GradientTape() as plain:
        lr_t, v_t = tf.constant(0.1), tf.constant([0.5, -0.5])
        plain.watch([lr_t, v_t])
        wt = tf.constant(W0)
        for _ in range(3):
            wt = wt - lr_t * wt * v_t
        y = tf.reduce_sum(wt**2)
    rewrite = (y, plain.gradient(y, [lr_t, v_t]))
    loop = program(False)
    got = program(True)
    assert_grads_close(got, loop, rtol=1e-5)
    assert_grads_close(got, rewrite, rtol=1e-5)
