"""Variables that wrap a variable behave exactly as a plain ``tf.Variable``.

Keras 3's ``Variable``, tf_keras mixed precision's ``AutoCastVariable``, and
tf.distribute's ``MirroredVariable`` / ``SyncOnReadVariable`` (in replica
context, their replica's component) and ``AggregatingVariable`` each stand for
one ``tf.Variable``: as a source (its value at the start of the tape), as a
target (its latest version), inside and after the ``with``, eager, compiled and
in replica context, and in ``versions``, ``watched_variables``, ``restoring``,
``explain`` and ``history``. (``AggregatingVariable`` needs two devices: see
``tests/helpers/wrapped_variables_two_devices.py``.)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np
import pytest
import tensorflow as tf
from helpers import helper_output
from helpers.wrapped_variables_two_devices import EXPECTED, W0, X0, program
from tensorflow.python.ops import resource_variable_ops

from assigntape import AssignAwareTape, NotAVariableError


def _keras(value: float) -> Any:
    import keras

    return keras.Variable(value)


def _autocast(value: float) -> Any:
    from tf_keras.src.mixed_precision import autocast_variable

    return autocast_variable.create_autocast_variable(tf.Variable(value))


_ONE_DEVICE = tf.distribute.MirroredStrategy(["/cpu:0"])


def _mirrored(value: float) -> Any:
    with _ONE_DEVICE.scope():
        return tf.Variable(value)


def _sync_on_read(value: float) -> Any:
    with _ONE_DEVICE.scope():
        return tf.Variable(
            value, synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM
        )


WRAPPERS: Dict[str, Callable[[float], Any]] = {
    "plain": tf.Variable,
    "keras": _keras,
    "autocast": _autocast,
    "mirrored": _mirrored,
    "sync_on_read": _sync_on_read,
}
DISTRIBUTED = ("mirrored", "sync_on_read")


def _contexts(name: str) -> List[str]:
    base = ["eager", "function"]
    return base + (["replica-eager", "replica-function"] if name in DISTRIBUTED else [])


CASES = [(name, context) for name in WRAPPERS for context in _contexts(name)]


def _run(context: str, fn: Callable[[], Any]) -> Any:
    compiled = context.endswith("function")
    fn = tf.function(fn) if compiled else fn
    return _ONE_DEVICE.run(fn) if context.startswith("replica") else fn()


@pytest.mark.parametrize("name,context", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_source_and_target_inside_and_after_the_with(name, context):
    w, x = WRAPPERS[name](W0), tf.Variable(X0)
    got = _run(context, lambda: program(w, x))
    for key, value in EXPECTED.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_plain_inner_tape_asked_while_the_outer_is_open(name):
    w, x = WRAPPERS[name](W0), tf.Variable(X0)
    with AssignAwareTape():
        with tf.GradientTape(persistent=True) as inner:
            if name == "sync_on_read":
                inner.watch(w)  # not trainable, so not watched on read
            y1 = w * 2.0
            w.assign(w * x)
            y = y1 + w * w
        d_w, d_x = inner.gradient(y, [w, x])
        d_target = inner.gradient(w, x)
    np.testing.assert_allclose(
        [float(d_w), float(d_x), float(d_target)],
        [EXPECTED["in_source_w"], EXPECTED["in_source_x"], EXPECTED["in_target_x"]],
        rtol=1e-6,
    )


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_versions_watched_variables_history_and_explain(name):
    from assigntape import _resolve

    w, x = WRAPPERS[name](W0), tf.Variable(X0)
    inner = _resolve.resolve(w)
    with AssignAwareTape(persistent=True) as tape:
        tape.watch(w)
        _ = w * 1.0
        w.assign(x * 4.0)
        w.assign(x + 1.0)
        y = w * 3.0
    assert len(tape.versions(w)) == 3 and tape.versions(w) == tape.versions(inner)
    watched = [_resolve.resolve(v) for v in tape.watched_variables()]
    assert sum(v is inner for v in watched) == 1
    assert len(tape.history().variables[inner.name]) == 3
    report = tape.explain(y, {"w": w, "x": x})
    assert report.reports[0].reason == "overwritten_before_read" and report.reports[1].status == "ok"
    assert float(report.gradients["x"]) == 3.0


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_restoring_writes_a_wrapper_back(name):
    w, x = WRAPPERS[name](W0), tf.Variable(X0)
    with AssignAwareTape() as tape:
        tape.watch(w)
        with tape.restoring([w]):
            w.assign(w * x)
            y = w * 1.0
        loss = y + w * 10.0
    assert float(tf.convert_to_tensor(w)) == W0
    np.testing.assert_allclose(float(tape.gradient(loss, w)), X0 + 10.0, rtol=1e-6)


def test_aggregating_variables_on_two_devices():
    results = helper_output("wrapped_variables_two_devices")
    assert results["type"] == "AggregatingVariable"
    assert set(results["cases"]) == {"cross-replica-eager", "cross-replica-function"}
    for case, got in results["cases"].items():
        for key, value in EXPECTED.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-6, err_msg=f"{case}: {key}")


class _Delegating(resource_variable_ops.BaseResourceVariable):
    """A ``BaseResourceVariable`` subclass with no handle of its own that
    delegates to a variable it keeps under a name assigntape was never told."""

    def __init__(self, inner: Any) -> None:  # no super().__init__: no _handle
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def assign_sub(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.assign_sub(*args, **kwargs)

    def _dense_var_to_tensor(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner._dense_var_to_tensor(*args, **kwargs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_any_delegating_variable_subclass_stands_for_its_variable(compiled):
    inner, lr = tf.Variable([1.0, 2.0]), tf.Variable(0.5)
    w = _Delegating(inner)

    def step() -> Any:
        with AssignAwareTape() as tape:
            w.assign_sub(lr * tf.convert_to_tensor(w))
            loss = tf.reduce_sum(tf.convert_to_tensor(w) * 3.0)
        return tape.gradient(loss, [lr, w]), tape.versions(w)

    (d_lr, d_w), versions = (tf.function(step) if compiled else step)()
    # w1 = w0 (1 - lr): d/d lr = -3 sum(w0) = -9, d/d w0 = 3 (1 - lr).
    np.testing.assert_allclose(float(d_lr), -9.0)
    np.testing.assert_allclose(d_w.numpy(), [1.5, 1.5])
    assert len(versions) == 2


def test_a_wrapper_with_no_variable_to_find_is_refused_by_name():
    class _Opaque(resource_variable_ops.BaseResourceVariable):
        name = "opaque_weights"

        def __init__(self, a: Any, b: Any) -> None:
            self._a, self._b = a, b  # two variables: which one would it be?

    w = _Opaque(tf.Variable(1.0), tf.Variable(2.0))
    with AssignAwareTape() as tape:
        y = tf.constant(1.0)
    for call in (lambda: tape.gradient(y, w), lambda: tape.versions(w), lambda: tape.gradient(w, y)):
        with pytest.raises(NotAVariableError, match="'opaque_weights'.*the variable it wraps"):
            call()
