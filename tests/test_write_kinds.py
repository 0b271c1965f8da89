"""assign, assign_add, assign_sub; writes that cut the gradient; non-float variables."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape


@modes
@pytest.mark.parametrize("method,sign", [("assign_add", 1.0), ("assign_sub", -1.0)])
@pytest.mark.parametrize("watch_accessed", [True, False])
@pytest.mark.parametrize("read_value", [True, False])
def test_partial_write_to_a_never_read_variable(mode, method, sign, watch_accessed, read_value):
    v, d = tf.Variable([1.0, -2.0]), tf.Variable([0.5, 3.0])

    def body():
        with AssignAwareTape(watch_accessed_variables=watch_accessed) as tape:
            if not watch_accessed:
                tape.watch([v, d])
            getattr(v, method)(d * d, read_value=read_value)  # v was never read
            loss = tf.reduce_sum(tf.sin(v))
        return tape.gradient(loss, [v, d])

    v0, d0 = tf.constant([1.0, -2.0]), tf.constant([0.5, 3.0])
    with tf.GradientTape() as oracle:
        oracle.watch([v0, d0])
        loss = tf.reduce_sum(tf.sin(v0 + sign * d0 * d0))
    assert_grads_close(run(mode, body), oracle.gradient(loss, [v0, d0]))


@modes
def test_keyword_arguments_and_read_value_false(mode):
    v, a = tf.Variable(1.0), tf.Variable(3.0)

    def body():
        with AssignAwareTape() as tape:
            v.assign(value=a * 2.0, read_value=False)
            v.assign_add(delta=a, read_value=False)
            v.assign_sub(a * a, name="sub", read_value=False)
            loss = v * 1.0
        return tape.gradient(loss, a)

    assert float(run(mode, body)) == 2.0 + 1.0 - 6.0


@modes
def test_constant_write_does_not_chain_to_the_previous_version(mode):
    v, a = tf.Variable(1.0), tf.Variable(2.0)

    def body():
        with AssignAwareTape() as tape:
            v.assign(a * 3.0)
            v.assign(7.0)  # depends on nothing watched
            loss = v * a
        return tape.gradient(loss, a)

    assert float(run(mode, body)) == 7.0  # not 7 + 3 * 2 * ...


@modes
def test_write_under_stop_recording_makes_a_version_without_gradient(mode):
    v, a = tf.Variable(1.0), tf.Variable(2.0)

    def body():
        with AssignAwareTape(persistent=True) as tape:
            before = v * 1.0
            with tape.stop_recording():
                v.assign(a * 10.0)
            loss = before + v * a
        return tape.gradient(loss, [v, a]), len(tape.versions(v))

    (dv, da), n = run(mode, body)
    assert n == 2
    assert float(dv) == 1.0  # only the read before the write
    assert float(da) == 20.0  # v2 holds 20 but contributes no path to a


def test_write_under_stop_recording_still_flows_for_an_outer_tape():
    v, a = tf.Variable(1.0), tf.Variable(2.0)
    with AssignAwareTape() as outer:
        with AssignAwareTape() as inner:
            with inner.stop_recording():
                v.assign(a * 10.0)
            loss = v * 1.0
    assert float(outer.gradient(loss, a)) == 10.0
    assert inner.gradient(loss, a) is None


@modes
def test_integer_and_bool_variables_are_written_freely(mode):
    step = tf.Variable(0, dtype=tf.int64)
    flag = tf.Variable(False)
    w, a = tf.Variable(2.0), tf.Variable(0.5)

    def body():
        with AssignAwareTape() as tape:
            step.assign_add(1)
            step.assign_sub(3)
            step.assign(step * 4)
            flag.assign(tf.logical_not(flag))
            w.assign(w * a * tf.cast(step, tf.float32))
            loss = w * 1.0
        return tape.gradient(loss, [w, a]), step.read_value(), flag.read_value()

    (dw, da), s, f = run(mode, body)
    assert int(s) == -8 and bool(f) is True
    assert float(dw) == 0.5 * -8 and float(da) == 2.0 * -8


@modes
def test_assign_with_a_python_and_numpy_value(mode):
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(3.0)

    def body():
        with AssignAwareTape() as tape:
            v.assign([4.0, 5.0])
            v.assign_add(np.array([1.0, 1.0], np.float32))
            loss = tf.reduce_sum(v * a)
        return tape.gradient(loss, [v, a])

    dv, da = run(mode, body)
    assert dv is None and float(da) == 11.0


@modes
@pytest.mark.parametrize("dtype", [tf.float16, tf.float64, tf.complex64])
def test_other_differentiable_dtypes(mode, dtype):
    v, a = tf.Variable(tf.constant([1.0, 2.0], dtype)), tf.Variable(tf.constant(3.0, dtype))

    def body():
        with AssignAwareTape() as tape:
            v.assign_add(v * a)  # v1 = v0 (1 + a)
            loss = tf.reduce_sum(v * v)
        return tape.gradient(loss, [v, a])

    v0, a0 = tf.constant([1.0, 2.0], dtype), tf.constant(3.0, dtype)
    with tf.GradientTape() as oracle:
        oracle.watch([v0, a0])
        v1 = v0 + v0 * a0
        loss = tf.reduce_sum(v1 * v1)
    rtol = 1e-3 if dtype == tf.float16 else 1e-6
    assert_grads_close(run(mode, body), oracle.gradient(loss, [v0, a0]), rtol=rtol)


@modes
@pytest.mark.parametrize("module", ["raw_ops", "compat.v1.raw_ops", "compat.v2.raw_ops"])
def test_raw_op_writes_through_every_raw_ops_module(mode, module):
    ops_module = {
        "raw_ops": tf.raw_ops,
        "compat.v1.raw_ops": tf.compat.v1.raw_ops,
        "compat.v2.raw_ops": tf.compat.v2.raw_ops,
    }[module]
    x, c = tf.Variable(2.0), tf.Variable(0.0)

    def program():
        with AssignAwareTape() as tape:
            ops_module.AssignVariableOp(resource=c.handle, value=x * 3.0)
            ops_module.AssignAddVariableOp(resource=c.handle, value=x * x)
            y = c * 1.0
        return tape.gradient(y, x)

    assert float(run(mode, program)) == 3.0 + 2 * 2.0
