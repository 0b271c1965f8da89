"""Scatter, scatter_nd, batch-scatter and slice writes, against the rewrite
built from tf.tensor_scatter_nd_* and against finite differences of the real
program."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, central_difference, modes, run

from assigntape import AssignAwareTape, DuplicateIndicesError

V0 = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75], [0.3, 0.6, -0.9], [1.1, -0.2, 0.4]])
U0 = np.array([[0.7, 1.3, -0.4], [2.0, -0.6, 0.9]])
ROWS = [2, 0]


def _loss(before, after):
    return tf.reduce_sum(tf.sin(before) * after) + tf.reduce_sum(after**2)


# name: (write on the variable, the same write as a function of tensors)
def _rows(op):
    return lambda old, idx, u: tf.tensor_scatter_nd_update(old, idx, op(tf.gather_nd(old, idx), u))


SCATTERS = {
    "scatter_update": tf.tensor_scatter_nd_update,
    "scatter_add": tf.tensor_scatter_nd_add,
    "scatter_sub": tf.tensor_scatter_nd_sub,
    "scatter_mul": _rows(lambda r, u: r * u),
    "scatter_div": _rows(lambda r, u: r / u),
    "scatter_min": tf.tensor_scatter_nd_min,
    "scatter_max": tf.tensor_scatter_nd_max,
}


def _check(mode, program, rewrite, dtype=tf.float64):
    """The tape on `program(v, u, s)` against the rewrite and finite differences."""
    v, u, s = tf.Variable(V0, dtype=dtype), tf.Variable(U0, dtype=dtype), tf.Variable(1.5, dtype=dtype)

    def body():
        with AssignAwareTape() as tape:
            before = v * 1.0
            program(v, u * s)
            loss = _loss(before, v)
        return loss, tape.gradient(loss, [v, u, s])

    loss, grads = run(mode, body)
    v0, u0, s0 = (tf.constant(x, dtype) for x in (V0, U0, 1.5))
    with tf.GradientTape() as oracle:
        oracle.watch([v0, u0, s0])
        expected_loss = _loss(v0, rewrite(v0, u0 * s0))
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-12)
    assert_grads_close(grads, oracle.gradient(expected_loss, [v0, u0, s0]), rtol=1e-9, atol=1e-12)

    def real(point):  # the real program, no tape, in float64
        vv, uu, ss = (tf.Variable(p, dtype=tf.float64) for p in point)
        before = vv * 1.0
        program(vv, uu * ss)
        return float(_loss(before, vv))

    rng = np.random.default_rng(0)
    point = [V0, U0, np.array(1.5)]
    direction = [rng.normal(size=np.shape(p)) for p in point]
    fd = central_difference(real, point, direction, eps=1e-6)
    analytic = sum(float(np.sum(np.asarray(tf.convert_to_tensor(g)) * d)) for g, d in zip(grads, direction))
    np.testing.assert_allclose(analytic, fd, rtol=1e-6, atol=1e-8)


@modes
@pytest.mark.parametrize("name", sorted(SCATTERS))
def test_scatter_methods(mode, name):
    idx = tf.constant(ROWS)

    def program(v, u):
        getattr(v, name)(tf.IndexedSlices(u, idx))

    _check(mode, program, lambda old, u: SCATTERS[name](old, idx[:, None], u))


ND = {
    "scatter_nd_update": tf.tensor_scatter_nd_update,
    "scatter_nd_add": tf.tensor_scatter_nd_add,
    "scatter_nd_sub": tf.tensor_scatter_nd_sub,
    "scatter_nd_min": tf.tensor_scatter_nd_min,
    "scatter_nd_max": tf.tensor_scatter_nd_max,
}


@modes
@pytest.mark.parametrize("name", sorted(ND))
@pytest.mark.parametrize("depth", ["elements", "rows"])
def test_scatter_nd_methods(mode, name, depth):
    if depth == "elements":
        idx = tf.constant([[1, 2], [3, 0], [0, 1]])
        pick = lambda u: tf.stack([u[0, 0], u[1, 1], u[0, 2]])  # noqa: E731
    else:
        idx = tf.constant([[3], [1]])
        pick = lambda u: u  # noqa: E731

    def program(v, u):
        getattr(v, name)(idx, pick(u))

    _check(mode, program, lambda old, u: ND[name](old, idx, pick(u)))


@modes
def test_batch_scatter_update(mode):
    idx = tf.constant([[0, 2], [1, 0], [2, 1], [0, 1]])

    def program(v, u):  # row i of v gets two new entries, at columns idx[i]
        v.batch_scatter_update(tf.IndexedSlices(tf.concat([u[:, :2], u[:, 1:]], 0), idx))

    nd = tf.constant([[0, 0], [0, 2], [1, 1], [1, 0], [2, 2], [2, 1], [3, 0], [3, 1]])

    def rewrite(old, u):
        values = tf.reshape(tf.concat([u[:, :2], u[:, 1:]], 0), [-1])
        return tf.tensor_scatter_nd_update(old, nd, values)

    _check(mode, program, rewrite)


SLICES = {
    "range": (slice(1, 3),),
    "strided": (slice(None, None, 2), slice(0, 3, 2)),
    "negative": (-1,),
    "negative_range": (slice(-3, -1), slice(-2, None)),
    "ellipsis": (Ellipsis, 1),
    "new_axis": (tf.newaxis, slice(1, 3), 0),
    "reverse": (slice(None, None, -1), slice(2, 0, -1)),
}


@modes
@pytest.mark.parametrize("name", sorted(SLICES))
def test_slice_assignment(mode, name):
    spec = SLICES[name]
    shape = np.empty(V0.shape)[tuple(s if s is not tf.newaxis else None for s in spec)].shape
    positions = np.arange(V0.size).reshape(V0.shape)[tuple(s if s is not tf.newaxis else None for s in spec)]
    nd = tf.constant(np.stack(np.unravel_index(positions.reshape(-1), V0.shape), axis=1))

    def value_of(u):
        flat = tf.reshape(tf.concat([u, u], 0), [-1])[: int(np.prod(shape))]
        return tf.reshape(flat, shape)

    def program(v, u):
        v[spec].assign(value_of(u))

    _check(mode, program, lambda old, u: tf.tensor_scatter_nd_update(old, nd, tf.reshape(value_of(u), [-1])))


@modes
def test_scatter_add_sums_duplicate_indices(mode):
    idx = tf.constant([1, 3, 1])

    def program(v, u):
        v.scatter_add(tf.IndexedSlices(tf.concat([u, u[:1]], 0), idx))

    _check(mode, program, lambda old, u: tf.tensor_scatter_nd_add(old, idx[:, None], tf.concat([u, u[:1]], 0)))


@pytest.mark.parametrize("name", ["scatter_update", "scatter_mul", "scatter_max", "scatter_nd_update"])
def test_duplicate_indices_are_refused_where_unsound(name):
    v, u = tf.Variable(V0), tf.Variable(U0)
    with AssignAwareTape() as tape:
        before = v.numpy()
        versions = tape.versions(v)
        with pytest.raises(DuplicateIndicesError, match="duplicate indices") as info:
            if "nd" in name:
                v.scatter_nd_update([[1], [1]], u * 2.0)
            else:
                getattr(v, name)(tf.IndexedSlices(u * 2.0, tf.constant([1, 1])))
        assert isinstance(info.value, ValueError)
        np.testing.assert_array_equal(v.numpy(), before)  # nothing was written
        assert tape.versions(v) == versions


def test_duplicate_indices_in_a_function_fail_before_the_write():
    v, u = tf.Variable(V0), tf.Variable(U0)

    @tf.function
    def f(idx):
        with AssignAwareTape() as tape:
            v.scatter_update(tf.IndexedSlices(u * 2.0, idx))
            loss = tf.reduce_sum(v)
        return tape.gradient(loss, u)

    np.testing.assert_allclose(f(tf.constant([0, 3])), np.full(U0.shape, 2.0))
    v.assign(V0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="duplicate indices"):
        f(tf.constant([2, 2]))
    np.testing.assert_array_equal(v.numpy(), V0)


def test_compat_v1_and_raw_op_writes_are_tracked():
    v, a = tf.Variable([1.0, 2.0, 3.0]), tf.Variable(2.0)
    with AssignAwareTape() as tape:
        tf.compat.v1.assign(v, v * a)  # v1 = v0 a
        tf.compat.v1.scatter_add(v, [0], [a * a])  # v2[0] += a^2
        tf.raw_ops.AssignAddVariableOp(resource=v.handle, value=tf.fill([3], a))  # v3 = v2 + a
        tf.compat.v1.scatter_nd_update(v, [[2]], [a * 10.0])  # v4[2] = 10 a
        loss = tf.reduce_sum(v * v)
    dv, da = tape.gradient(loss, [v, a])
    a0 = 2.0
    final = np.array([1 * a0 + a0**2 + a0, 2 * a0 + a0, 10 * a0])
    d_final_da = np.array([1 + 2 * a0 + 1, 2 + 1, 10])
    np.testing.assert_allclose(float(da), np.sum(2 * final * d_final_da))
    np.testing.assert_allclose(dv, [2 * final[0] * a0, 2 * final[1] * a0, 0.0])


RAW = {
    "AssignVariableOp": (
        lambda v, u: tf.raw_ops.AssignVariableOp(resource=v.handle, value=tf.concat([u, u], 0)),
        lambda old, u: tf.concat([u, u], 0),
    ),
    "AssignAddVariableOp": (
        lambda v, u: tf.raw_ops.AssignAddVariableOp(resource=v.handle, value=tf.concat([u, u], 0)),
        lambda old, u: old + tf.concat([u, u], 0),
    ),
    "AssignSubVariableOp": (
        lambda v, u: tf.raw_ops.AssignSubVariableOp(resource=v.handle, value=tf.concat([u, u], 0)),
        lambda old, u: old - tf.concat([u, u], 0),
    ),
    "ResourceScatterUpdate": (
        lambda v, u: tf.raw_ops.ResourceScatterUpdate(resource=v.handle, indices=[3, 1], updates=u),
        lambda old, u: tf.tensor_scatter_nd_update(old, [[3], [1]], u),
    ),
    "ResourceScatterNdAdd": (
        lambda v, u: tf.raw_ops.ResourceScatterNdAdd(ref=v.handle, indices=[[0], [2]], updates=u),
        lambda old, u: tf.tensor_scatter_nd_add(old, [[0], [2]], u),
    ),
    "ResourceStridedSliceAssign": (
        lambda v, u: tf.raw_ops.ResourceStridedSliceAssign(
            ref=v.handle, begin=[1, 0], end=[3, 3], strides=[1, 1], value=u
        ),
        lambda old, u: tf.tensor_scatter_nd_update(old, [[1], [2]], u),
    ),
    "compat.v1.assign_sub": (
        lambda v, u: tf.compat.v1.assign_sub(v, tf.concat([u, u], 0)),
        lambda old, u: old - tf.concat([u, u], 0),
    ),
    "compat.v1.scatter_update": (
        lambda v, u: tf.compat.v1.scatter_update(v, [0, 3], u),
        lambda old, u: tf.tensor_scatter_nd_update(old, [[0], [3]], u),
    ),
}


@modes
@pytest.mark.parametrize("name", sorted(RAW))
def test_raw_ops_and_compat_v1_writes_are_differentiated(mode, name):
    program, rewrite = RAW[name]
    _check(mode, program, rewrite)


_SCALAR_UPDATE_CASES = [
    (op, dtype)
    for op in ("ResourceScatterMul", "ResourceScatterDiv", "ResourceScatterUpdate", "ResourceScatterMax")
    for dtype in (tf.float64, tf.complex128)
    if not (dtype.is_complex and op == "ResourceScatterMax")  # no complex kernel
]


@modes
@pytest.mark.parametrize("op,dtype", _SCALAR_UPDATE_CASES)
def test_scalar_update_from_a_written_variable(mode, op, dtype):
    """The raw scatter ops take a scalar update for every written row. One
    computed from a variable written earlier in the tape (found by the random
    programs, compiled: TensorFlow's graph optimizer broke the backward pass)."""
    v = tf.Variable(tf.constant([1.0, 2.0, 3.0], dtype))
    a = tf.Variable(tf.constant(2.0, dtype))

    def program():
        v.assign(tf.constant([1.0, 2.0, 3.0], dtype))
        a.assign(tf.constant(2.0, dtype))
        with AssignAwareTape() as tape:
            a.assign(a * 2.0)  # 4
            getattr(tf.raw_ops, op)(resource=v.handle, indices=[0], updates=a * 1.0)
            loss = tf.reduce_sum(v * 1.0)  # its upstream gradient is a constant
        return tape.gradient(loss, [a, v])

    def rewrite(a0, v0):
        a1 = a0 * 2.0
        combine = {
            "ResourceScatterMul": lambda r: r * a1,
            "ResourceScatterDiv": lambda r: r / a1,
            "ResourceScatterUpdate": lambda r: a1 + 0.0 * r,
            "ResourceScatterMax": lambda r: tf.maximum(r, a1),
        }[op]
        v1 = tf.stack([combine(v0[0]), v0[1], v0[2]])
        return tf.reduce_sum(v1 * 1.0)

    a0, v0 = tf.constant(2.0, dtype), tf.constant([1.0, 2.0, 3.0], dtype)
    with tf.GradientTape() as oracle:
        oracle.watch([a0, v0])
        expected_loss = rewrite(a0, v0)
    expected = oracle.gradient(expected_loss, [a0, v0])
    assert_grads_close(run(mode, program), expected, rtol=1e-10)
