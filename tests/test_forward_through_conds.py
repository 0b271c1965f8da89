"""Forward mode through a compiled ``tf.cond`` whose branch writes, with a
persistent recorder (or more than one) beside the accumulator.

TensorFlow then puts the cond in a function call (``cflow_gradient_wrapper``),
and its forward mode through that call drops the tangent the branch gets
through a captured variable: the jvp was silently wrong (or None). Each case
must give the rewrite's jvp or be refused with ``ControlFlowWriteError``; with
one non-persistent tape the jvp is the rewrite's (not refused)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

import assigntape
from assigntape import AssignAwareTape, ControlFlowWriteError

X0, V0, TAN = [0.7, -1.2, 0.4], [1.5, -0.5, 2.0], [1.0, 0.5, -2.0]
ACCUMULATORS = [assigntape.ForwardAccumulator, tf.autodiff.ForwardAccumulator]


def _rewrite_jvp() -> float:
    """The oracle: the program on tensors (``v`` is ``v0 * x`` after the write
    in the branch that runs, ``x[0] > 0``), under TensorFlow's accumulator."""
    x = tf.constant(X0, tf.float64)
    with tf.autodiff.ForwardAccumulator(x, tf.constant(TAN, tf.float64)) as acc:
        v = tf.constant(V0, tf.float64) * x
        y = tf.reduce_sum(v * v) + tf.reduce_sum(tf.sin(v) * x)
    return float(acc.jvp(y))


def _jvp(accumulator: Any, recorders: Callable[[], Any], jit: bool = False, nested: bool = False) -> Any:
    """The jvp of the program with a write in a cond branch, in a tf.function
    with ``recorders()`` (a context manager) open inside the accumulator."""
    v = tf.Variable(V0, dtype=tf.float64)
    x = tf.Variable(X0, dtype=tf.float64)

    def branch() -> Any:
        v.assign(v * x)
        return tf.reduce_sum(v * v)

    def zero() -> Any:
        return tf.constant(0.0, tf.float64)

    @tf.function(jit_compile=jit)
    def f() -> Any:
        with accumulator(x, tf.constant(TAN, tf.float64)) as acc:
            with recorders():
                if nested:
                    y = tf.cond(x[0] > 0, lambda: tf.cond(x[1] < 0, branch, zero), zero)
                else:
                    y = tf.cond(x[0] > 0, branch, zero)
                y = y + tf.reduce_sum(tf.sin(v) * x)
        return acc.jvp(y)

    return f()


def _ours(persistent: bool) -> Callable[[], Any]:
    return lambda: AssignAwareTape(persistent=persistent)


@contextlib.contextmanager
def _plain_inside() -> Any:
    with AssignAwareTape(), tf.GradientTape(persistent=True):
        yield


@contextlib.contextmanager
def _plain_around() -> Any:
    with tf.GradientTape(persistent=True), AssignAwareTape():
        yield


@contextlib.contextmanager
def _ours_inside_persistent() -> Any:
    with AssignAwareTape(), AssignAwareTape(persistent=True):
        yield


def _right_or_refused(compute: Callable[[], Any], expected: float) -> None:
    try:
        got = compute()
    except ControlFlowWriteError as error:
        assert "function call" in str(error) or "jit_compile" in str(error)
        return
    assert got is not None, "jvp None (the rewrite has one)"
    np.testing.assert_allclose(float(got), expected, rtol=1e-9)


@pytest.mark.parametrize("accumulator", ACCUMULATORS)
@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "recorders",
    [_ours(True), _plain_inside, _plain_around, _ours_inside_persistent],
    ids=["persistent", "plain-persistent-inside", "plain-persistent-around", "inner-persistent-of-ours"],
)
def test_persistent_recorder_write_in_cond(accumulator: Any, jit: bool, recorders: Any) -> None:
    _right_or_refused(lambda: _jvp(accumulator, recorders, jit), _rewrite_jvp())


@pytest.mark.parametrize("accumulator", ACCUMULATORS)
def test_persistent_recorder_write_in_nested_cond(accumulator: Any) -> None:
    # x[1] < 0, so the inner branch runs too: the same rewrite.
    _right_or_refused(lambda: _jvp(accumulator, _ours(True), nested=True), _rewrite_jvp())


@pytest.mark.parametrize("accumulator", ACCUMULATORS)
@pytest.mark.parametrize("nested", [False, True])
def test_one_non_persistent_tape_is_right_not_refused(accumulator: Any, nested: bool) -> None:
    np.testing.assert_allclose(float(_jvp(accumulator, _ours(False), nested=nested)), _rewrite_jvp(), rtol=1e-9)


# -- Keras optimizers whose step has a cond that writes ------------------------------

A = tf.constant([1.0, 2.0, -1.0], tf.float64)


def _keras_steps(kind: str, lr0: float) -> Any:
    """The learning rate and three Keras optimizer steps (a Python function)
    returning the loss after them."""
    w = keras.Variable(np.array([0.3, -0.7, 1.1]), dtype="float64", name="w")
    lr = tf.Variable(lr0, dtype=tf.float64)
    if kind == "sgd_accumulation":
        opt: Any = keras.optimizers.SGD(learning_rate=lambda: lr * 1.0, gradient_accumulation_steps=2)
    elif kind == "loss_scale":
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=lambda: lr * 1.0))
    else:  # an EMA overwrite in a cond whose call carries the tangent: right, not refused
        opt = keras.optimizers.Adam(learning_rate=lambda: lr * 1.0, use_ema=True, ema_overwrite_frequency=2)
    opt.build([w])

    def steps() -> Any:
        for _ in range(3):
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum((w * A - 1.0) ** 2 * tf.sin(w))
            opt.apply_gradients(zip(inner.gradient(loss, [w]), [w]))
        return tf.reduce_sum(tf.cos(w) * A)

    return lr, steps


def _keras_program(kind: str, persistent: bool, forward: bool, lr0: float = 0.05) -> Any:
    """Three Keras optimizer steps in a tf.function; with ``forward`` the jvp
    along the learning rate, else the loss."""
    lr, steps = _keras_steps(kind, lr0)

    @tf.function
    def f() -> Any:
        if not forward:
            return steps()
        with assigntape.ForwardAccumulator(lr, tf.constant(1.0, tf.float64)) as acc:
            with AssignAwareTape(persistent=persistent):
                y = steps()
        return acc.jvp(y)

    return f()


def _finite_difference(kind: str) -> float:
    """The oracle: central differences of the loss along the learning rate."""
    h = 1e-6
    return float(
        (_keras_program(kind, False, False, 0.05 + h) - _keras_program(kind, False, False, 0.05 - h)) / (2 * h)
    )


@pytest.mark.parametrize("kind", ["sgd_accumulation", "loss_scale"])
def test_keras_cond_steps_under_persistent_tape(kind: str) -> None:
    _right_or_refused(lambda: _keras_program(kind, True, True), _finite_difference(kind))


@pytest.mark.parametrize("kind", ["sgd_accumulation", "loss_scale"])
def test_keras_cond_steps_under_one_non_persistent_tape_are_refused_with_a_way_that_works(kind: str) -> None:
    # These steps take a gradient inside the accumulator (forward over
    # reverse) through conds TensorFlow's forward mode cannot carry: refused,
    # the message names reverse mode, and reverse mode is right.
    with pytest.raises(ControlFlowWriteError) as refused:
        _keras_program(kind, False, True)
    assert "reverse mode" in str(refused.value)
    if kind == "sgd_accumulation":  # refused at the inner gradient
        assert "forward over reverse" in str(refused.value)
    lr, steps = _keras_steps(kind, 0.05)

    @tf.function
    def hypergradient() -> Any:
        with AssignAwareTape(persistent=True) as tape:
            y = steps()
        return tape.gradient(y, lr)

    np.testing.assert_allclose(float(hypergradient()), _finite_difference(kind), rtol=1e-6)


@pytest.mark.parametrize("persistent", [False, True])
def test_keras_ema_overwrite_stays_right(persistent: bool) -> None:
    got = _keras_program("ema", persistent, True)
    np.testing.assert_allclose(float(got), _finite_difference("ema"), rtol=1e-5)


# -- a write before a writing cond (adversary round 5, f08) -------------------
#
# One non-persistent AssignAwareTape beside one accumulator, in a tf.function,
# and a write of ``u`` before a cond whose branch writes ``u`` again: the
# accumulator then has a tangent for the cond's input (``u``'s version), and
# TensorFlow asked for higher order and put the cond inside a function call,
# whose forward mode failed on the optionals of the branch's intermediates
# (refused, "variant") or dropped the tangent entering through the captured
# ``x`` (a silently wrong jvp: branches ``u + x``, ``x * x``).

XB, UB, TB = [1.5, -0.7], [0.5, -0.3], [1.0, -2.0]

# The write before the cond: (name, on the variable, on tensors: the rewrite).
_WRITES_BEFORE: Any = {
    "assign": (lambda u, x: u.assign(u * x), lambda u, x: u * x),
    "assign_add": (lambda u, x: u.assign_add(x * x), lambda u, x: u + x * x),
    "scatter": (
        lambda u, x: u.scatter_nd_update([[1]], [x[0] * u[1]]),
        lambda u, x: tf.tensor_scatter_nd_update(u, [[1]], [x[0] * u[1]]),
    ),
    # SGD(0.1) on the gradient 2 u x: u - 0.2 u x.
    "sgd": (None, lambda u, x: u - 0.1 * (2.0 * u * x)),
}

# The branch that writes (the other leaves ``u`` as it is): on the variable's
# value (read in the branch) and ``x``.
_BRANCHES: Any = {
    "u*x": lambda u, x: u * x,
    "u+x": lambda u, x: u + x,
    "x*x": lambda u, x: x * x,
}


def _rewrite(x: Any, before: str, branch: str) -> Any:
    u = _WRITES_BEFORE[before][1](tf.constant(UB, tf.float64), x)
    u = _BRANCHES[branch](u, x) if XB[0] > 0 else u
    return tf.reduce_sum(u * x) + tf.reduce_sum(tf.sin(u))


def _rewrite_jvp_and_grad(before: str, branch: str) -> Any:
    """The oracle: the assignment-free rewrite under TensorFlow's accumulator
    and a plain tape, eagerly."""
    x = tf.constant(XB, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(x)
        with tf.autodiff.ForwardAccumulator(x, tf.constant(TB, tf.float64)) as acc:
            y = _rewrite(x, before, branch)
    return float(acc.jvp(y)), tape.gradient(y, x).numpy()


def _write_before_cond(accumulator: Any, tape_outside: bool, before: str, branch: str, compiled: bool) -> Any:
    u = tf.Variable(UB, dtype=tf.float64)
    x = tf.Variable(XB, dtype=tf.float64)
    write, _ = _WRITES_BEFORE[before]
    if write is None:
        opt = keras.optimizers.SGD(learning_rate=0.1)
        opt.build([u])  # its variables made before the function

        def write(u: Any, x: Any) -> Any:
            return opt.apply_gradients([(2.0 * u * x, u)])

    def run() -> Any:
        u.assign(UB)
        tape = AssignAwareTape()
        acc = accumulator(x, tf.constant(TB, tf.float64))
        outer, inner = (tape, acc) if tape_outside else (acc, tape)
        with outer, inner:
            write(u, x)
            tf.cond(x[0] > 0, lambda: u.assign(_BRANCHES[branch](u, x)), lambda: u.assign(u))
            y = tf.reduce_sum(u * x) + tf.reduce_sum(tf.sin(u))
        return acc.jvp(y), tape.gradient(y, x)

    return (tf.function(run) if compiled else run)()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("tape_outside", [False, True], ids=["tape_inside", "tape_outside"])
@pytest.mark.parametrize("accumulator", ACCUMULATORS, ids=["ours", "tf"])
@pytest.mark.parametrize("branch", sorted(_BRANCHES))
@pytest.mark.parametrize("before", sorted(_WRITES_BEFORE))
def test_write_before_a_writing_cond(
    accumulator: Any, tape_outside: bool, before: str, branch: str, compiled: bool
) -> None:
    jvp, grad = _write_before_cond(accumulator, tape_outside, before, branch, compiled)
    want_jvp, want_grad = _rewrite_jvp_and_grad(before, branch)
    # (Keras keeps SGD's learning rate in float32.)
    np.testing.assert_allclose(float(jvp), want_jvp, rtol=1e-6 if before == "sgd" else 1e-9)
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-6 if before == "sgd" else 1e-9)


@pytest.mark.parametrize("accumulator", ACCUMULATORS, ids=["ours", "tf"])
@pytest.mark.parametrize("form", ["case", "nested_cond"])
def test_write_before_nested_writing_conds_stays_refused(accumulator: Any, form: str) -> None:
    # One cond is recorded bare and right (above); a tf.case or nested conds
    # that write, after a write, are not: TensorFlow's forward mode fails on
    # them (documented in known-limits), refused while tracing, nothing run.
    u = tf.Variable(UB, dtype=tf.float64)
    x = tf.Variable(XB, dtype=tf.float64)

    def conditional() -> Any:
        if form == "case":
            pairs = [(x[0] > 2.0, lambda: u.assign(u * x)), (x[0] > 1.0, lambda: u.assign(u + x))]
            return tf.case(pairs, default=lambda: u.assign(u))
        inner = lambda: tf.cond(x[1] < 0, lambda: u.assign(u + x), lambda: u.assign(u))  # noqa: E731
        return tf.cond(x[0] > 0, inner, lambda: u.assign(u))

    @tf.function
    def f() -> Any:
        acc, tape = accumulator(x, tf.constant(TB, tf.float64)), AssignAwareTape()
        with acc, tape:
            u.assign(u * x)
            conditional()
            y = tf.reduce_sum(u * x) + tf.reduce_sum(tf.sin(u))
        return acc.jvp(y), tape.gradient(y, x)

    with pytest.raises(ControlFlowWriteError, match="forward mode"):
        f()
    np.testing.assert_array_equal(u.numpy(), UB)  # nothing ran


def test_write_before_a_writing_cond_oracle_by_finite_differences() -> None:
    """The rewrite itself, against central differences along the tangent."""
    x, t, h = np.array(XB), np.array(TB), 1e-6
    for before in _WRITES_BEFORE:
        for branch in _BRANCHES:
            f = lambda z: float(_rewrite(tf.constant(z), before, branch))  # noqa: E731
            fd = (f(x + h * t) - f(x - h * t)) / (2 * h)
            np.testing.assert_allclose(_rewrite_jvp_and_grad(before, branch)[0], fd, rtol=1e-6)


def test_eager_accumulator_around_the_first_call_of_a_tape_function_says_to_trace_first() -> None:
    # The written value computed before the cond: the refusal comes from the
    # branch's gradient, and names the workaround (which is right: y = (v h)^2
    # with h = x, v = 1: y = x^2 = 4, dy/dx = 2x = 4, and the jvp along x 4).
    x, v = tf.Variable(2.0), tf.Variable(1.0)

    def make() -> Any:
        @tf.function
        def step() -> Any:
            with AssignAwareTape() as tape:
                h = x * 1.0
                tf.cond(x > 0, lambda: v.assign(v * h), lambda: v.assign(v))
                y = v * v
            return y, tape.gradient(y, x)

        return step

    with pytest.raises(ControlFlowWriteError, match="call the function once before opening it"):
        with tf.autodiff.ForwardAccumulator(x, tf.constant(1.0)):
            make()()
    v.assign(1.0)
    step = make()
    step()  # traced outside the accumulator
    v.assign(1.0)
    with tf.autodiff.ForwardAccumulator(x, tf.constant(1.0)) as acc:
        y, grad = step()
    assert (float(y), float(grad), float(acc.jvp(y))) == (4.0, 4.0, 4.0)
