"""With no writes, AssignAwareTape is tf.GradientTape: same results, bit for bit,
and the same errors. Each case runs against both classes, eager and compiled."""

from __future__ import annotations

from typing import Any, Callable, List

import keras
import numpy as np
import pytest
import tensorflow as tf
from oracle import MODES, run

from assigntape import AssignAwareTape

CASES: List[Callable[[type], Any]] = []


def case(fn: Callable[[type], Any]) -> Callable[[type], Any]:
    CASES.append(fn)
    return fn


def _vars():
    return tf.Variable([[0.3, -1.2], [2.0, 0.7]], name="w"), tf.Variable([0.5, -0.25], name="b")


@case
def watched_tensor(T):
    x = tf.constant([1.0, 2.0, 3.0])
    with T() as t:
        t.watch(x)
        y = tf.reduce_sum(tf.exp(x) * tf.sin(x))
    return t.gradient(y, x)


@case
def variables_read_by_many_paths(T):
    w, b = _vars()
    with T() as t:
        h = tf.nn.relu(tf.matmul(w, w) + b)
        y = tf.reduce_sum(tf.gather(h, [1, 0])) + tf.reduce_sum(w.sparse_read([1])) + tf.norm(b)
    return t.gradient(y, [w, b])


@case
def persistent_many_gradients(T):
    w, b = _vars()
    with T(persistent=True) as t:
        y1 = tf.reduce_sum(w * w)
        y2 = tf.reduce_sum(tf.tanh(w) @ tf.reshape(b, [2, 1]))
    return [t.gradient(y1, w), t.gradient(y2, [w, b]), t.gradient([y1, y2], b)]


@case
def watch_accessed_variables_false(T):
    w, b = _vars()
    with T(watch_accessed_variables=False) as t:
        t.watch(b)
        y = tf.reduce_sum(w * b)
    return t.gradient(y, [w, b]), [v.name for v in t.watched_variables()]


@case
def stop_recording(T):
    w, b = _vars()
    with T() as t:
        y = tf.reduce_sum(w)
        with t.stop_recording():
            z = tf.reduce_sum(b * w)
        y = y + z
    return t.gradient(y, [w, b])


@case
def reset(T):
    w, b = _vars()
    with T() as t:
        y = tf.reduce_sum(w * w)
        t.reset()
        y = y + tf.reduce_sum(b * 3.0)
    return t.gradient(y, [w, b])


@case
def watched_variables(T):
    w, b = _vars()
    with T() as t:
        _ = b * 2.0
        _ = w * 2.0
        _ = b * 3.0
    return [v.name for v in t.watched_variables()]


@case
def unconnected_none_and_zero(T):
    w, b = _vars()
    x = tf.constant(3.0)
    with T(persistent=True) as t:
        t.watch(x)
        y = tf.reduce_sum(w) * x
    return [
        t.gradient(y, [b, x]),
        t.gradient(y, [b, x, w], unconnected_gradients=tf.UnconnectedGradients.ZERO),
        t.gradient(y, b, unconnected_gradients="zero"),
    ]


@case
def unknown_unconnected_value(T):
    w, _ = _vars()
    with T() as t:
        y = tf.reduce_sum(w)
    return t.gradient(y, w, unconnected_gradients="sometimes")


@case
def output_gradients(T):
    w, b = _vars()
    with T() as t:
        y = tf.matmul(w, tf.reshape(b, [2, 1]))
    return t.gradient(y, [w, b], output_gradients=tf.constant([[2.0], [-1.0]]))


@case
def jacobian_pfor(T):
    w, b = _vars()
    with T() as t:
        y = tf.tanh(tf.linalg.matvec(w, b))
    return t.jacobian(y, [w, b])


@case
def jacobian_while_loop(T):
    w, b = _vars()
    with T(persistent=True) as t:
        y = tf.sin(tf.linalg.matvec(w, b))
    return t.jacobian(y, b, experimental_use_pfor=False)


@case
def jacobian_needs_persistent_without_pfor(T):
    _, b = _vars()
    with T() as t:
        y = b * b
    return t.jacobian(y, b, experimental_use_pfor=False)


@case
def batch_jacobian(T):
    x = tf.constant([[1.0, 2.0], [3.0, 4.0], [0.5, -1.0]])
    w, _ = _vars()
    with T() as t:
        t.watch(x)
        y = tf.sin(x @ w)
    return t.batch_jacobian(y, x)


@case
def second_gradient_on_non_persistent_tape(T):
    w, _ = _vars()
    with T() as t:
        y = tf.reduce_sum(w * w)
    t.gradient(y, w)
    return t.gradient(y, w)


@case
def gradient_inside_the_context(T):
    w, _ = _vars()
    with T() as t:
        y = tf.reduce_sum(w**3)
        g = t.gradient(y, w)
        z = tf.reduce_sum(w * 2.0)  # no longer recorded
    return g, z


@case
def reenter_active_tape(T):
    t = T()
    with t:
        with t:
            pass
    return None


@case
def reenter_after_exit(T):
    w, b = _vars()
    t = T(persistent=True)
    with t:
        y = tf.reduce_sum(w * w)
    outside = tf.reduce_sum(b)  # not recorded
    with t:
        y = y + tf.reduce_sum(b * b) + outside
    return t.gradient(y, [w, b])


@case
def target_none(T):
    w, _ = _vars()
    with T() as t:
        _ = w * 2.0
    return t.gradient(None, w)


@case
def variable_as_target(T):
    w, b = _vars()
    with T() as t:
        _ = w * 2.0
    return t.gradient(w, [w, b])


@case
def nested_sources_and_ragged(T):
    w, b = _vars()
    r = tf.ragged.constant([[1.0, 2.0], [3.0]])
    with T() as t:
        t.watch(r)
        y = tf.reduce_sum(r * r) + tf.reduce_sum(w) * tf.reduce_sum(b)
    return t.gradient(y, {"r": r, "p": (w, [b])})


@case
def higher_order(T):
    x = tf.Variable(1.5)
    with T() as t2:
        with T() as t1:
            y = x**4
        dy = t1.gradient(y, x)
    return t2.gradient(dy, x)


@case
def keras_dense_training_step(T):
    layer = keras.layers.Dense(3, kernel_initializer=keras.initializers.Constant(0.1))
    x = tf.reshape(tf.range(8, dtype=tf.float32), [4, 2])
    layer(x)
    with T() as t:
        loss = tf.reduce_mean(layer(x) ** 2)
    return t.gradient(loss, layer.trainable_variables)


@case
def tf_function_called_in_the_tape(T):
    w, b = _vars()
    f = tf.function(lambda: tf.reduce_sum(tf.tanh(w) @ tf.reshape(b, [2, 1])))
    f()
    with T() as t:
        y = f() + tf.reduce_sum(w)
    return t.gradient(y, [w, b])


@case
def integer_counter_written_without_float_writes(T):
    step = tf.Variable(0, dtype=tf.int64)
    w, _ = _vars()
    with T() as t:
        step.assign_add(1)
        y = tf.reduce_sum(w) * tf.cast(step, tf.float32)
    return t.gradient(y, w), step.read_value()


def _outcome(fn: Callable[[], Any]):
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001  the comparison is of errors too
        return "error", (type(e), str(e))


def _assert_identical(a: Any, b: Any) -> None:
    tf.nest.assert_same_structure(a, b, expand_composites=True)
    for x, y in zip(tf.nest.flatten(a, expand_composites=True), tf.nest.flatten(b, expand_composites=True)):
        if isinstance(x, (tf.Tensor, np.ndarray)) or isinstance(y, (tf.Tensor, np.ndarray)):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)  # bit for bit
        else:
            assert x == y


EAGER_ONLY = {
    "second_gradient_on_non_persistent_tape",
    "jacobian_needs_persistent_without_pfor",
    "gradient_inside_the_context",
}


PARAMS = [
    pytest.param(mode, fn, id=f"{fn.__name__}-{mode}")
    for fn in CASES
    for mode in MODES
    if not (mode == "function" and fn.__name__ in EAGER_ONLY)
]


@pytest.mark.parametrize("mode,fn", PARAMS)
def test_same_as_gradient_tape(mode, fn):
    tf.random.set_seed(0)
    plain = _outcome(lambda: run(mode, lambda: fn(tf.GradientTape)))
    aware = _outcome(lambda: run(mode, lambda: fn(AssignAwareTape)))
    assert plain[0] == aware[0], (plain, aware)
    _assert_identical(aware[1], plain[1])


def test_the_error_cases_do_raise():
    # Guards against the comparison above passing because both sides "succeed"
    # at something that should fail.
    for fn, error in [
        (second_gradient_on_non_persistent_tape, RuntimeError),
        (reenter_active_tape, ValueError),
        (target_none, TypeError),
        (unknown_unconnected_value, ValueError),
        (jacobian_needs_persistent_without_pfor, RuntimeError),
    ]:
        with pytest.raises(error):
            fn(AssignAwareTape)
