"""Nested tapes, persistence, second order, jacobians across writes."""

from __future__ import annotations

import contextlib
from typing import Any, Dict

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape


def _rewrite_sum(a0, b0):
    with tf.GradientTape() as oracle:
        oracle.watch([a0, b0])
        c = a0 * b0 + b0
        loss = tf.reduce_sum(c * c)
    return oracle.gradient(loss, [a0, b0])


A0, B0 = np.array([1.0, 2.0], np.float32), np.array([3.0, -1.0], np.float32)


@modes
@pytest.mark.parametrize(
    "outer_cls,inner_cls",
    [
        (tf.GradientTape, AssignAwareTape),
        (AssignAwareTape, tf.GradientTape),
        (AssignAwareTape, AssignAwareTape),
    ],
    ids=["plain-outside", "plain-inside", "aware-in-aware"],
)
def test_nested_tapes_both_see_the_write(mode, outer_cls, inner_cls):
    a, b, c = tf.Variable(A0), tf.Variable(B0), tf.Variable([0.0, 0.0])

    def body():
        with outer_cls(persistent=True) as outer:
            with inner_cls(persistent=True) as inner:
                c.assign(a * b + b)
                loss = tf.reduce_sum(c * c)
        return outer.gradient(loss, [a, b]), inner.gradient(loss, [a, b])

    outer_g, inner_g = run(mode, body)
    expected = _rewrite_sum(tf.constant(A0), tf.constant(B0))
    assert_grads_close(outer_g, expected)
    assert_grads_close(inner_g, expected)


def test_inner_tape_started_after_a_write_of_the_outer():
    v, a = tf.Variable(2.0), tf.Variable(3.0)
    with AssignAwareTape() as outer:
        v.assign(v * a)  # v1 = v0 a
        with AssignAwareTape(persistent=True) as inner:
            v.assign(v * v)  # v2 = v1^2
            loss = v * 1.0
        v.assign(v + 1.0)  # after the inner tape: not its business
    # For the inner tape, "v" means v1, its value at the inner tape's start.
    assert float(inner.gradient(loss, v)) == 2 * 6.0
    assert inner.gradient(loss, a) is None  # a was read before the inner tape began
    dv, da = outer.gradient(loss, [v, a])  # loss = (v0 a)^2
    assert float(dv) == 2 * 2.0 * 3.0**2 and float(da) == 2 * 3.0 * 2.0**2
    assert len(inner.versions(v)) == 2


@modes
def test_persistent_tape_many_gradients(mode):
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(2.0)

    def body():
        with AssignAwareTape(persistent=True) as tape:
            v.assign_sub(v * a)  # v1 = v0 (1 - a)
            l1 = tf.reduce_sum(v)
            v.assign(v * a)  # v2 = v1 a
            l2 = tf.reduce_sum(v * v)
        return [tape.gradient(l1, [v, a]), tape.gradient(l2, [v, a]), tape.gradient(l2, [v, a])]

    g1, g2, g2_again = run(mode, body)
    np.testing.assert_allclose(g1[0], [-1.0, -1.0])
    np.testing.assert_allclose(g1[1], -3.0)
    # l2 = sum(v0^2 (1-a)^2 a^2): d/dv0 = 2 v0 (1-a)^2 a^2, d/da = sum v0^2 * d[(a - a^2)^2]
    np.testing.assert_allclose(g2[0], 2 * np.array([1.0, 2.0]) * 4.0)
    np.testing.assert_allclose(g2[1], 5.0 * 2 * (2.0 - 4.0) * (1 - 2 * 2.0))
    assert_grads_close(g2_again, g2)


def _maml_functional(w0, b0, lr, x, y):
    with tf.GradientTape() as outer:
        outer.watch([w0, b0, lr])
        with tf.GradientTape() as inner:
            inner.watch([w0, b0])
            inner_loss = tf.reduce_mean((tf.tanh(x @ w0 + b0) - y) ** 2)
        gw, gb = inner.gradient(inner_loss, [w0, b0])
        w1, b1 = w0 - lr * gw, b0 - lr * gb
        outer_loss = tf.reduce_mean((tf.tanh(x @ w1 + b1) - 2.0 * y) ** 2)
    return outer.gradient(outer_loss, [w0, b0, lr])


@modes
@pytest.mark.parametrize("inner_cls", [tf.GradientTape, AssignAwareTape])
def test_maml_second_order(mode, inner_cls):
    x = tf.random.stateless_normal([8, 3], seed=[0, 1])
    y = tf.random.stateless_normal([8, 2], seed=[0, 2])
    w0 = tf.random.stateless_normal([3, 2], seed=[0, 3])
    b0 = tf.random.stateless_normal([2], seed=[0, 4])
    w, b, lr = tf.Variable(w0), tf.Variable(b0), tf.Variable(0.3)

    def body():
        with AssignAwareTape() as outer:
            with inner_cls() as inner:
                inner_loss = tf.reduce_mean((tf.tanh(x @ w + b) - y) ** 2)
            gw, gb = inner.gradient(inner_loss, [w, b])
            w.assign_sub(lr * gw)
            b.assign_sub(lr * gb)
            outer_loss = tf.reduce_mean((tf.tanh(x @ w + b) - 2.0 * y) ** 2)
        return outer.gradient(outer_loss, [w, b, lr])

    got = run(mode, body)
    w.assign(w0), b.assign(b0)
    assert_grads_close(got, _maml_functional(w0, b0, tf.constant(0.3), x, y), rtol=1e-5)


@modes
@pytest.mark.parametrize("use_pfor", [True, False])
def test_jacobian_across_writes(mode, use_pfor):
    m = tf.constant([[1.0, 2.0], [0.5, -1.0], [3.0, 0.25]])
    x, v = tf.Variable([0.3, -0.7]), tf.Variable(tf.zeros([3]))

    def body():
        with AssignAwareTape(persistent=True) as tape:
            v.assign(tf.linalg.matvec(m, x))
            v.assign_add(x[0] * v)
            y = tf.tanh(v)
        return tape.jacobian(y, [x, v], experimental_use_pfor=use_pfor)

    x0 = tf.constant([0.3, -0.7])
    with tf.GradientTape() as oracle:
        oracle.watch(x0)
        v1 = tf.linalg.matvec(m, x0)
        y = tf.tanh(v1 + x0[0] * v1)
    jx, jv = run(mode, body)
    assert_grads_close(jx, oracle.jacobian(y, x0), rtol=1e-5)
    assert jv is None  # v is overwritten before it is read


@modes
def test_jacobian_zero_unconnected_for_an_overwritten_variable(mode):
    x, v = tf.Variable([0.3, -0.7]), tf.Variable(tf.zeros([3]))

    def body():
        with AssignAwareTape() as tape:
            v.assign(tf.stack([x[0], x[1], x[0] * x[1]]))
            y = v * 2.0
        return tape.jacobian(y, v, unconnected_gradients="zero")

    jv = run(mode, body)
    np.testing.assert_array_equal(jv, np.zeros([3, 3], np.float32))


@modes
def test_batch_jacobian_across_writes(mode):
    w = tf.constant([[1.0, -2.0, 0.5], [0.25, 1.0, 2.0]])
    xs = tf.Variable(tf.random.stateless_normal([4, 2], seed=[5, 6]))
    h = tf.Variable(tf.zeros([4, 3]))

    def body():
        with AssignAwareTape() as tape:
            h.assign(xs @ w)
            h.assign(tf.sin(h) * h)
            y = h * 1.0
        return tape.batch_jacobian(y, xs)

    x0 = tf.constant(xs.numpy())
    with tf.GradientTape() as oracle:
        oracle.watch(x0)
        h1 = x0 @ w
        y = tf.sin(h1) * h1
    assert_grads_close(run(mode, body), oracle.batch_jacobian(y, x0), rtol=1e-5)


@pytest.mark.parametrize("ask", ["inside", "after"])
def test_plain_tape_open_around_a_closed_aware_tape_names_the_latest_version(ask):
    # The plain tape is entered before the AssignAwareTape opens and is still
    # open when it closes; its gradient is asked while it is open or after.
    # (A tape entered before; the patches were installed by an earlier tape.)
    with AssignAwareTape():
        pass
    x, c = tf.Variable([1.0, 2.0]), tf.Variable([0.0, 0.0])
    with tf.GradientTape(persistent=True) as plain:
        with AssignAwareTape():
            c.assign(x * x * 3.0)
        if ask == "inside":
            grad, jac = plain.gradient(c, x), plain.jacobian(c, x)
    if ask == "after":
        grad, jac = plain.gradient(c, x), plain.jacobian(c, x)
    np.testing.assert_allclose(grad.numpy(), [6.0, 12.0])  # d(sum 3x^2)/dx
    np.testing.assert_allclose(jac.numpy(), np.diag([6.0, 12.0]))


@pytest.mark.parametrize("order", ["in_order", "out_of_order"])
def test_plain_tapes_entered_with_no_tape_of_ours_about_are_followed(monkeypatch, order):
    # Entered while nothing of ours is open or alive (and the patches TensorFlow
    # calls are off): the quick path of GradientTape.__enter__ / __exit__. A
    # tape exited before the one entered after it must leave that one followed.
    import gc

    from assigntape import _registry

    monkeypatch.setattr(_registry, "IDLE_SECONDS", 0.0)
    with AssignAwareTape():
        pass
    gc.collect()
    tf.Variable(0.0).assign(1.0)  # through a dormant patch: the patches come off
    x, c = tf.Variable([1.0, 2.0]), tf.Variable([0.0, 0.0])
    other = tf.GradientTape()
    plain = tf.GradientTape(persistent=True)
    if order == "out_of_order":
        other.__enter__()
        plain.__enter__()
        other.__exit__(None, None, None)
    else:
        plain.__enter__()
        other.__enter__()
        other.__exit__(None, None, None)
    del other
    gc.collect()
    with AssignAwareTape():
        c.assign(x * x * 3.0)
    grad = plain.gradient(c, x)
    plain.__exit__(None, None, None)
    np.testing.assert_allclose(grad.numpy(), [6.0, 12.0])  # d(sum 3x^2)/dx


@modes
def test_plain_tape_jacobian_with_a_variable_target_after_the_aware_tape_closed(mode):
    x, c = tf.Variable([[1.0, 2.0], [3.0, 4.0]]), tf.Variable(tf.zeros((2, 2)))

    def program():
        with AssignAwareTape():
            with tf.GradientTape(persistent=True) as plain:
                c.assign(x * x)
        return plain.jacobian(c, x), plain.batch_jacobian(c, x)

    jac, batch = run(mode, program)
    expected = np.diag([2.0, 4.0, 6.0, 8.0]).reshape(2, 2, 2, 2)
    np.testing.assert_allclose(jac.numpy(), expected)
    np.testing.assert_allclose(batch.numpy(), [[[2.0, 0.0], [0.0, 4.0]], [[6.0, 0.0], [0.0, 8.0]]])


@modes
@pytest.mark.parametrize("then", ["read", "write_and_read", "aware_again"])
def test_plain_tape_reads_after_the_aware_tape_inside_it_closed(mode, then):
    """A plain tape open around an AssignAwareTape recorded its writes: what it
    reads (and writes) after that tape closed, while it is still open, goes on
    from the latest version, as the rewrite does."""
    with AssignAwareTape():
        pass  # installed before the plain tape opens
    x, c = tf.Variable(3.0), tf.Variable(2.0)

    def program():
        c.assign(2.0)
        with tf.GradientTape(persistent=True) as plain:
            with AssignAwareTape():
                c.assign(c * x)  # 6
            if then == "write_and_read":
                c.assign_add(x * x)  # 15, no AssignAwareTape open
            elif then == "aware_again":
                with AssignAwareTape():
                    c.assign_add(x * x)
            y = c * c
        return plain.gradient(y, [x, c]), plain.gradient(c, x)

    (gx, gc), dc = run(mode, program)
    # The rewrite: c1 = c0 x, then (write) c2 = c1 + x^2, y = c^2.
    c1 = 2.0 * 3.0
    if then == "read":
        expected = (2 * c1 * 2.0, 2 * c1 * 3.0, 2.0)
    else:
        c2 = c1 + 9.0
        expected = (2 * c2 * (2.0 + 2 * 3.0), 2 * c2 * 3.0, 2.0 + 2 * 3.0)
    np.testing.assert_allclose([float(gx), float(gc), float(dc)], expected, rtol=1e-6)


def _recorder(kind: str, primal: Any) -> Any:
    """A persistent plain tape, or a forward accumulator with tangent 1 for ``primal``."""
    if kind == "plain tape":
        return tf.GradientTape(persistent=True)
    return tf.autodiff.ForwardAccumulator(primal, tf.constant(1.0, tf.float64))


@modes
@pytest.mark.parametrize("recorder", ["plain tape", "forward accumulator"])
@pytest.mark.parametrize("between", ["nothing", "a write", "a write in a function"])
@pytest.mark.parametrize("second", ["reads", "aware tape writes"])
def test_a_recorder_entered_again_goes_on_from_the_versions_it_held(mode, recorder, between, second):
    """A persistent plain tape (or an accumulator) held the versions of an
    AssignAwareTape that closed inside it; exited and entered again, it goes
    on from them, as the rewrite does. A write made while it was closed is
    one it did not record: the value written, with no gradient path."""
    with AssignAwareTape():
        pass  # installed before the recorder opens
    v, a = tf.Variable(2.0, dtype=tf.float64), tf.Variable(3.0, dtype=tf.float64)
    set_v = tf.function(lambda: v.assign(tf.constant(5.0, tf.float64)))

    def program():
        v.assign(2.0)
        outer = _recorder(recorder, a)
        with outer:
            if recorder == "plain tape":
                outer.watch(a)
            with AssignAwareTape():
                v.assign(v * a)  # 2a
        if between == "a write":
            v.assign(5.0)
        elif between == "a write in a function":
            set_v()
        with outer:
            if second == "aware tape writes":
                with AssignAwareTape():
                    v.assign(v * a)
                y = v * 1.0
            else:
                y = v * a
        return outer.gradient(y, a) if recorder == "plain tape" else outer.jvp(y)

    got = run(mode, program)
    # The rewrite: v1 = 2a (or 5, a constant, if written between), y = v1 a.
    expected = 2.0 * 2 * 3.0 if between == "nothing" else 5.0
    np.testing.assert_allclose(float(got), expected, rtol=1e-12)


@modes
def test_a_plain_tape_entered_again_names_a_source_by_its_first_entry(mode):
    """The variable source of a plain tape exited and entered again is its
    version when the tape was first entered, not when it was resumed."""
    with AssignAwareTape():
        pass  # installed before the plain tape opens
    v, a = tf.Variable(0.3, dtype=tf.float64), tf.Variable(0.7, dtype=tf.float64)

    def program():
        v.assign(0.3)
        plain = tf.GradientTape(persistent=True)
        with plain:
            with AssignAwareTape():
                v.assign(v * a)
        with plain:
            y = v * v
        return plain.gradient(y, [v, a])

    d_v, d_a = run(mode, program)
    # The rewrite: v1 = v0 a, y = v1^2: dy/dv0 = 2 v1 a, dy/da = 2 v1 v0.
    v1 = 0.3 * 0.7
    np.testing.assert_allclose([float(d_v), float(d_a)], [2 * v1 * 0.7, 2 * v1 * 0.3], rtol=1e-12)


_REENTRY_START = {"v": 2.0, "a": 3.0, "x": [1.0, 2.0], "c": [0.0, 0.0]}


def _exited_inside_then_entered_again(case: str, between: str, again: str, cell: Dict[str, Any]) -> Any:
    """A persistent plain tape P exits inside an AssignAwareTape; the
    AssignAwareTape closes; P is entered again (``again``: alone, or inside a
    new persistent AssignAwareTape T, whose gradients with respect to v, x, c
    at its entry are returned too). ``cell``: the variables, or for the
    rewrite tensors (rebound by each write, and plain tapes, watching at
    their entry the tensors a variable source means). ``case``: what P sees.

    * ``source``: v is written (v = v a) before P's entry; P reads v*v after
      its re-entry: dy/dv is for the version at P's entry.
    * ``target_chain``: P records c = 3x inside the AssignAwareTape; after its
      re-entry P reads c: dy/dx goes through that write.
    * ``written_while_closed``: P is entered before the write v = v a, which
      the AssignAwareTape makes after P exited: P did not record it, so the
      value P reads after its re-entry has no path to v at its entry.

    ``between`` = "a write": v and c are written outside every tape before
    the re-entry, which P did not record either.
    """
    f64 = tf.float64
    rewrite = not isinstance(cell["v"], tf.Variable)

    def read(k: str) -> Any:
        return cell[k]

    if rewrite:

        def write(k: str, value: Any) -> None:
            cell[k] = value
    else:

        def write(k: str, value: Any) -> None:
            cell[k].assign(value)

        for k, value in _REENTRY_START.items():
            write(k, tf.constant(value, f64))
    aware = tf.GradientTape if rewrite else AssignAwareTape
    plain = tf.GradientTape(persistent=True)
    with aware():
        if case == "source":
            write("v", read("v") * read("a"))
        with plain:
            if rewrite:  # a variable source: its value at the entry, watched
                plain.watch([cell["v"], cell["x"]])
            source, x = read("v"), read("x")
            if case == "target_chain":
                write("c", read("x") * 3.0)
        if case == "written_while_closed":
            write("v", read("v") * read("a"))
    if between == "a write":
        write("v", tf.constant(10.0, f64))
        write("c", tf.constant([5.0, 7.0], f64))
    around = aware(persistent=True) if again == "inside a new aware tape" else contextlib.nullcontext()
    with around:
        if rewrite and again != "alone":
            around.watch([cell["v"], cell["x"], cell["c"]])
        at_entry = [cell["v"], cell["x"], cell["c"]]
        with plain:
            y = read("v") * read("v") + tf.reduce_sum(read("c") * read("c"))
    sources = [source, x] if rewrite else [cell["v"], cell["x"]]
    grads = plain.gradient(y, sources)
    if again != "alone":
        grads += around.gradient(y, at_entry)
    return [tf.fill([1], np.nan) if g is None else tf.reshape(g, [-1]) for g in grads]


@modes
@pytest.mark.parametrize("case", ["source", "target_chain", "written_while_closed"])
@pytest.mark.parametrize("between", ["nothing", "a write"])
@pytest.mark.parametrize("again", ["alone", "inside a new aware tape"])
def test_a_plain_tape_exited_inside_an_aware_tape_goes_on_from_its_versions_when_entered_again(
    mode, case, between, again
):
    """Found by adversarial reviews: P entered again after the AssignAwareTape
    closed (alone, or inside another) read the variables' own handles, so a
    source's gradient was None (``source``), a write's chain was lost
    (``target_chain``), or a write P never recorded was credited to the
    variable (``written_while_closed``)."""
    with AssignAwareTape():
        pass  # installed before the plain tape opens
    variables = {k: tf.Variable(value, dtype=tf.float64) for k, value in _REENTRY_START.items()}
    got = run(mode, lambda: _exited_inside_then_entered_again(case, between, again, variables))
    tensors = {k: tf.constant(value, tf.float64) for k, value in _REENTRY_START.items()}
    expected = _exited_inside_then_entered_again(case, between, again, tensors)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-12)


@modes
@pytest.mark.parametrize("accumulator", ["tf.autodiff", "assigntape"])
@pytest.mark.parametrize("between", ["nothing", "a write"])
def test_an_accumulator_exited_inside_an_aware_tape_goes_on_from_its_versions_when_entered_again(
    mode, accumulator, between
):
    """As for a plain tape: an accumulator that recorded v = v x inside an
    AssignAwareTape, entered again after it closed, reads that version, whose
    tangent it knows (found by an adversarial review: the jvp was None)."""
    import assigntape

    with AssignAwareTape():
        pass  # installed before the accumulator opens
    f64 = tf.float64
    kind = tf.autodiff.ForwardAccumulator if accumulator == "tf.autodiff" else assigntape.ForwardAccumulator
    v = tf.Variable([1.0, 2.0], dtype=f64)

    def program():
        v.assign([1.0, 2.0])
        x = tf.constant(2.0, f64)
        acc = kind(x, tf.constant(1.0, f64))
        with AssignAwareTape():
            with acc:
                v.assign(v * x)
        if between == "a write":
            v.assign(v + 1.0)  # not recorded: a constant for the accumulator
        with acc:
            y = tf.reduce_sum(v * v)
        return acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)

    # The rewrite: v1 = v0 x (tangent v0), v2 = v1 or stop_gradient(v1) + 1.
    x = tf.constant(2.0, f64)
    with tf.autodiff.ForwardAccumulator(x, tf.constant(1.0, f64)) as acc:
        v1 = tf.constant([1.0, 2.0], f64) * x
    v2 = v1 if between == "nothing" else tf.stop_gradient(v1) + 1.0
    with acc:
        y = tf.reduce_sum(v2 * v2)
    expected = acc.jvp(y, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    np.testing.assert_allclose(float(run(mode, program)), float(expected), rtol=1e-12)


@pytest.mark.parametrize("tape", ["plain", "persistent aware"])
def test_a_variable_made_while_a_tape_is_closed_is_not_a_write_for_it(tape):
    """Its initialization went through the write patches: noted as a write
    made while the tape was closed, its first read after the tape's re-entry
    was cut from it (found by an adversarial review: dy/dw None, not 2w)."""
    f64 = tf.float64
    v = tf.Variable(2.0, dtype=f64)
    closed = tf.GradientTape(persistent=True) if tape == "plain" else AssignAwareTape(persistent=True)
    if tape == "plain":
        with AssignAwareTape():
            with closed:
                v.assign(v * 3.0)
    else:
        with closed:
            v.assign(v * 3.0)
    w = tf.Variable(5.0, dtype=f64)
    with closed:
        y = w * w + v
    with tf.GradientTape() as plain:  # plain TensorFlow: creation is not a write
        y_plain = w * w
    assert float(closed.gradient(y, w)) == float(plain.gradient(y_plain, w)) == 10.0


def _persistent_tape_entered_again_inside(recorder: str, between: str, cell: Dict[str, Any]) -> Any:
    """A persistent tape T writes v = v a and closes; a recorder R (a plain
    tape or an AssignAwareTape) opens after; T is entered again inside R and
    reads v. Returns R's dy/dv (v at R's entry) and T's dy/dv, dy/da (at its
    first entry). ``cell``: the variables, or for the rewrite tensors under
    plain tapes watching at their entry what a variable source means there."""
    f64 = tf.float64
    rewrite = not isinstance(cell["v"], tf.Variable)
    if not rewrite:
        cell["v"].assign(tf.constant(2.0, f64))
    tape = tf.GradientTape(persistent=True) if rewrite else AssignAwareTape(persistent=True)
    with tape:
        if rewrite:
            tape.watch([cell["v"], cell["a"]])
        v_first, a = cell["v"], cell["a"]
        if rewrite:
            cell["v"] = cell["v"] * cell["a"]
        else:
            cell["v"].assign(cell["v"] * cell["a"])
    if between == "a write" and rewrite:
        cell["v"] = tf.constant(10.0, f64)
    elif between == "a write":
        cell["v"].assign(tf.constant(10.0, f64))
    outer = tf.GradientTape() if rewrite or recorder == "plain" else AssignAwareTape()
    with outer:
        if rewrite:
            outer.watch(cell["v"])
        v_at_outer = cell["v"]
        with tape:
            y = 2.0 * cell["v"] * cell["v"]
    d_outer = outer.gradient(y, v_at_outer)
    d_v, d_a = tape.gradient(y, [v_first, a])
    return [np.nan if g is None else g for g in (d_outer, d_v, d_a)]


@modes
@pytest.mark.parametrize("recorder", ["plain", "aware"])
@pytest.mark.parametrize("between", ["nothing", "a write"])
def test_a_persistent_tape_entered_again_inside_a_recorder_opened_since(mode, recorder, between):
    """Found by an adversarial review: entered again, T read v through its own
    latest version, which a recorder opened since never saw made (its dy/dv
    was None)."""
    variables = {"v": tf.Variable(2.0, dtype=tf.float64), "a": tf.Variable(3.0, dtype=tf.float64)}
    got = [float(g) for g in run(mode, lambda: _persistent_tape_entered_again_inside(recorder, between, variables))]
    tensors = {"v": tf.constant(2.0, tf.float64), "a": tf.constant(3.0, tf.float64)}
    expected = [float(g) for g in _persistent_tape_entered_again_inside(recorder, between, tensors)]
    np.testing.assert_allclose(got, expected, rtol=1e-12)


@pytest.mark.parametrize("accumulator", ["tf.autodiff", "assigntape"])
def test_a_persistent_tape_entered_again_inside_an_accumulator_opened_since(accumulator):
    """As above, for an accumulator whose primal is the variable: T reads v
    (= 3, written by T before) through its own version, whose tangent is the
    variable's (found by an adversarial review: the jvp was None). Eagerly
    only: in a tf.function it is still None (README, "Known limits")."""
    mode = "eager"
    import assigntape

    kind = tf.autodiff.ForwardAccumulator if accumulator == "tf.autodiff" else assigntape.ForwardAccumulator
    v = tf.Variable(1.0, dtype=tf.float64)

    def program():
        v.assign(1.0)
        tape = AssignAwareTape(persistent=True)
        with tape:
            v.assign(v * 3.0)
        with kind(v, tf.constant(1.0, tf.float64)) as acc:
            with tape:
                y = 2.0 * v * v
        return acc.jvp(y)

    # The rewrite: the accumulator's primal is v at its entry, 3: dy = 4 v = 12.
    primal = tf.constant(3.0, tf.float64)
    with tf.autodiff.ForwardAccumulator(primal, tf.constant(1.0, tf.float64)) as acc:
        y = 2.0 * primal * primal
    np.testing.assert_allclose(float(run(mode, program)), float(acc.jvp(y)), rtol=1e-12)


@modes
def test_two_plain_tapes_entered_again_inside_one_aware_tape_each_go_on_from_their_own(mode):
    """P records v = v a, then R records v = v b (while P is closed), inside
    one AssignAwareTape; inside a new one P and then R are entered again.
    For R, v is its own version (v0 a b); for P, R's write is one it did not
    record; for the new tape, v at its entry (found by an adversarial review:
    P's re-entry took v's place and R lost its path)."""
    f64 = tf.float64
    v, a, b = (tf.Variable(x, dtype=f64) for x in (2.0, 3.0, 5.0))

    def program():
        v.assign(2.0)
        first, second = tf.GradientTape(persistent=True), tf.GradientTape(persistent=True)
        with AssignAwareTape():
            with first:
                v.assign(v * a)
            with second:
                v.assign(v * b)
        with AssignAwareTape(persistent=True) as new:
            with first:
                pass
            with second:
                y = v * v
        return [
            np.nan if g is None else g for g in (*second.gradient(y, [v, b]), first.gradient(y, v), new.gradient(y, v))
        ]

    # The rewrite: v1 = v0 a = 6, v2 = v1 b = 30, y = v2^2. R's source v is
    # v at its entry, v1: dy/dv1 = 2 v2 b = 300, dy/db = 2 v2 v1 = 360. P:
    # v2 came from a write it did not record: no path. The new tape: v at its
    # entry is v2: dy/dv2 = 2 v2 = 60.
    np.testing.assert_allclose([float(g) for g in run(mode, program)], [300.0, 360.0, np.nan, 60.0], rtol=1e-12)


@modes
@pytest.mark.parametrize("order", ["written while both closed", "the aware tape entered first"])
def test_a_plain_tape_entered_again_inside_an_aware_tape_entered_again(mode, order):
    """A persistent AssignAwareTape T2 and a plain tape P both entered again,
    P inside T2, after a write T2 did not see (found by an adversarial review:
    T2 was credited through the identity made for P)."""
    f64 = tf.float64
    v = tf.Variable(2.0, dtype=f64)

    def program():
        v.assign(2.0)
        plain = tf.GradientTape(persistent=True)
        aware = AssignAwareTape(persistent=True)
        if order == "written while both closed":
            with AssignAwareTape():
                with plain:
                    v.assign(v * 3.0)  # 6
            with aware:
                y = v * 1.0
            v.assign(1.0)
        else:
            with aware:
                y = v * 1.0
            with AssignAwareTape():
                with plain:
                    v.assign(v * 3.0)
        with aware:
            with plain:
                y = y + v * v
        return [np.nan if g is None else g for g in (aware.gradient(y, v), plain.gradient(y, v))]

    # The rewrite. Written while both closed: T2's source is v = 6 (read by
    # y's first term): dy/dv = 1; the value 1 P and T2 read then came from a
    # write neither recorded. P's source v0 = 2: no path. Entered first: T2's
    # source v0 = 2 reaches y only through its first term (P's write was made
    # while T2 was closed): 1; P goes on from v1 = 3 v0: dy/dv0 = 2 v1 3 = 36.
    expected = [1.0, np.nan] if order == "written while both closed" else [1.0, 36.0]
    np.testing.assert_allclose([float(g) for g in run(mode, program)], expected, rtol=1e-12)


def test_an_aware_tape_a_plain_tape_is_entered_again_inside_watches_what_it_reads():
    """As tf.GradientTape in its place: the variables P goes on from are not
    watched by T2 until read (found by an adversarial review: T2 listed v,
    which it never read, and a gradient over its watched variables had a
    None)."""
    f64 = tf.float64

    def watched(kind: Any) -> Any:
        v, u = tf.Variable(2.0, dtype=f64, name="v"), tf.Variable(1.0, dtype=f64, name="u")
        plain = tf.GradientTape(persistent=True)
        with AssignAwareTape():
            with plain:
                v.assign(v * 2.0)
        with kind(persistent=True) as t2:
            with plain:
                y = u * 3.0
        names = [w.name for w in t2.watched_variables()]
        return names, [float(g) for g in t2.gradient(y, t2.watched_variables())]

    assert watched(AssignAwareTape) == watched(tf.GradientTape) == (["u:0"], [3.0])


def _two_tapes_entered_again_nested(outer: str, inner: str, written_after: bool, x: Any, v: Any) -> Any:
    """T1 writes v = v x and, with T2 open inside it, T2 writes v = v + x
    (``inner``: T2 an AssignAwareTape or a plain tape); with ``written_after``,
    T1 writes v = v v after T2 closed. Both are then entered again, ``outer``
    around the other, and read y = v x. Returns dy/dx and dy/dv of each (v:
    its version at the tape's first entry). ``v``: the variable, or for the
    rewrite a tensor, with plain tapes."""
    rewrite = not isinstance(v, tf.Variable)
    cell = {"v": v}

    def write(value: Any) -> None:
        if rewrite:
            cell["v"] = value
        else:
            v.assign(value)

    kind1 = tf.GradientTape if rewrite else AssignAwareTape
    kind2 = tf.GradientTape if rewrite or inner == "plain" else AssignAwareTape
    t1, t2 = kind1(persistent=True), kind2(persistent=True)
    with t1:
        t1.watch(x)
        if rewrite:
            t1.watch(v)
        v0 = cell["v"]
        write(cell["v"] * x)
        with t2:
            t2.watch(x)
            if rewrite:
                t2.watch(cell["v"])
            v1 = cell["v"]
            write(cell["v"] + x)
        if written_after:
            write(cell["v"] * cell["v"])
    first, second = (t1, t2) if outer == "T1" else (t2, t1)
    with first:
        with second:
            y = cell["v"] * x
    sources = {t1: v0 if rewrite else v, t2: v1 if rewrite else v}
    return [np.nan if g is None else g for t in (t1, t2) for g in t.gradient(y, [x, sources[t]])]


@modes
@pytest.mark.parametrize("outer", ["T1", "T2"])
@pytest.mark.parametrize("inner", ["aware", "plain"])
@pytest.mark.parametrize("written_after", [False, True])
def test_two_tapes_entered_again_nested_each_go_on_from_their_versions(mode, outer, inner, written_after):
    """Found by an adversarial review: the second tape entered again took the
    first one's place as the version's owner, and the first was credited
    through an identity of the variable's own handle (dy/dv None, dy/dx
    short)."""
    f64 = tf.float64
    v = tf.Variable(2.0, dtype=f64)

    def program():
        v.assign(2.0)
        return _two_tapes_entered_again_nested(outer, inner, written_after, tf.constant(3.0, f64), v)

    got = [float(g) for g in run(mode, program)]
    expected = [
        float(g)
        for g in _two_tapes_entered_again_nested(
            outer, inner, written_after, tf.constant(3.0, f64), tf.constant(2.0, f64)
        )
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-12)


@modes
@pytest.mark.parametrize("tape", ["persistent aware", "plain inside a new aware tape"])
def test_a_tape_entered_again_and_reset_before_any_read_starts_from_its_versions(mode, tape):
    """reset() before the first read after the re-entry: the versions it goes
    on from are current from there (found by an adversarial review: dy/dv was
    None, as if v's own handle were its source)."""
    f64 = tf.float64
    v = tf.Variable(2.0, dtype=f64)

    def program():
        v.assign(2.0)
        x = tf.constant(3.0, f64)
        again = AssignAwareTape(persistent=True) if tape == "persistent aware" else tf.GradientTape(persistent=True)
        with AssignAwareTape() if tape != "persistent aware" else contextlib.nullcontext():
            with again:
                again.watch(x)
                v.assign(v * x)  # 6
        with AssignAwareTape() if tape != "persistent aware" else contextlib.nullcontext():
            with again:
                again.reset()
                again.watch(x)
                y = v * v * x
        return again.gradient(y, [x, v])

    # The rewrite: after the reset the tape starts from v = 6 (watched) and
    # x: y = 36 x: dy/dx = 36, dy/dv = 2 v x = 36.
    np.testing.assert_allclose([float(g) for g in run(mode, program)], [36.0, 36.0], rtol=1e-12)


def _a_plain_tape_that_wrote_v_times_x(v: Any, between: str) -> Any:
    """A persistent plain tape P that recorded v = v0 x (v0 = 2, x = 3, watched)
    inside an AssignAwareTape, now closed; with ``between`` = "a write", v is
    then written outside every tape (5). Returns P and x."""
    x = tf.constant(3.0, tf.float64)
    v.assign(2.0)
    plain = tf.GradientTape(persistent=True)
    with AssignAwareTape():
        with plain:
            plain.watch(x)
            v.assign(v * x)  # 6
    if between == "a write":
        v.assign(5.0)
    return plain, x


@modes
@pytest.mark.parametrize("between", ["nothing", "a write"])
@pytest.mark.parametrize("empty", ["alone", "inside a new aware tape"])
def test_a_plain_tape_entered_again_and_exited_before_any_read_keeps_its_versions(mode, between, empty):
    """P records v = v x inside an AssignAwareTape, is entered again and exited
    with no read (alone, or inside a new AssignAwareTape), and entered again
    to read v v (found by an adversarial review: alone, the empty entry lost
    P's versions, which were to become current at their first read)."""
    f64 = tf.float64
    v = tf.Variable(2.0, dtype=f64)

    def program():
        plain, x = _a_plain_tape_that_wrote_v_times_x(v, between)
        with AssignAwareTape() if empty != "alone" else contextlib.nullcontext():
            with plain:
                pass
        with plain:
            y = v * v
        return [np.nan if g is None else g for g in plain.gradient(y, [v, x])]

    # The rewrite: v1 = v0 x, y = v1^2: dy/dv0 = 2 v1 x = 36, dy/dx = 2 v1 v0
    # = 24; after a write P did not see, y = 25 has no path to v0 or x.
    expected = [36.0, 24.0] if between == "nothing" else [np.nan, np.nan]
    np.testing.assert_allclose([float(g) for g in run(mode, program)], expected, rtol=1e-12)


@modes
@pytest.mark.parametrize(
    "when", ["written while closed, asked inside", "written while closed, asked after", "written after its exit"]
)
def test_a_variable_target_of_a_tape_entered_again_before_any_read(mode, when):
    """A persistent AssignAwareTape reads v (writes nothing); v is written
    outside every tape; the tape is entered again and reads only x. Its
    latest version of v is then one it did not see made (found by an
    adversarial review: gradient(v, [v, x]) was [1, None], the variable's own
    handle as target and source). Written after its last exit, v's latest
    version while it was open is still the one it started from."""
    f64 = tf.float64
    x, v = tf.Variable(1.0, dtype=f64), tf.Variable(0.0, dtype=f64)

    def program():
        v.assign(0.0)
        tape = AssignAwareTape(persistent=True)
        with tape:
            _ = v * x  # read, not written
        v.assign(5.0)
        if when == "written after its exit":
            return [np.nan if g is None else g for g in tape.gradient(v, [v, x])]
        with tape:
            _ = x * 1.0  # reads x only
            if when == "written while closed, asked inside":
                got = tape.gradient(v, [v, x])
        if when == "written while closed, asked after":
            got = tape.gradient(v, [v, x])
        return [np.nan if g is None else g for g in got]

    # The rewrite: the tape's v is v0 (watched), then v1 = 5, a constant for
    # it: its latest v is v1 (no path), or, written after its exit, v0 itself.
    expected = [1.0, np.nan] if when == "written after its exit" else [np.nan, np.nan]
    np.testing.assert_allclose([float(g) for g in run(mode, program)], expected, rtol=1e-12)


@modes
@pytest.mark.parametrize("between", ["nothing", "a write"])
@pytest.mark.parametrize("asked", ["inside", "after"])
@pytest.mark.parametrize("ask", ["gradient", "jacobian"])
def test_a_variable_target_of_a_plain_tape_entered_again_before_any_read(mode, between, asked, ask):
    """P records v = v x inside an AssignAwareTape; P is entered again alone
    and asked about v before reading it (found by an adversarial review: the
    variable's own handle was its target: [1, None])."""
    f64 = tf.float64
    v = tf.Variable(2.0, dtype=f64)

    def program():
        plain, x = _a_plain_tape_that_wrote_v_times_x(v, between)
        with plain:
            if asked == "inside":
                got = getattr(plain, ask)(v, [v, x])
        if asked == "after":
            got = getattr(plain, ask)(v, [v, x])
        return [np.nan if g is None else g for g in got]

    # The rewrite: P's latest v is v1 = v0 x: dv1/dv0 = x = 3, dv1/dx = v0 =
    # 2; after a write P did not see, its latest v has no path.
    expected = [3.0, 2.0] if between == "nothing" else [np.nan, np.nan]
    np.testing.assert_allclose([float(g) for g in run(mode, program)], expected, rtol=1e-12)


@modes
def test_a_plain_tape_opened_since_around_an_aware_tape_entered_again_keeps_its_target(mode):
    """T0 (persistent) wrote v and closed; a plain tape T1 opened after it
    enters T0 again inside and reads nothing: T1's v is the variable's own
    handle (found by an adversarial review: T0's version, which T1 never
    saw made: None)."""
    f64 = tf.float64
    v = tf.Variable(2.0, dtype=f64)

    def program():
        v.assign(2.0)
        x = tf.constant(3.0, f64)
        t0 = AssignAwareTape(persistent=True)
        with t0:
            t0.watch(x)
            v.assign_add(x)
        t1 = tf.GradientTape(persistent=True)
        with t1:
            t1.watch(x)
            with t0:
                pass
        return [np.nan if g is None else g for g in t1.gradient(v, [v, x])]

    # The rewrite: T1's v is v1 (watched at its entry), its target the same:
    # dv1/dv1 = 1; x reaches v1 before T1 opened: None.
    np.testing.assert_allclose([float(g) for g in run(mode, program)], [1.0, np.nan], rtol=1e-12)


@modes
def test_a_variable_target_of_a_tape_entered_again_where_a_plain_tape_kept_the_versions(mode):
    """A plain tape P open around everything keeps the scope; a persistent
    AssignAwareTape T writes a, exits; a is written (P holding); T is entered
    again, reads a and writes a = 2 b x. T's latest a is its own write
    (found by a generated program: the note that a was written while T was
    closed outlived the read, and a's target was taken for unseen: None)."""
    f64 = tf.float64
    a, b = tf.Variable(0.8, dtype=f64), tf.Variable(-0.6, dtype=f64)

    def program():
        a.assign(0.8)
        x = tf.constant(3.0, f64)
        tape = AssignAwareTape(persistent=True)
        with tf.GradientTape(persistent=True):
            with tape:
                tape.watch(x)
                a.assign(0.7)
            a.assign(a * x)
            with tape:
                _ = a * a
                a.assign(2.0 * b * x)
        return tape.gradient(a, x)

    # The rewrite: T's latest a is 2 b x: da/dx = 2 b = -1.2.
    np.testing.assert_allclose(float(run(mode, program)), -1.2, rtol=1e-12)


@modes
def test_a_plain_tape_entered_again_and_reset_after_a_write_it_did_not_see(mode):
    """P (persistent) held versions, exited; b is written outside every tape;
    P is entered again alone, reset, and exits: b's value is its source and
    its target alike (found by a generated program: the unseen write outlived
    the reset, and gave the source and the target two new versions)."""
    f64 = tf.float64
    b = tf.Variable(-0.6, dtype=f64)

    def program():
        b.assign(-0.6)
        plain = tf.GradientTape(persistent=True)
        with plain:
            with AssignAwareTape():
                b.assign(b * 2.0)
        b.assign(b - 0.9)
        with plain:
            plain.reset()
        return plain.gradient(b, b)

    # The rewrite: after the reset P starts from b's value then; b is not
    # written after: db/db = 1.
    np.testing.assert_allclose(float(run(mode, program)), 1.0, rtol=1e-12)


def test_a_plain_tape_outside_a_function_is_not_held_by_a_tape_inside_it():
    """Versions made in a tf.function's graph end with it: a plain tape open
    eagerly around the call sees the function as a whole (plain TensorFlow)."""
    with AssignAwareTape():
        pass
    x, c = tf.Variable(3.0), tf.Variable(2.0)

    @tf.function
    def step():
        with AssignAwareTape() as tape:
            c.assign(c * x)
            y = c * 1.0
        return tape.gradient(y, x)

    c.assign(2.0)
    with tf.GradientTape() as plain:
        inner = step()
        y = c * c
    from assigntape import _registry

    assert not _registry.any_scopes()
    assert float(inner) == 2.0
    assert float(plain.gradient(y, c)) == 12.0  # a plain read of the value 6


@modes
@pytest.mark.parametrize("where", ["inside_an_open_aware_tape", "holding_after_it_closed"])
def test_plain_tape_reset_beside_an_aware_tape_starts_from_the_versions_then(mode, where):
    """``reset()`` is leaving and entering again with a new tape: a variable
    source then means the variable's version at the reset, for a plain tape
    as for an AssignAwareTape."""
    with AssignAwareTape():
        pass
    x, c = tf.Variable(3.0), tf.Variable(2.0)

    def program():
        c.assign(2.0)
        if where == "inside_an_open_aware_tape":
            with AssignAwareTape():
                with tf.GradientTape() as plain:
                    c.assign(c * x)  # 6
                    plain.reset()
                    y = c * x
        else:
            with tf.GradientTape() as plain:
                with AssignAwareTape():
                    c.assign(c * x)
                plain.reset()
                y = c * x
        return plain.gradient(y, [x, c])

    gx, gc = run(mode, program)
    assert float(gx) == 6.0 and float(gc) == 3.0  # y = c_reset * x, c_reset = 6


def test_a_function_writing_while_a_plain_tape_holds_versions_is_refused_and_writes_nothing():
    from assigntape import UntrackedWriteError

    with AssignAwareTape():
        pass
    x, c = tf.Variable(3.0), tf.Variable(2.0)
    write = tf.function(lambda: c.assign(c * 2.0))
    with tf.GradientTape():
        with AssignAwareTape():
            c.assign(c * x)  # 6
        with pytest.raises(UntrackedWriteError, match="plain tf.GradientTape or ForwardAccumulator that recorded"):
            write()
    assert float(c) == 6.0


@modes
@pytest.mark.parametrize("recorder", ["plain tape", "forward accumulator"])
def test_a_recorder_entered_again_after_a_write_has_no_path_to_the_variable_before_it(mode, recorder):
    """As above, the gradient (or tangent) with respect to the variable itself:
    its source is its value when the recorder was first entered, and the write
    made while it was closed cut that path (the recorder went on from the
    variable's own handle, which is that source: 3.0 instead of None)."""
    with AssignAwareTape():
        pass  # installed before the recorder opens
    v, u = tf.Variable(2.0, dtype=tf.float64), tf.Variable(3.0, dtype=tf.float64)

    def program():
        v.assign(2.0)
        outer = _recorder(recorder, v)
        with outer:
            with AssignAwareTape():
                v.assign(v * u)
        v.assign(10.0)  # while the recorder is closed
        with outer:
            y = v * u
        if recorder == "plain tape":
            dv, du = outer.gradient(y, [v, u])
            return [np.nan if dv is None else dv, du, y]
        tangent = outer.jvp(y)
        return [np.nan if tangent is None else tangent, y]

    got = [float(x) for x in run(mode, program)]
    # The rewrite: y = stop_gradient(10) * u0: nothing reaches v0; dy/du0 = 10.
    expected = [np.nan, 10.0, 30.0] if recorder == "plain tape" else [np.nan, 30.0]
    np.testing.assert_allclose(got, expected, rtol=1e-12)


# -- a read under a tape's stop_recording() --------------------------------------
#
# A read is an identity op on the current version: under T.stop_recording() T
# does not record it (as tf.GradientTape does not record a read of a variable
# there), so T sees the value read as one it did not see. The rewrite reads
# each variable with tf.identity at the same place, under the same stops. These
# programs take an inner tape's gradient through such a read and ask the outer
# tape for the second order (found by an adversarial review).


class _Cell:
    """A variable, or in the rewrite a tensor rebound by each write and read
    through tf.identity where the program reads the variable."""

    def __init__(self, value: float, rewrite: bool) -> None:
        self.rewrite = rewrite
        self.value = tf.constant(value, tf.float64) if rewrite else tf.Variable(value, dtype=tf.float64)

    def read(self) -> Any:
        return tf.identity(self.value) if self.rewrite else self.value

    def assign(self, value: Any) -> None:
        if self.rewrite:
            self.value = value
        else:
            self.value.assign(value)


def _second_order_through_a_stopped_write(v: _Cell, outer: Any, x: Any) -> Any:
    with outer:
        outer.watch(x)
        v.assign(v.read() * 0.3 + x * 0.7)
        with tf.GradientTape() as inner:
            inner.watch(x)
            with outer.stop_recording():
                v.assign(v.read() + v.read() * x * -0.7)
            y = v.read() * x
        g = inner.gradient(y, x)
    return [g, outer.gradient(g, x)]


def _second_order_through_a_read_under_both_stops(v: _Cell, outer: Any, x: Any) -> Any:
    rewrite = v.rewrite
    with outer:
        outer.watch(x)
        with tf.GradientTape() if rewrite else AssignAwareTape() as inner:
            inner.watch(x)
            with inner.stop_recording():
                v.assign(v.read() * -0.51 + x * 1.51)
            with outer.stop_recording():
                y = v.read() * x
        g = inner.gradient(y, x)
    return [g, outer.gradient(g, x)]


def _three_tapes_middle_one_stopped(v: _Cell, outer: Any, x: Any) -> Any:
    rewrite = v.rewrite
    with outer:
        outer.watch(x)
        with tf.GradientTape() as middle:
            middle.watch(x)
            with tf.GradientTape() if rewrite else AssignAwareTape() as inner:
                inner.watch(x)
                v.assign(v.read() - (tf.sin(x) * -0.25 + v.read() * 0.25))
                with middle.stop_recording():
                    v.assign(v.read() + v.read() * x * 0.17)
                y = v.read() * x
            z = y + inner.gradient(y, x)
        total = z + middle.gradient(z, x)
    return [total, outer.gradient(total, x)]


_STOPPED_READ_PROGRAMS = {
    "second_order_through_a_stopped_write": _second_order_through_a_stopped_write,
    "read_under_both_stops": _second_order_through_a_read_under_both_stops,
    "three_tapes_middle_one_stopped": _three_tapes_middle_one_stopped,
}


def _none_as_nan(values: Any) -> Any:
    return [np.nan if g is None else float(g) for g in values]


@modes
@pytest.mark.parametrize("name", sorted(_STOPPED_READ_PROGRAMS))
def test_a_read_under_a_tapes_stop_is_not_seen_by_that_tape(mode, name):
    program = _STOPPED_READ_PROGRAMS[name]
    x = tf.constant(0.9, tf.float64)
    cell = _Cell(0.7, rewrite=False)
    got = _none_as_nan(run(mode, lambda: program(cell, AssignAwareTape(), x)))
    expected = _none_as_nan(program(_Cell(0.7, rewrite=True), tf.GradientTape(), x))
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    # The read's identity is what makes the difference: with the rewrite's reads
    # seen by the outer tape these programs have a different second order.
    assert not np.allclose(got, _none_as_nan(_seen_reads(program, x)), equal_nan=True)


def _seen_reads(program: Any, x: Any) -> Any:
    """The same rewrite with the outer tape seeing every value read."""
    seen = _Cell.read
    _Cell.read = lambda self: self.value  # type: ignore[method-assign]
    try:
        return program(_Cell(0.7, rewrite=True), tf.GradientTape(), x)
    finally:
        _Cell.read = seen  # type: ignore[method-assign]


@modes
def test_a_read_under_a_stop_with_no_write_is_as_tf_gradient_tape(mode):
    """No write: the same answer as tf.GradientTape, a read of ``w`` under the
    outer tape's stop gives it no path to ``w`` through the inner gradient."""

    w = tf.Variable(0.6, dtype=tf.float64)
    x = tf.constant(0.9, tf.float64)

    def program(outer_cls: Any) -> Any:
        with outer_cls() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                with outer.stop_recording():
                    y = w * w * x
            g = inner.gradient(y, x)
            h = g * w
        return [g, *outer.gradient(h, [w, x])]

    got = _none_as_nan(run(mode, lambda: program(AssignAwareTape)))
    np.testing.assert_allclose(got, _none_as_nan(run(mode, lambda: program(tf.GradientTape))), rtol=1e-12)
    np.testing.assert_allclose(got, [0.36, 0.36, np.nan], rtol=1e-12)


def test_a_stop_inside_a_compiled_branch_hides_no_read():
    """TensorFlow differentiates a compiled tf.cond by its branch graph, which
    knows nothing of a stop_recording() inside it: the reads there are seen by
    the tapes that recorded the cond, while a write there under the stop is cut
    for them (Semantics, 4). The answer is the rewrite with every read seen and
    the write under the stop."""
    x = tf.constant(0.9, tf.float64)
    v = tf.Variable(0.7, dtype=tf.float64)

    @tf.function
    def program() -> Any:
        v.assign(0.7)
        with AssignAwareTape() as outer:
            outer.watch(x)

            def branch() -> Any:
                v.assign(v * 0.3 + x * 0.7)
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    with outer.stop_recording():
                        v.assign_add(v * x * -0.7)
                    y = v * x
                return inner.gradient(y, x)

            g = tf.cond(x > 0.0, branch, lambda: x)
        return [g, outer.gradient(g, x)]

    got = _none_as_nan(program())
    expected = _none_as_nan(_seen_reads(_second_order_through_a_stopped_write, x))
    np.testing.assert_allclose(got, expected, rtol=1e-12)


_BAD_CALLS = {
    "extra positional": lambda f, y, w: f(y, [w], None, "none", "extra"),
    "target twice": lambda f, y, w: f(y, [w], target=y),
    "a required one missing": lambda f, y, w: f() if f.__name__ == "jvp" else f(y),
}


@pytest.mark.parametrize("call", list(_BAD_CALLS))
@pytest.mark.parametrize("method", ["gradient", "jvp"])
def test_a_followed_plain_tape_or_accumulator_called_wrongly_raises_pythons_error(method, call):
    """A plain tape's ``gradient`` (or an accumulator's ``jvp``) that has
    versions to map, called with arguments that do not bind, raises the
    error TensorFlow's method raises, not a result or a KeyError (helper-31)."""

    def outcome(beside):
        v, w = tf.Variable(2.0), tf.Variable(3.0)
        if method == "gradient":
            recorder = tf.GradientTape(persistent=True)
        else:
            recorder = tf.autodiff.ForwardAccumulator(w, tf.constant(1.0))
        with recorder:
            if beside:
                with AssignAwareTape():
                    v.assign(v * w)
            y = v * 1.0
        f = getattr(recorder, method)
        try:
            _BAD_CALLS[call](f, y, w)
        except TypeError as e:
            return str(e)
        return "no error"

    expected = outcome(beside=False)
    assert expected != "no error"
    assert outcome(beside=True) == expected


@modes
@pytest.mark.parametrize("ask", ["gradient", "zero", "jacobian"])
def test_a_plain_tape_asked_under_its_own_stop_recording_means_the_latest_version(mode, ask):
    """A variable target of a plain tape that is still open means its latest
    version, also while the tape is paused by its own ``stop_recording()``
    (helper-31: it meant the variable's own handle there, giving None).
    Rewrite: v1 = v0 * w, d v1 / d w = v0 = 2."""
    v, w = tf.Variable(2.0), tf.Variable(3.0)

    def program():
        v.assign(2.0)
        with AssignAwareTape():
            with tf.GradientTape(persistent=True) as plain:
                v.assign(v * w)
                with plain.stop_recording():
                    if ask == "jacobian":
                        return plain.jacobian(v, w)
                    return plain.gradient(v, [w], unconnected_gradients=ask if ask == "zero" else "none")[0]

    assert float(run(mode, program)) == 2.0


@pytest.mark.parametrize("outer", [AssignAwareTape, tf.GradientTape])
def test_a_plain_tape_lists_a_variable_read_through_two_versions_once(outer):
    """``watched_variables()`` of a plain tape lists each variable once, also
    when it read one through two versions (TensorFlow keys them by handle;
    helper-31 saw ``['v', 'w', 'v']``)."""
    v, w = tf.Variable(2.0, name="v"), tf.Variable(3.0, name="w")
    with outer():
        with tf.GradientTape() as plain:
            v.assign(v * w)
            _ = v * v + w
    assert [x.name for x in plain.watched_variables()] == ["v:0", "w:0"]
