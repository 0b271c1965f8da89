"""Tapes beside, inside, after and again: every tape names versions the same way.

The rule (README, "Semantics"): for any tape, plain or ours, a variable source
is the variable's version when that tape was entered and a variable target its
latest version while that tape was open, whichever tapes are open when the
gradient is asked. A write made while a tape is closed is, for that tape, a new
version with no gradient path, as under ``stop_recording()``.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import tensorflow as tf
from oracle import modes, run

from assigntape import AssignAwareTape

TAPES = [tf.GradientTape, AssignAwareTape]
TAPE_IDS = ["plain", "aware"]


@modes
@pytest.mark.parametrize("inner_cls", TAPES, ids=TAPE_IDS)
def test_inner_tape_without_writes_after_the_outer_writes(mode, inner_cls):
    v = tf.Variable(1.5)

    def body():
        with AssignAwareTape():
            with inner_cls(persistent=True) as inner:
                y = v * 4.0 + v * v
            v.assign(v * 7.0)  # the outer tape writes v after the inner one closed
            while_open = inner.gradient(y, v)
        return while_open, inner.gradient(y, v)

    while_open, after = run(mode, body)
    assert float(while_open) == float(after) == 4.0 + 2 * 1.5


@pytest.mark.parametrize("first_cls", TAPES, ids=TAPE_IDS)
def test_closed_tape_asked_while_another_tape_writes(first_cls):
    v = tf.Variable(0.5)
    with first_cls(persistent=True) as first:
        y = tf.sin(v)
    with AssignAwareTape():
        v.assign(v * 3.0)
        during = first.gradient(y, v)
    np.testing.assert_allclose([float(during), float(first.gradient(y, v))], [np.cos(0.5)] * 2, rtol=1e-6)


def _program(v, x):
    y1 = v * 5.0
    v.assign_add(x * x)
    return y1 + v * v  # 5 v0 + (v0 + x^2)^2


@modes
def test_plain_tape_inside_gives_one_answer_open_or_closed(mode):
    v, x = tf.Variable(1.0), tf.Variable(3.0)

    def body():
        with AssignAwareTape():
            with tf.GradientTape(persistent=True) as plain:
                loss = _program(v, x)
            while_open = plain.gradient(loss, [v, x])
        return while_open, plain.gradient(loss, [v, x])

    while_open, after = run(mode, body)
    expected = [5.0 + 2 * 10.0, 2 * 10.0 * 2 * 3.0]  # v1 = 1 + 9 = 10
    np.testing.assert_allclose([float(g) for g in while_open], expected)
    np.testing.assert_allclose([float(g) for g in after], expected)


@modes
def test_plain_tape_entered_after_a_write_starts_from_that_version(mode):
    v, a = tf.Variable(2.0), tf.Variable(0.5)

    def body():
        with AssignAwareTape():
            v.assign(a * 6.0)  # v1 = 3
            with tf.GradientTape(persistent=True) as plain:
                v.assign(v * v)  # v2 = v1^2
                y = v * 1.0
            while_open = plain.gradient(y, [v, a])
        return while_open, plain.gradient(y, [v, a])

    while_open, after = run(mode, body)
    for grads in (while_open, after):
        # d y / d v1 = 2 v1 = 6; a was never read on the plain tape.
        assert float(grads[0]) == 6.0 and grads[1] is None


def test_variable_target_of_a_plain_tape_is_its_latest_version_after_exit():
    v, a = tf.Variable(1.0), tf.Variable(1.5)
    with AssignAwareTape():
        with tf.GradientTape(persistent=True) as plain:
            plain.watch(a)
            v.assign(a * a)
        while_open = plain.gradient(v, a)
    assert float(while_open) == float(plain.gradient(v, a)) == 3.0


def test_reentered_tape_cuts_a_write_made_while_it_was_closed():
    x, v = tf.Variable(2.0), tf.Variable(3.0)
    tape = AssignAwareTape(persistent=True)
    with tape:
        v.assign(x * 5.0)
    v.assign(-1.0)  # the tape is closed: a write it did not record
    with tape:
        y = v * 4.0
    assert float(y) == -4.0
    assert tape.gradient(y, x) is None
    assert len(tape.versions(v)) == 3 and tape.history().variables[v.name][-1].cut


def test_reentered_tape_keeps_the_chain_when_nothing_was_written_meanwhile():
    x, v = tf.Variable(2.0), tf.Variable(3.0)
    tape = AssignAwareTape(persistent=True)
    with tape:
        v.assign(x * 5.0)
    z = v * 100.0  # reads in between are fine
    with tape:
        y = v * v
    assert float(z) == 1000.0 and float(tape.gradient(y, x)) == 2 * 10.0 * 5.0


def test_reentered_tape_sees_a_function_write_made_while_it_was_closed():
    x, v = tf.Variable(2.0), tf.Variable(3.0)

    @tf.function
    def overwrite():
        v.assign(x * 0.0 + 8.0)

    tape = AssignAwareTape(persistent=True)
    with tape:
        v.assign(x * 5.0)
    overwrite()
    with tape:
        y = v * 1.0
    assert float(y) == 8.0 and tape.gradient(y, x) is None


def test_a_closed_tape_stops_watching_once_it_is_gone():
    from assigntape import _leases, _resuming

    v = tf.Variable(1.0)
    tape = AssignAwareTape()
    with tape:
        v.assign(2.0)
    assert _leases.count() and tape._record in _resuming.closed_tapes  # it may be entered again
    del tape
    gc.collect()
    assert not _leases.count() and not _resuming.closed_tapes


def test_non_persistent_tape_lets_the_patches_go_at_its_gradient():
    from assigntape import _leases

    gc.collect()
    v, a = tf.Variable(1.0), tf.Variable(2.0)
    with AssignAwareTape() as tape:
        v.assign(a * 2.0)
    assert _leases.count() == 1
    assert float(tape.gradient(v, a)) == 2.0  # v's latest version
    assert not _leases.count()


def test_reset_does_not_let_new_handles_pose_as_old_versions():
    v, x = tf.Variable(1.0), tf.Variable(2.0)
    with AssignAwareTape() as tape:
        for _ in range(40):
            v.assign_add(x)
        tape.reset()
        gc.collect()
        v.assign_add(x * 4.0)
        # New variables' handles may reuse the Python ids of freed versions.
        _ = [tf.Variable(0.0) for _ in range(40)]
        y = v * 3.0
    assert len(tape.versions(v)) == 2
    assert [float(g) for g in tape.gradient(y, [x, v])] == [12.0, 3.0]


@modes
@pytest.mark.parametrize("use_pfor", [True, False], ids=["pfor", "loop"])
def test_jacobian_of_a_variable_target_after_exit(mode, use_pfor):
    x, v = tf.Variable([1.0, -2.0, 0.5]), tf.Variable(tf.zeros([3]))

    def body():
        with AssignAwareTape(persistent=True) as tape:
            v.assign(x * x * x)
        return tape.jacobian(v, x, experimental_use_pfor=use_pfor)

    np.testing.assert_allclose(run(mode, body), np.diag(3 * np.array([1.0, -2.0, 0.5]) ** 2))


@modes
@pytest.mark.parametrize("use_pfor", [True, False], ids=["pfor", "loop"])
def test_jacobian_of_each_version_target(mode, use_pfor):
    # A version from versions() as the jacobian's target, as it is gradient's:
    # pfor gathered the raw handle ("a variable without handle data").
    # Rewrite: v1 = 3x, v2 = v1 * x = 3x^2; v0 does not depend on x.
    x, v = tf.Variable([2.0, 1.0]), tf.Variable([1.0, 1.0])

    def body():
        with AssignAwareTape(persistent=True) as tape:
            v.assign(3.0 * x)
            v.assign(v * x)
        v0, v1, v2 = tape.versions(v)
        zero = tape.jacobian(v0, x, unconnected_gradients="zero", experimental_use_pfor=use_pfor)
        return [zero] + [tape.jacobian(h, x, experimental_use_pfor=use_pfor) for h in (v1, v2)]

    zero, one, two = run(mode, body)
    np.testing.assert_allclose(zero, np.zeros([2, 2]))
    np.testing.assert_allclose(one, np.diag([3.0, 3.0]))
    np.testing.assert_allclose(two, np.diag(6.0 * np.array([2.0, 1.0])))


@modes
def test_batch_jacobian_of_a_variable_target_after_exit(mode):
    x, v = tf.Variable([[1.0, 2.0], [-1.0, 0.5]]), tf.Variable(tf.zeros([2, 2]))

    def body():
        with AssignAwareTape(persistent=True) as tape:
            v.assign(tf.sin(x))
        return tape.batch_jacobian(v, x)

    expected = np.stack([np.diag(np.cos(row)) for row in np.array([[1.0, 2.0], [-1.0, 0.5]])])
    np.testing.assert_allclose(run(mode, body), expected, rtol=1e-6)


def test_zero_gradient_of_a_variable_of_unknown_shape_has_its_start_shape():
    x = tf.Variable(1.5)
    v = tf.Variable([1.0, 2.0], shape=tf.TensorShape(None))
    with AssignAwareTape() as tape:
        v.assign([4.0, 5.0, 6.0, 7.0])
        y = tf.reduce_sum(v) * x
    dx, dv = tape.gradient(y, [x, v], unconnected_gradients="zero")
    assert float(dx) == 22.0
    np.testing.assert_array_equal(dv, [0.0, 0.0])  # v's start value had two elements


@pytest.mark.parametrize("tape_cls", TAPES, ids=TAPE_IDS)
def test_watched_variables_lists_each_variable_once(tape_cls):
    import keras

    v, w = tf.Variable(2.0, name="v"), tf.Variable(0.5, name="w")
    with tape_cls() as tape:
        y1 = v * w
        v.assign_add(w)
        loss = y1 + v * 4.0
    watched = tape.watched_variables()
    assert [var.name for var in watched] == ["v:0", "w:0"]
    grads = tape.gradient(loss, watched)
    keras.optimizers.SGD(0.1).apply_gradients(zip(grads, watched))
    # One SGD step on v, from 2.5, by its gradient (0.5 + 4 with the tape, 4.5 plain too).
    np.testing.assert_allclose(float(v), 2.5 - 0.1 * 4.5, rtol=1e-6)


def test_a_function_whose_variable_is_gone_behaves_as_under_a_plain_tape():
    holder = {"v": tf.Variable(3.0)}

    @tf.function
    def f(x):
        return holder["v"] * x

    f(tf.constant(1.0))
    holder["v"] = tf.Variable(5.0)
    gc.collect()
    outcomes = []
    for tape_cls in TAPES:
        try:
            with tape_cls():
                outcomes.append(float(f(tf.constant(2.0))))
        except AssertionError as e:  # TensorFlow's own error, under any tape
            outcomes.append(type(e).__name__ + str(e)[:40])
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("traced_before", [False, True])
@pytest.mark.parametrize("read", ["operator", "function", "nested_function", "raw_op"])
def test_write_while_closed_first_read_through_a_function(read, traced_before):
    """The first read, after re-entering, of a variable written while the
    tape was closed may be a tf.function's (it reads its capture, not
    v.handle) or a raw op's: the same cut version as a direct read."""
    x, v = tf.Variable(2.0), tf.Variable(3.0)
    inner = tf.function(lambda: tf.convert_to_tensor(v) * 1.0)
    reads = {
        "operator": lambda: v * 1.0,
        "function": inner,
        "nested_function": tf.function(lambda: inner() + 0.0),
        "raw_op": lambda: tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32),
    }
    if traced_before:
        reads[read]()
    tape = AssignAwareTape(persistent=True)
    with tape:
        a = x * 1.0
    v.assign(v * 2.0)  # written while the tape is closed, never touched by it
    with tape:
        y = reads[read]() * a
    assert tape.gradient(y, v) is None  # overwritten while closed: no path to its start
    assert float(tape.gradient(y, x)) == 6.0


@pytest.mark.parametrize("later_reads_first", [False, True])
def test_write_while_closed_to_a_variable_the_tape_never_touched(later_reads_first):
    x, v = tf.Variable(2.0), tf.Variable(3.0)
    tape = AssignAwareTape(persistent=True)
    with tape:
        a = x * 1.0
    v.assign(7.0)  # v: never read or written by the tape; written while it is closed
    with tape:
        with AssignAwareTape() as later:  # opened after the write: v's value is its start
            if later_reads_first:
                z = v * 5.0
                y = v * a
            else:
                y = v * a
                z = v * 5.0
    assert tape.gradient(y, v) is None  # v's start value was overwritten while closed
    assert float(tape.gradient(y, x)) == 7.0
    assert float(later.gradient(z, v)) == 5.0


@modes
def test_plain_tape_beside_ours_fills_zeros_for_unconnected_variables(mode):
    v, a, u = tf.Variable([1.0, 2.0]), tf.Variable(3.0), tf.Variable([5.0, 6.0])

    def body():
        with AssignAwareTape():
            v.assign(v * a)
            with tf.GradientTape() as plain:
                y = tf.reduce_sum(v * 2.0)
            return plain.gradient(y, [v, a, u], unconnected_gradients="zero")

    dv, da, du = run(mode, body)
    np.testing.assert_array_equal(dv, [2.0, 2.0])
    assert float(da) == 0.0  # a was used before the plain tape started
    np.testing.assert_array_equal(du, [0.0, 0.0])


def test_reentered_tape_after_reset_keeps_the_versions_it_started_from():
    v, a = tf.Variable(1.0), tf.Variable(3.0)
    tape = AssignAwareTape(persistent=True)
    with tape:
        v.assign(a * 2.0)
        tape.reset()  # from here, v's version is the one a*2 made
        _ = v * 1.0
    with tape:  # nothing was written in between
        y = v * v
    assert float(tape.gradient(y, v)) == 12.0  # 2 * 6
    assert tape.gradient(y, a) is None  # the write to v is before the reset


@pytest.mark.parametrize("inner_cls", [AssignAwareTape, tf.GradientTape], ids=["aware", "plain"])
def test_a_gradient_asked_under_stop_recording_leaves_a_closed_write_to_the_first_read(inner_cls):
    # A gradient asked (TensorFlow's pattern: under stop_recording) before the
    # first read of a variable written while an outer tape was closed must not
    # make that first read itself: it did, unrecorded, and the inner tape lost
    # the variable's gradient (adversarial finding).
    v, x = tf.Variable(1.0), tf.constant(3.0)
    outer = AssignAwareTape(persistent=True)
    with outer:
        pass
    v.assign(2.0)  # written while the outer tape is closed
    with outer:
        with inner_cls(persistent=True) as inner:
            inner.watch(x)
            y0 = x * 2.0
            with inner.stop_recording():
                inner.gradient(y0, [x, v])
            y = v * x
    assert float(inner.gradient(y, v)) == 3.0 and float(inner.gradient(y, x)) == 2.0


def test_a_gradient_asked_in_an_open_tape_does_not_mark_its_sources_read():
    # Asking a closed tape's gradient while another tape is open read the
    # sources through that tape: a write from another thread to a variable no
    # open tape read was then refused (adversarial finding).
    import threading

    v, u, x = tf.Variable(1.0), tf.Variable(2.0), tf.constant(3.0)
    with AssignAwareTape(persistent=True) as first:
        first.watch(x)
        y = x * u
    outcome = []

    def write() -> None:
        try:
            v.assign(5.0)
            outcome.append("wrote")
        except Exception as e:  # noqa: BLE001 - the test looks at what was raised
            outcome.append(type(e).__name__)

    with AssignAwareTape():
        _ = u * 2.0
        first.gradient(y, [x, v])
        thread = threading.Thread(target=write)
        thread.start()
        thread.join()
    assert outcome == ["wrote"] and float(v) == 5.0


@pytest.mark.parametrize("sources", ["list", "dict"])
def test_a_mixin_after_the_tape_in_the_mro_has_its_gradient_called(sources):
    """``gradient`` calls what ``super()`` would (a cooperative subclass of
    ``tf.GradientTape`` after ours in the MRO), on the direct path (a list of
    variables) and the mapped one (a dict) alike (helper-31)."""
    calls = []

    class Logging(tf.GradientTape):
        def gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
            calls.append(type(sources).__name__)
            return super().gradient(target, sources, output_gradients, unconnected_gradients)

    class Mine(AssignAwareTape, Logging):
        pass

    v = tf.Variable(2.0)
    with Mine() as tape:
        y = v * v
    got = tape.gradient(y, [v] if sources == "list" else {"v": v})
    assert float(got[0] if sources == "list" else got["v"]) == 4.0
    assert calls == ["list"]  # TensorFlow is given a list either way
