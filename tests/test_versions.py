"""Several versions of one variable: sources, targets and versions()."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape, NotAVariableError


def _program(v, a, read):
    """Reads v, writes it twice, reads between and after."""
    r0 = read(v)
    v.assign(v * a)  # v1 = v0 * a
    r1 = read(v)
    v.assign(v + a * a)  # v2 = v1 + a^2
    r2 = read(v)
    return tf.reduce_sum(r0 * 3.0 + r1 * r1 + tf.sin(r2))


@modes
def test_reads_before_between_and_after_two_writes(mode):
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(0.5)

    def body():
        with AssignAwareTape() as tape:
            loss = _program(v, a, tf.identity)
        return tape.gradient(loss, [v, a])

    v0, a0 = tf.constant([1.0, 2.0]), tf.constant(0.5)
    with tf.GradientTape() as oracle:
        oracle.watch([v0, a0])
        r0 = v0
        v1 = v0 * a0
        v2 = v1 + a0 * a0
        loss = tf.reduce_sum(r0 * 3.0 + v1 * v1 + tf.sin(v2))
    assert_grads_close(run(mode, body), oracle.gradient(loss, [v0, a0]))


@modes
def test_gradients_with_respect_to_every_version(mode):
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(0.5)

    def body():
        with AssignAwareTape(persistent=True) as tape:
            loss = _program(v, a, tf.identity)
        versions = tape.versions(v)
        return len(versions), tape.gradient(loss, list(versions)), tape.gradient(versions[-1], a)

    n, grads, dlast_da = run(mode, body)
    assert n == 3
    v0, a0 = tf.constant([1.0, 2.0]), tf.constant(0.5)
    # Each version as a source: the loss as a function of that intermediate value.
    with tf.GradientTape(persistent=True) as oracle:
        oracle.watch([v0, a0])
        v1 = v0 * a0
        oracle.watch(v1)
        v2 = v1 + a0 * a0
        oracle.watch(v2)
        loss = tf.reduce_sum(v0 * 3.0 + v1 * v1 + tf.sin(v2))
    assert_grads_close(grads, oracle.gradient(loss, [v0, v1, v2]))
    # A version as a target: d v2 / d a, summed over elements.
    with tf.GradientTape() as o2:
        o2.watch(a0)
        v2 = v0 * a0 + a0 * a0
    assert_grads_close(dlast_da, o2.gradient(v2, a0))


def test_variable_target_is_its_latest_version():
    v, a = tf.Variable(3.0), tf.Variable(2.0)
    with AssignAwareTape() as tape:
        v.assign(a * 4.0)
    assert float(tape.gradient(v, a)) == 4.0


def test_variable_source_is_its_value_at_tape_start():
    v = tf.Variable(3.0)
    with AssignAwareTape(persistent=True) as tape:
        v.assign(v * v)  # v1 = v0^2
        v.assign(v * v)  # v2 = v0^4
        loss = v * 1.0
    assert float(tape.gradient(loss, v)) == 4 * 3.0**3
    # d v2 / d v1 = 2 v1
    assert float(tape.gradient(loss, tape.versions(v)[1])) == 2 * 9.0


@pytest.mark.parametrize("unconnected", ["none", "zero"])
def test_overwritten_before_read_has_no_gradient(unconnected):
    v, a = tf.Variable([1.0, 2.0, 3.0]), tf.Variable(2.0)
    with AssignAwareTape() as tape:
        v.assign(tf.fill([3], a))
        loss = tf.reduce_sum(v * v)
    dv, da = tape.gradient(loss, [v, a], unconnected_gradients=unconnected)
    assert float(da) == 3 * 2 * 2.0
    if unconnected == "none":
        assert dv is None
    else:
        assert dv.dtype == tf.float32 and dv.shape == (3,)
        np.testing.assert_array_equal(dv, np.zeros(3, np.float32))


def test_zero_unconnected_for_a_version_source_uses_the_variable_shape():
    v = tf.Variable(tf.ones([2, 2], tf.float64))
    with AssignAwareTape() as tape:
        v.assign(tf.zeros([2, 2], tf.float64))
        loss = tf.constant(1.0)
    (g,) = tape.gradient(loss, [tape.versions(v)[1]], unconnected_gradients="zero")
    assert g.dtype == tf.float64 and g.shape == (2, 2)


def test_versions_of_an_unwritten_variable():
    v, w = tf.Variable(1.0), tf.Variable(2.0)
    with AssignAwareTape() as tape:
        w.assign(v * 2)
    assert len(tape.versions(v)) == 1
    assert len(tape.versions(w)) == 2


def test_sources_in_nested_structures_keep_their_structure():
    a, b, c = tf.Variable(1.0), tf.Variable([2.0, 3.0]), tf.Variable(0.0)
    x = tf.constant(4.0)
    with AssignAwareTape() as tape:
        tape.watch(x)
        c.assign(a * x + tf.reduce_sum(b))
        loss = c * c
    grads = tape.gradient(loss, {"a": a, "pair": (b, [x, c])})
    value = 1.0 * 4.0 + 5.0
    assert float(grads["a"]) == 2 * value * 4.0
    np.testing.assert_array_equal(grads["pair"][0], [2 * value, 2 * value])
    assert float(grads["pair"][1][0]) == 2 * value * 1.0
    assert grads["pair"][1][1] is None


def test_keras_variables_as_sources_and_versions():
    import keras

    kv = keras.Variable(2.0)
    k2 = keras.Variable(3.0)
    with AssignAwareTape() as tape:
        k2.assign(kv * kv)
        loss = k2 * 5.0
    assert len(tape.versions(k2)) == 2
    assert float(tape.gradient(loss, kv)) == 5.0 * 2 * 2.0


def test_versions_rejects_tensors():
    with AssignAwareTape() as tape:
        pass
    with pytest.raises(NotAVariableError, match="Tensors have no versions"):
        tape.versions(tf.constant(1.0))
    with pytest.raises(TypeError):  # the error narrows TypeError
        tape.versions(3.0)
