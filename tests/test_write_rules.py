"""Every write rule is the vector-Jacobian product of its functional rewrite.

For each write kind the tape's gradients are compared with the rewrite's under
a plain ``tf.GradientTape``, in the cases a hand-written rule gets wrong:

* complex variables (TensorFlow's convention takes the conjugate);
* second order: the derivative of a first-order gradient, through each rule;
* values that broadcast (a scalar scatter update, a scalar or a row written
  into a slice): the gradient comes back in the value's shape;
* non-finite upstream gradients: a written position gets 0, never ``inf - inf``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape

ROWS = [2, 0]
IDX = [[2], [0]]


def _rows(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def rewrite(old: Any, u: Any) -> Any:
        rows = tf.gather_nd(old, IDX)
        return tf.tensor_scatter_nd_update(old, IDX, op(rows, tf.broadcast_to(u, tf.shape(rows))))

    return rewrite


def _raw(op: str) -> Callable[[Any, Any], Any]:
    # The raw op, which (unlike the methods) accepts a scalar update.
    return lambda v, u: getattr(tf.raw_ops, op)(resource=v.handle, indices=ROWS, updates=u)


def _raw_nd(op: str) -> Callable[[Any, Any], Any]:
    return lambda v, u: getattr(tf.raw_ops, op)(ref=v.handle, indices=IDX, updates=u)


# name: (the write on a variable, the same write on tensors, ordered dtypes only)
WRITES: Dict[str, Tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any], bool]] = {
    "scatter_update": (_raw("ResourceScatterUpdate"), _rows(lambda r, u: u), False),
    "scatter_add": (_raw("ResourceScatterAdd"), _rows(lambda r, u: r + u), False),
    "scatter_sub": (_raw("ResourceScatterSub"), _rows(lambda r, u: r - u), False),
    "scatter_mul": (_raw("ResourceScatterMul"), _rows(lambda r, u: r * u), False),
    "scatter_div": (_raw("ResourceScatterDiv"), _rows(lambda r, u: r / u), False),
    "scatter_min": (_raw("ResourceScatterMin"), _rows(tf.minimum), True),
    "scatter_max": (_raw("ResourceScatterMax"), _rows(tf.maximum), True),
    "scatter_nd_update": (_raw_nd("ResourceScatterNdUpdate"), _rows(lambda r, u: u), False),
    "scatter_nd_add": (_raw_nd("ResourceScatterNdAdd"), _rows(lambda r, u: r + u), False),
    "scatter_nd_sub": (_raw_nd("ResourceScatterNdSub"), _rows(lambda r, u: r - u), False),
    "scatter_nd_min": (_raw_nd("ResourceScatterNdMin"), _rows(tf.minimum), True),
    "scatter_nd_max": (_raw_nd("ResourceScatterNdMax"), _rows(tf.maximum), True),
    "slice": (
        lambda v, u: v[1:3].assign(u),
        lambda old, u: tf.concat([old[:1], tf.broadcast_to(u, [2, 3]), old[3:]], 0),
        False,
    ),
    "assign": (lambda v, u: v.assign(tf.concat([u, u], 0)), lambda old, u: tf.concat([u, u], 0), False),
    "assign_add": (lambda v, u: v.assign_add(tf.concat([u, u], 0)), lambda old, u: old + tf.concat([u, u], 0), False),
    "assign_sub": (lambda v, u: v.assign_sub(tf.concat([u, u], 0)), lambda old, u: old - tf.concat([u, u], 0), False),
}

RNG = np.random.default_rng(7)
V0 = RNG.uniform(0.5, 2.0, size=(4, 3)) * RNG.choice([-1, 1], size=(4, 3))
U0 = RNG.uniform(0.5, 2.0, size=(2, 3))
V0_IM, U0_IM = RNG.uniform(-1, 1, size=(4, 3)), RNG.uniform(-1, 1, size=(2, 3))


def _initial(dtype: Any, u_shape: Tuple[int, ...] = (2, 3)) -> Tuple[np.ndarray, np.ndarray]:
    u0 = U0 if u_shape == (2, 3) else U0[0] if u_shape == (3,) else np.float64(U0[0, 0])
    if dtype.is_complex:
        u_im = U0_IM if u_shape == (2, 3) else U0_IM[0] if u_shape == (3,) else U0_IM[0, 0]
        return V0 + 1j * V0_IM, u0 + 1j * u_im
    return V0, u0


def _loss(v_before: Any, v_after: Any) -> Any:
    # Real-valued, and not holomorphic in complex inputs: sensitive to the
    # conjugate convention.
    return tf.reduce_sum(tf.abs(v_after * tf.sin(v_before) + v_after**2) ** 2)


def _tape_grads(mode: str, name: str, dtype: Any, u_shape: Tuple[int, ...] = (2, 3)) -> Any:
    write = WRITES[name][0]
    v0, u0 = _initial(dtype, u_shape)
    v, u = tf.Variable(v0, dtype=dtype), tf.Variable(u0, dtype=dtype)

    def body() -> Any:
        with AssignAwareTape() as tape:
            before = v * 1.0
            write(v, u * 1.0)
            loss = _loss(before, v)
        return loss, tape.gradient(loss, [v, u])

    return run(mode, body)


def _rewrite_grads(name: str, dtype: Any, u_shape: Tuple[int, ...] = (2, 3)) -> Any:
    rewrite = WRITES[name][1]
    v0, u0 = (tf.constant(x, dtype) for x in _initial(dtype, u_shape))
    with tf.GradientTape() as tape:
        tape.watch([v0, u0])
        loss = _loss(v0, rewrite(v0, u0))
    return loss, tape.gradient(loss, [v0, u0])


COMPLEX_KINDS = [n for n, (_, _, ordered) in WRITES.items() if not ordered]


@modes
@pytest.mark.parametrize("name", COMPLEX_KINDS)
def test_complex_variables_take_tensorflows_conjugate(mode, name):
    loss, grads = _tape_grads(mode, name, tf.complex128)
    expected_loss, expected = _rewrite_grads(name, tf.complex128)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-12)
    assert_grads_close(grads, expected, rtol=1e-10, atol=1e-12)


@modes
@pytest.mark.parametrize("name", sorted(WRITES))
def test_real_variables_match_the_rewrite(mode, name):
    loss, grads = _tape_grads(mode, name, tf.float64)
    expected_loss, expected = _rewrite_grads(name, tf.float64)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-12)
    assert_grads_close(grads, expected, rtol=1e-10, atol=1e-12)


BROADCASTS = [(n, ()) for n in WRITES if n.startswith("scatter_") and not n.startswith("scatter_nd")]
BROADCASTS += [("slice", ()), ("slice", (3,))]


@modes
@pytest.mark.parametrize("name,u_shape", BROADCASTS, ids=[f"{n}-{len(s)}d" for n, s in BROADCASTS])
def test_broadcast_values_get_gradients_of_their_own_shape(mode, name, u_shape):
    loss, grads = _tape_grads(mode, name, tf.float64, u_shape)
    expected_loss, expected = _rewrite_grads(name, tf.float64, u_shape)
    assert tuple(grads[1].shape) == u_shape
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=1e-12)
    assert_grads_close(grads, expected, rtol=1e-10, atol=1e-12)


def _second_order_tape(mode: str, name: str, dtype: Any) -> Any:
    write = WRITES[name][0]
    v0, u0 = _initial(dtype)
    v, u = tf.Variable(v0, dtype=dtype), tf.Variable(u0, dtype=dtype)

    def body() -> Any:
        with AssignAwareTape() as outer:
            with AssignAwareTape() as inner:
                write(v, u * 1.0)
                y = tf.reduce_sum(tf.abs(v) ** 3)
            g_u = inner.gradient(y, u)
            z = tf.reduce_sum(tf.abs(g_u) ** 2)
        return outer.gradient(z, [v, u])

    return run(mode, body)


def _second_order_rewrite(name: str, dtype: Any) -> Any:
    rewrite = WRITES[name][1]
    v0, u0 = (tf.constant(x, dtype) for x in _initial(dtype))
    with tf.GradientTape() as outer:
        outer.watch([v0, u0])
        with tf.GradientTape() as inner:
            inner.watch(u0)
            y = tf.reduce_sum(tf.abs(rewrite(v0, u0)) ** 3)
        z = tf.reduce_sum(tf.abs(inner.gradient(y, u0)) ** 2)
    return outer.gradient(z, [v0, u0])


SECOND_ORDER = [(n, tf.float64) for n in sorted(WRITES)] + [(n, tf.complex128) for n in COMPLEX_KINDS]


@modes
@pytest.mark.parametrize("name,dtype", SECOND_ORDER, ids=[f"{n}-{d.name}" for n, d in SECOND_ORDER])
def test_second_order_through_every_rule(mode, name, dtype):
    assert_grads_close(_second_order_tape(mode, name, dtype), _second_order_rewrite(name, dtype), rtol=1e-9, atol=1e-10)


@modes
@pytest.mark.parametrize("name", sorted(WRITES))
def test_infinite_upstream_gradients_give_zero_where_the_write_forgets(mode, name):
    # The loss weighs row 2 (written by every partial kind) by inf; the rewrite
    # gives the previous version 0 there, never inf - inf.
    write, rewrite, _ = WRITES[name]
    weight = tf.constant([[1.0] * 3, [2.0] * 3, [np.inf] * 3, [0.5] * 3], tf.float64)
    v, u = tf.Variable(V0), tf.Variable(U0)

    def body() -> Any:
        with AssignAwareTape() as tape:
            before = tf.exp(v)
            write(v, u * 1.0)
            loss = tf.reduce_sum(before) + tf.reduce_sum(weight * v)
        return tape.gradient(loss, [v])

    grads = run(mode, body)
    v0, u0 = tf.constant(V0), tf.constant(U0)
    with tf.GradientTape() as tape:
        tape.watch(v0)
        loss = tf.reduce_sum(tf.exp(v0)) + tf.reduce_sum(weight * rewrite(v0, u0))
    expected = tape.gradient(loss, [v0])
    np.testing.assert_array_equal(np.isnan(grads[0].numpy()), np.isnan(expected[0].numpy()))
    np.testing.assert_allclose(grads[0].numpy(), expected[0].numpy(), rtol=1e-12)
