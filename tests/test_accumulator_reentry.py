"""A ``tf.autodiff.ForwardAccumulator`` that recorded writes under an
``AssignAwareTape``, exited, and is entered again after that tape closed,
inside a new ``AssignAwareTape``: it goes on from the versions it saw (as a
plain tape entered again does), lazily, at each variable's first read, and the
accumulators keep their nesting order. Expected values: the assignment-free
rewrite (the same program on tensors) under plain TensorFlow accumulators."""

from __future__ import annotations

from typing import Tuple

import pytest
import tensorflow as tf

import assigntape
from assigntape import AssignAwareTape

X = 3.0
V0 = 2.0


def _rewrite_first_order() -> tf.Tensor:
    x = tf.constant(X)
    acc = tf.autodiff.ForwardAccumulator(x, tf.constant(1.0))
    with acc:
        v1 = tf.constant(V0) * x  # v.assign(v * x)
    with acc:  # entered again
        y = v1 * v1
    return acc.jvp(y)


def _written_under_a_tape() -> Tuple[tf.Tensor, tf.Variable, tf.autodiff.ForwardAccumulator]:
    """x, v, and an accumulator of x (tangent 1) that recorded ``v.assign(v *
    x)`` inside an ``AssignAwareTape``, both closed since."""
    x = tf.constant(X)
    v = tf.Variable(V0)
    acc = tf.autodiff.ForwardAccumulator(x, tf.constant(1.0))
    with AssignAwareTape():
        with acc:
            v.assign(v * x)
    return x, v, acc


def test_an_accumulator_entered_again_inside_a_new_tape_goes_on_from_its_versions():
    x, v, acc = _written_under_a_tape()
    with AssignAwareTape() as tape:
        with acc:
            y = v * v
    expected = _rewrite_first_order()  # 2 v1 * dv1/dx = 2 * 6 * 2
    assert float(expected) == 24.0
    found = acc.jvp(y)
    assert found is not None and float(found) == float(expected)
    # The new tape, opened after the write, sees v as a variable of its own.
    assert float(tape.gradient(y, v)) == 2 * V0 * X


def test_an_accumulator_entered_again_alone_still_goes_on_from_its_versions():
    _, v, acc = _written_under_a_tape()
    with acc:
        y = v * v
    assert float(acc.jvp(y)) == float(_rewrite_first_order())


def test_a_write_while_the_accumulator_was_closed_has_no_tangent_for_it():
    x, v, acc = _written_under_a_tape()
    v.assign_add(x)  # the accumulator is closed: it does not see this write
    with AssignAwareTape():
        with acc:
            y = v * v
    # The rewrite: the second write computed outside the accumulator.
    ref = tf.autodiff.ForwardAccumulator(x, tf.constant(1.0))
    with ref:
        v1 = tf.constant(V0) * x
    v2 = v1 + x
    with ref:
        y_ref = v2 * v2
    assert ref.jvp(y_ref) is None
    assert acc.jvp(y) is None


def test_accumulators_keep_their_nesting_order_when_one_entered_again_goes_on():
    """Forward over forward: ``inner``, entered inside the accumulator entered
    again, computes its jvp, which the outer one differentiates: only if the
    outer one stays outer (sees what the inner one computes)."""
    x, v, outer = _written_under_a_tape()
    with AssignAwareTape():
        with outer:
            with tf.autodiff.ForwardAccumulator(x, tf.constant(1.0)) as inner:
                y = v * v * x  # the first read of v here: the outer one goes on from its version
                inner_jvp = inner.jvp(y)
    found = outer.jvp(inner_jvp)

    ref = tf.autodiff.ForwardAccumulator(x, tf.constant(1.0))
    with ref:
        v1 = tf.constant(V0) * x
    with ref:
        with tf.autodiff.ForwardAccumulator(x, tf.constant(1.0)) as ref_inner:
            y_ref = v1 * v1 * x
            ref_inner_jvp = ref_inner.jvp(y_ref)
    expected = ref.jvp(ref_inner_jvp)  # inner: v1^2 = 36 (v1 constant for it); outer: 2 v1 * 2 = 24
    assert float(ref_inner_jvp) == 36.0 and float(expected) == 24.0
    assert float(inner_jvp) == float(ref_inner_jvp)
    assert found is not None and float(found) == float(expected)


@pytest.mark.parametrize("kind", ["tf", "assigntape"])
@pytest.mark.parametrize("between", ["nothing", "an exception", "another tape's write", "a read in a tape"])
def test_an_accumulator_entered_a_third_time_goes_on_from_what_it_left_unread(kind: str, between: str) -> None:
    """Entered again inside a new tape without reading ``v``, then a third
    time alone: it still goes on from its own version of ``v`` (as a plain
    tape does). Rewrite: v1 = v0 x = 6, w = v1^2, dw/dx = 2 v1 v0 = 24."""
    x = tf.constant(X)
    v = tf.Variable(V0)
    make = tf.autodiff.ForwardAccumulator if kind == "tf" else assigntape.ForwardAccumulator
    acc = make(x, tf.constant(1.0))
    with AssignAwareTape():
        with acc:
            v.assign(v * x)
    try:
        with AssignAwareTape():
            with acc:
                if between == "an exception":
                    raise ValueError("inside")
    except ValueError:
        pass
    if between == "another tape's write":
        u = tf.Variable(1.0)
        with AssignAwareTape():
            u.assign(u * x)
    if between == "a read in a tape":
        with AssignAwareTape():
            _ = v * 1.0
    with acc:
        w = v * v
    assert float(acc.jvp(w, unconnected_gradients="zero")) == 2 * (V0 * X) * V0


@pytest.mark.parametrize("kind", ["tf", "assigntape"])
def test_variables_left_unread_in_an_entry_keep_their_versions_for_the_next(kind: str) -> None:
    """Records v <- v x and u <- u x; entered again in a new tape, reads only
    v; entered a third time alone, reads u and v. Rewrite: u1 = u0 x = 3,
    d(u1^2)/dx = 2 u1 u0 = 6; v1 = 6, d(v1^2)/dx = 2 v1 v0 = 24."""
    x = tf.constant(X)
    v, u = tf.Variable(V0), tf.Variable(1.0)
    make = tf.autodiff.ForwardAccumulator if kind == "tf" else assigntape.ForwardAccumulator
    acc = make(x, tf.constant(1.0))
    with AssignAwareTape():
        with acc:
            v.assign(v * x)
            u.assign(u * x)
    with AssignAwareTape():
        with acc:
            _ = v * 1.0
    with acc:
        w, z = u * u, v * v
    assert [float(acc.jvp(t, unconnected_gradients="zero")) for t in (w, z)] == [6.0, 24.0]
