"""A tf.function's writes are found however and wherever it was first traced.

A cond, case or loop traced while two recorders watch its inputs (the probing
tape of an eager ``tf.py_function``'s body beside the user's tape, a plain tape
or a forward accumulator beside it, a second tape) is wrapped by TensorFlow in a
function of its own (``cflow_gradient_wrapper``) whose graph does not keep its
branches: the function's writes were missed there, and the write ran under the
tape, a silently None gradient (adversary round 6 s02). Whatever the path, the
function that writes a float variable called from an eager tape is refused
before it runs (docs/known-limits.md, "A tf.function that writes a
floating-point variable, called from an eager tape"), naming the variable it
writes, not one it only reads; with ``untracked_writes="cut"`` only that one is
cut.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List

import numpy as np
import pytest
import tensorflow as tf

import assigntape
from assigntape import AssignAwareTape, UntrackedWriteError

KINDS = ["plain", "cond", "case", "while"]


def _writer(kind: str, x: tf.Variable, v: tf.Variable) -> Callable[[], Any]:
    """A tf.function writing v = 2 x (read only), bare or in control flow."""
    if kind == "plain":
        body: Callable[[], Any] = lambda: v.assign(x * 2.0)  # noqa: E731
    elif kind == "cond":
        body = lambda: tf.cond(tf.constant(True), lambda: v.assign(x * 2.0), lambda: v.assign(x * 3.0))  # noqa: E731
    elif kind == "case":
        body = lambda: tf.switch_case(tf.constant(0), [lambda: v.assign(x * 2.0), lambda: v.assign(x * 3.0)])  # noqa: E731
    else:

        def body() -> Any:
            tf.while_loop(lambda i: i < 1, lambda i: (v.assign(x * 2.0), i + 1)[1], [tf.constant(0)])
            return v.read_value()

    return tf.function(body, autograph=False)


@contextlib.contextmanager
def _beside(recorder: str, x: tf.Variable) -> Iterator[None]:
    """Another recorder open inside the AssignAwareTape."""
    if recorder == "none":
        yield
        return
    if recorder == "plain_tape":
        other: Any = tf.GradientTape()
    elif recorder == "tf_forward":
        other = tf.autodiff.ForwardAccumulator(x, tf.constant(1.0))
    elif recorder == "forward":
        other = assigntape.ForwardAccumulator(x, tf.constant(1.0))
    else:
        other = AssignAwareTape()
    with other:
        if recorder == "plain_tape":
            other.watch(x)
        yield


def _call(via: str, inner: Callable[[], Any], v: tf.Variable) -> Any:
    """Calls ``inner`` from the eager tape by ``via``; returns v * v after it."""
    if via == "direct":
        inner()
    elif via == "py_function":
        tf.py_function(lambda: inner(), [], tf.float32)
    elif via == "numpy_function":
        tf.numpy_function(lambda: inner().numpy(), [], np.float32)
    else:  # a tf.py_function in a tf.function the eager tape calls

        @tf.function(autograph=False)
        def step() -> Any:
            tf.py_function(lambda: inner(), [], tf.float32)
            return v * v

        return step()
    return v * v


_FUNCTION_FIX = "tf.config.run_functions_eagerly(True)"


def _assert_refused(error: BaseException, v: tf.Variable, fix: str = _FUNCTION_FIX) -> None:
    # Refused before the function ran: the variable keeps its value. In a
    # py_function's body, TensorFlow reports the refusal as its own error,
    # whose message carries ours.
    message = str(error)
    assert isinstance(error, UntrackedWriteError) or "UntrackedWriteError" in message, message
    assert "'vee:0'" in message and "'x:0'" not in message, message  # the variable written, not the one read
    assert fix in message, message  # what to do
    assert float(v) == 1.0


@pytest.mark.parametrize("first", ["before", "inside"])
@pytest.mark.parametrize("recorder", ["none", "plain_tape", "tf_forward", "forward", "tape"])
@pytest.mark.parametrize("via", ["direct", "py_function", "numpy_function", "step"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_function_writing_a_variable_is_refused_however_first_traced(
    kind: str, via: str, recorder: str, first: str
) -> None:
    x, v = tf.Variable(2.0, name="x"), tf.Variable(1.0, name="vee")
    inner = _writer(kind, x, v)
    if first == "before":
        inner.get_concrete_function()
    with pytest.raises((UntrackedWriteError, tf.errors.UnknownError)) as caught:
        with AssignAwareTape():
            with _beside(recorder, x):
                _call(via, inner, v)
    _assert_refused(caught.value, v)


@pytest.mark.parametrize("first", ["before", "inside"])
@pytest.mark.parametrize("kind", ["cond", "case", "while"])
def test_cut_cuts_only_the_variable_written(kind: str, first: str) -> None:
    x, v = tf.Variable(2.0, name="x"), tf.Variable(1.0, name="vee")
    inner = _writer(kind, x, v)
    if first == "before":
        inner.get_concrete_function()
    with pytest.warns(UserWarning, match="'vee:0'") as warned:
        with AssignAwareTape(untracked_writes="cut") as tape:
            with _beside("plain_tape", x):
                inner()
            y = v * v + x * x
    assert not [w for w in warned if "'x:0'" in str(w.message)]  # x is only read
    # The cut write is a version with no gradient path: y = (2x)^2 + x^2 = 20,
    # and only x * x differentiates: dy/dx = 2 x = 4.
    assert float(y) == 20.0
    assert float(tape.gradient(y, x)) == 4.0


@pytest.mark.parametrize("kind", ["cond", "while"])
def test_a_function_first_traced_in_a_dataset_function(kind: str) -> None:
    x, v = tf.Variable(2.0, name="x"), tf.Variable(1.0, name="vee")
    inner = _writer(kind, x, v)
    with pytest.raises(UntrackedWriteError) as caught:
        with AssignAwareTape():
            with _beside("plain_tape", x):
                elements: List[Any] = list(tf.data.Dataset.range(1).map(lambda i: inner()))
                del elements
    _assert_refused(caught.value, v, "take the elements from the dataset")


@pytest.mark.parametrize("recorder", ["none", "plain_tape", "tape"])
@pytest.mark.parametrize("decorated", [True, False])
@pytest.mark.parametrize("kind", ["plain", "cond", "while"])
def test_written_in_a_tapes_own_function_the_write_is_followed(kind: str, decorated: bool, recorder: str) -> None:
    # Called where the tape is open in the graph, the function is traced there
    # inline, its write followed; a second recorder makes TensorFlow wrap the
    # cond or loop in a function call of its own, whose writes are still the
    # cond's. Rewrite: v = 2x, y = v^2 = 4x^2, dy/dx = 8x = 16.
    # (Writes in tf.switch_case branches are refused there: known-limits.)
    x, v = tf.Variable(2.0, name="x"), tf.Variable(1.0, name="vee")
    inner = _writer(kind, x, v)
    if not decorated:
        inner = inner.python_function

    @tf.function(autograph=False)
    def step() -> Any:
        with AssignAwareTape() as tape:
            with _beside(recorder, x):
                inner()
            y = v * v
        return y, tape.gradient(y, x)

    y, grad = step()
    assert float(y) == 16.0
    assert float(grad) == 16.0
