"""A written variable is read as its new version by every read path.

Each case writes ``v.assign(w * s + p)``, reads ``v`` before and after the write,
and is compared with the rewrite in which ``v`` is a tensor rebound by the write.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape

# (name, read of the variable, the same read of a tensor)
READS = [
    ("mul", lambda v: v * 2.0, lambda t: t * 2.0),
    ("rsub_pow", lambda v: (1.0 - v) ** 2, lambda t: (1.0 - t) ** 2),
    ("neg", lambda v: -v, lambda t: -t),
    ("relu", tf.nn.relu, tf.nn.relu),
    ("reduce_sum", lambda v: tf.reduce_sum(v, axis=0), lambda t: tf.reduce_sum(t, axis=0)),
    ("square", tf.square, tf.square),
    ("stack", lambda v: tf.stack([v, v]), lambda t: tf.stack([t, t])),
    ("concat", lambda v: tf.concat([v, v], 1), lambda t: tf.concat([t, t], 1)),
    ("einsum", lambda v: tf.einsum("ij,kj->ik", v, v), lambda t: tf.einsum("ij,kj->ik", t, t)),
    ("matmul", lambda v: tf.matmul(v, v, transpose_b=True), lambda t: tf.matmul(t, t, transpose_b=True)),
    ("gather", lambda v: tf.gather(v, [1, 0, 1]), lambda t: tf.gather(t, [1, 0, 1])),
    (
        "embedding_lookup",
        lambda v: tf.nn.embedding_lookup(v, [1, 1]),
        lambda t: tf.nn.embedding_lookup(t, [1, 1]),
    ),
    ("sparse_read", lambda v: v.sparse_read([1]), lambda t: tf.gather(t, [1])),
    ("gather_nd_method", lambda v: v.gather_nd([[0, 1], [1, 2]]), lambda t: tf.gather_nd(t, [[0, 1], [1, 2]])),
    ("tf_gather_nd", lambda v: tf.gather_nd(v, [[1, 0]]), lambda t: tf.gather_nd(t, [[1, 0]])),
    ("read_value", lambda v: v.read_value(), lambda t: t),
    ("value", lambda v: v.value(), lambda t: t),
    ("convert_to_tensor", tf.convert_to_tensor, tf.convert_to_tensor),
    ("identity", tf.identity, tf.identity),
    ("raw_ops", lambda v: tf.raw_ops.Relu(features=v), lambda t: tf.raw_ops.Relu(features=t)),
]

V0 = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]], np.float32)
W0 = np.array([[1.0, 2.0, -3.0], [0.5, -0.5, 4.0]], np.float32)
P = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], np.float32)


def _loss(before, after):
    return tf.reduce_sum(tf.sin(before)) + tf.reduce_sum(after**2)


@modes
@pytest.mark.parametrize("name,read_var,read_tensor", READS, ids=[r[0] for r in READS])
def test_read_path(mode, name, read_var, read_tensor):
    v, w, s = tf.Variable(V0), tf.Variable(W0), tf.Variable(1.5)

    def body():
        with AssignAwareTape() as tape:
            before = read_var(v)
            v.assign(w * s + P)
            after = read_var(v)
            loss = _loss(before, after)
        return tape.gradient(loss, [v, w, s])

    v0, w0, s0 = tf.constant(V0), tf.constant(W0), tf.constant(1.5)
    with tf.GradientTape() as oracle:
        oracle.watch([v0, w0, s0])
        before = read_tensor(v0)
        v1 = w0 * s0 + P
        loss = _loss(before, read_tensor(v1))
    expected = oracle.gradient(loss, [v0, w0, s0])
    assert_grads_close(run(mode, body), expected)


@modes
def test_object_returned_by_assign_reads_the_new_version(mode):
    v, w = tf.Variable(V0), tf.Variable(W0)

    def body():
        with AssignAwareTape() as tape:
            r = v.assign(w * 3.0)
            loss = tf.reduce_sum(r * r) + tf.reduce_sum(r.read_value())
        return tape.gradient(loss, [v, w])

    dv, dw = run(mode, body)
    assert dv is None  # overwritten before any read
    np.testing.assert_allclose(dw, 3.0 * (2 * 3.0 * W0 + 1.0), rtol=1e-6)


def test_assign_add_and_sub_return_objects_read_the_new_version():
    v, w = tf.Variable(2.0), tf.Variable(5.0)
    with AssignAwareTape() as tape:
        r1 = v.assign_add(w)  # v1 = v0 + w
        early = r1 * 10.0  # read now: v1
        r2 = v.assign_sub(w * w)  # v2 = v1 - w^2
        late = r1 * 1.0  # TensorFlow reads lazily: r1 now holds v2, as r2 does
        loss = early + late + r2
    # The gradient follows the values TensorFlow computed.
    assert float(early) == 70.0 and float(late) == float(r2) == -18.0
    dv, dw = tape.gradient(loss, [v, w])
    assert float(dv) == 12.0  # 10 + 1 + 1
    assert float(dw) == 10.0 + 2 * (1.0 - 2 * 5.0)


def _keras_cases():
    x_dense = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    x_img = np.linspace(-1, 1, 2 * 5 * 5 * 2, dtype=np.float32).reshape(2, 5, 5, 2)
    ids = np.array([[0, 3], [2, 2]], np.int32)
    return [
        ("dense", lambda: keras.layers.Dense(2), x_dense, "kernel", lambda k, x: tf.matmul(x, k)),
        ("embedding", lambda: keras.layers.Embedding(4, 3), ids, "embeddings", lambda k, x: tf.gather(k, x)),
        (
            "conv2d",
            lambda: keras.layers.Conv2D(3, 3, use_bias=False),
            x_img,
            "kernel",
            lambda k, x: tf.nn.conv2d(x, k, strides=1, padding="VALID"),
        ),
    ]


@modes
@pytest.mark.parametrize("name,make,x,attr,functional", _keras_cases(), ids=lambda c: c if isinstance(c, str) else "")
def test_keras_layer_reads_written_weights(mode, name, make, x, attr, functional):
    # A hypernetwork writes the layer's weight; the layer's own call reads it.
    layer = make()
    layer(x)  # build
    weight = getattr(layer, attr)
    z = tf.Variable(tf.random.stateless_normal([4], seed=[1, 2]))
    proj = tf.random.stateless_normal([4, int(np.prod(weight.shape))], seed=[3, 4])

    def hyper(zv):
        return tf.reshape(tf.linalg.matvec(proj, zv, transpose_a=True), weight.shape)

    bias = getattr(layer, "bias", None)

    def body():
        with AssignAwareTape() as tape:
            weight.assign(hyper(z))
            loss = tf.reduce_sum(tf.tanh(layer(x)))
        return tape.gradient(loss, z)

    z0 = tf.constant(z.numpy())
    with tf.GradientTape() as oracle:
        oracle.watch(z0)
        out = functional(hyper(z0), tf.constant(x))
        if bias is not None:
            out = out + bias
        loss = tf.reduce_sum(tf.tanh(out))
    expected = oracle.gradient(loss, z0)
    assert_grads_close(run(mode, body), expected, rtol=1e-5)
