"""Writes the tape cannot differentiate are refused, or cut by option; never
silently wrong. Writes it can (checkpoint restore, raw ops) are versions.

The fused optimizer kernels are differentiated (``tests/test_fused_optimizers.py``);
one left without a rule, as a kernel a future TensorFlow adds would be, is
refused: the tests below take the rule of a few away (``without_rules``).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from helpers.rules import rules_removed
from oracle import modes, run

from assigntape import AssignAwareTape, UntrackedWriteError, _patches, uninstall


def _fused_sgd(v, g):
    tf.raw_ops.ResourceApplyGradientDescent(var=v.handle, alpha=tf.constant(0.1), delta=g)


def _fused_adam(v, g):
    m, s = tf.Variable(tf.zeros_like(v)), tf.Variable(tf.zeros_like(v))
    one = tf.constant(1.0)
    tf.raw_ops.ResourceApplyAdam(
        var=v.handle,
        m=m.handle,
        v=s.handle,
        beta1_power=one * 0.9,
        beta2_power=one * 0.999,
        lr=one * 0.01,
        beta1=one * 0.9,
        beta2=one * 0.999,
        epsilon=one * 1e-7,
        grad=g,
    )


def _fused_momentum_snake(v, g):
    from tensorflow.python.ops import gen_training_ops

    accum = tf.Variable(tf.zeros_like(v))
    gen_training_ops.resource_apply_keras_momentum(
        var=v.handle, accum=accum.handle, lr=tf.constant(0.1), grad=g, momentum=tf.constant(0.9)
    )


def _compat_v1_optimizer(v, g):
    tf.compat.v1.train.GradientDescentOptimizer(0.1).apply_gradients([(g, v)])


def _sparse_fused(v, g):
    accum = tf.Variable(tf.ones_like(v))
    tf.raw_ops.ResourceSparseApplyAdagrad(
        var=v.handle, accum=accum.handle, lr=tf.constant(0.1), grad=g[:1], indices=tf.constant([1])
    )


UNTRACKED = {
    "ResourceApplyGradientDescent": _fused_sgd,
    "ResourceApplyAdam": _fused_adam,
    "ResourceApplyKerasMomentum": _fused_momentum_snake,
    "compat.v1 GradientDescentOptimizer": _compat_v1_optimizer,
    "ResourceSparseApplyAdagrad": _sparse_fused,
}
RULELESS = (
    "ResourceApplyGradientDescent",
    "ResourceApplyAdam",
    "ResourceApplyKerasMomentum",
    "ResourceSparseApplyAdagrad",
)


@pytest.fixture
def without_rules():
    """These fused kernels as if they had no rule: refused, as any write op
    without one (``_rules.refused``)."""
    with rules_removed(*RULELESS):
        yield


@pytest.mark.usefixtures("without_rules")
@pytest.mark.parametrize("name", sorted(UNTRACKED))
def test_fused_kernel_without_a_rule_is_refused_and_changes_nothing(name):
    v = tf.Variable([1.0, 2.0], name="fused_target")
    with AssignAwareTape() as tape:
        loss = tf.reduce_sum(v * v)
        g = tf.constant([0.5, 0.5])
        versions = tape.versions(v)
        with pytest.raises(UntrackedWriteError) as info:
            UNTRACKED[name](v, g)
        assert tape.versions(v) == versions
    message = str(info.value)
    assert "fused_target" in message
    assert "ResourceApply" in message or "ResourceSparseApply" in message
    assert "untracked_writes='cut'" in message and "Keras 3 optimizer" in message
    assert isinstance(info.value, RuntimeError)
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(tape.gradient(loss, v), [2.0, 4.0])


@pytest.mark.parametrize("rule", ["with_rule", "without_rule"])
def test_fused_kernel_on_an_untracked_variable_is_plain_tensorflow(rule, request):
    if rule == "without_rule":
        request.getfixturevalue("without_rules")
    inside = tf.Variable([1.0, 2.0])
    outside = tf.Variable([1.0, 2.0])
    with AssignAwareTape() as tape:
        loss = tf.reduce_sum(inside)
        # `outside` is never touched in the tape: nothing to protect.
        tf.raw_ops.ResourceApplyGradientDescent(
            var=outside.__dict__["_handle"], alpha=tf.constant(1.0), delta=tf.constant([1.0, 1.0])
        )
    np.testing.assert_array_equal(outside.numpy(), [0.0, 1.0])
    assert tape.gradient(loss, inside) is not None


@pytest.mark.usefixtures("without_rules")
def test_cut_option_makes_a_version_with_no_gradient_path():
    v, a = tf.Variable([1.0, 2.0], name="cut_me"), tf.Variable(3.0)
    with AssignAwareTape(untracked_writes="cut") as tape:
        v.assign(v * a)  # tracked
        with pytest.warns(UserWarning, match="cut_me"):
            _fused_sgd(v, tf.constant([10.0, 10.0]))  # v2 = v1 - 1, untracked
        loss = tf.reduce_sum(v * a)
    np.testing.assert_allclose(v.numpy(), [2.0, 5.0])
    assert len(tape.versions(v)) == 3
    dv, da = tape.gradient(loss, [v, a])
    assert dv is None  # the path through v1 is cut
    assert float(da) == 7.0  # only the read after the cut write


@pytest.mark.usefixtures("without_rules")
def test_cut_is_chosen_per_tape_and_raise_wins_when_nested():
    v = tf.Variable([1.0, 2.0])
    with AssignAwareTape():
        with AssignAwareTape(untracked_writes="cut"):
            _ = v * 1.0
            with pytest.raises(UntrackedWriteError):
                _fused_sgd(v, tf.constant([1.0, 1.0]))


def test_bad_option_value():
    with pytest.raises(ValueError, match="untracked_writes"):
        AssignAwareTape(untracked_writes="ignore")


def test_checkpoint_restore_is_a_version_with_no_gradient(tmp_path):
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(3.0)
    ckpt = tf.train.Checkpoint(v=v)
    path = ckpt.write(str(tmp_path / "ckpt"))
    with AssignAwareTape(persistent=True) as tape:
        v.assign(v * a)  # 3, 6
        early = tf.reduce_sum(v)
        ckpt.read(path).assert_consumed()  # back to 1, 2: a value from disk
        late = tf.reduce_sum(v * a)
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    assert len(tape.versions(v)) == 3
    assert float(tape.gradient(early, a)) == 3.0
    assert float(tape.gradient(late, a)) == 3.0  # d/da of (1 + 2) a: no path into the restored value
    assert tape.gradient(late, v) is None


def _write_through(kind, handle, x):
    if kind == "assign":
        tf.raw_ops.AssignVariableOp(resource=handle, value=x * 3.0)
        tf.raw_ops.AssignAddVariableOp(resource=handle, value=x * x)
    else:  # a fused kernel: c - 0.5 * (-2x) = c + x
        tf.raw_ops.ResourceApplyGradientDescent(var=handle, alpha=tf.constant(0.5), delta=-2.0 * x)


@modes
@pytest.mark.parametrize("kind", ["assign", "fused"])
def test_a_write_through_a_handle_fetched_before_the_tape_is_a_version(mode, kind):
    with AssignAwareTape():
        pass  # installed: the variables created from now on are known by their handles
    x, c = tf.Variable(2.0), tf.Variable(1.5)
    handle = c.handle  # fetched before the tape

    def program():
        with AssignAwareTape() as tape:
            _write_through(kind, handle, x)
            y = c * 1.0
        return y, tape.gradient(y, [x, c])

    y, (gx, gc) = run(mode, program)
    if kind == "assign":  # y = 3x + x^2; c overwritten
        assert float(y) == 10.0 and float(gx) == 3.0 + 2 * 2.0 and gc is None
    else:  # y = c + x
        assert float(y) == 3.5 and float(gx) == 1.0 and float(gc) == 1.0


@modes
@pytest.mark.parametrize("kind", ["assign", "fused"])
@pytest.mark.parametrize("read", ["handle", "function"])
def test_reading_a_variable_written_through_a_handle_no_tape_can_name_is_refused(mode, kind, read):
    uninstall()  # as in a process that never entered a tape: c is created unknown
    x, c = tf.Variable(2.0), tf.Variable(1.5, name="made_before")
    handle = c.handle
    read_in_function = tf.function(lambda: c * 1.0)
    read_in_function()  # traced before: it captured c's own handle

    def program():
        with AssignAwareTape() as tape:
            _write_through(kind, handle, x)  # plain TensorFlow so far
            y = c * 1.0 if read == "handle" else read_in_function()
        return tape.gradient(y, x)

    with pytest.raises(UntrackedWriteError, match="made_before.*could name"):
        run(mode, program)


def test_a_refusal_deferred_by_a_touch_without_a_read_waits_for_the_read_not_an_unrelated_failure():
    # tape.watch(c) touches c in TensorFlow's C++, which must not raise: the
    # refusal is deferred. The user's own failing op next (an index out of
    # range, which their handler expects) raises its own error; the refusal
    # comes at the tape's exit (it replaced the user's error before).
    uninstall()  # as in a process that never entered a tape: c is created unknown
    x, c = tf.Variable(2.0), tf.Variable(1.5, name="made_before")
    handle = c.handle
    table = tf.constant([1.0, 2.0])
    caught = []
    with pytest.raises(UntrackedWriteError, match="made_before.*could name"):
        with AssignAwareTape() as tape:
            _write_through("assign", handle, x)
            tape.watch(c)
            try:
                tf.gather(table, 5)
            except tf.errors.InvalidArgumentError as error:
                caught.append(error)
    assert len(caught) == 1


@modes
def test_a_variable_made_after_import_before_any_tape_is_known_by_its_handle(mode):
    uninstall()
    _patches.follow_plain_tapes()  # what importing assigntape installs
    assert not _patches.installed()
    x, c = tf.Variable(2.0), tf.Variable(1.5)
    handle = c.handle

    def program():
        with AssignAwareTape() as tape:
            tf.raw_ops.AssignVariableOp(resource=handle, value=x * 3.0)
            y = c * c
        return tape.gradient(y, [x, c])

    gx, gc = run(mode, program)  # y = (3x)^2: dy/dx = 18 x; c overwritten
    assert float(gx) == 36.0 and gc is None


def test_a_raw_write_through_an_early_handle_after_reads_through_a_kept_assign_result():
    """The variable was read in the tape (through a kept ``assign`` result,
    then itself): a write through its handle fetched before anything was
    installed is a version (adversarial finding: it was refused)."""
    uninstall()  # as in a process that imported assigntape after making v
    v = tf.Variable(2.0)
    handle = v.handle
    a = tf.constant(1.5)
    with AssignAwareTape():
        kept = v.assign_add(1.0)  # v = 3
    with AssignAwareTape() as tape:
        tape.watch(a)
        _ = kept * 1.0
        _ = v * 1.0
        tf.raw_ops.AssignVariableOp(resource=handle, value=a * 2.0)
        y = v * v
    # The rewrite: y = (2a)^2, dy/da = 8a.
    assert float(y) == 9.0 and float(tape.gradient(y, a)) == 12.0


def test_a_variable_written_through_a_handle_no_tape_can_name_and_never_read_is_plain_tensorflow():
    uninstall()
    x, c = tf.Variable(2.0), tf.Variable(1.5)
    handle = c.handle
    with AssignAwareTape() as tape:
        tf.raw_ops.AssignVariableOp(resource=handle, value=x * 3.0)
        y = x * x
    assert float(c) == 6.0 and float(tape.gradient(y, x)) == 4.0


_RAW_READS = {
    "ReadVariableOp": lambda h: tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32),
    "ResourceGather": lambda h: tf.raw_ops.ResourceGather(resource=h, indices=[1, 0], dtype=tf.float32),
    "ResourceGatherNd": lambda h: tf.raw_ops.ResourceGatherNd(resource=h, indices=[[1], [0]], dtype=tf.float32),
}


@modes
@pytest.mark.parametrize("read", sorted(_RAW_READS))
@pytest.mark.parametrize("fetched", ["before_the_tape", "before_the_write", "from_an_earlier_tape"])
def test_a_raw_read_through_a_kept_handle_reads_the_current_version(mode, read, fetched):
    with AssignAwareTape():
        pass  # installed: the variables created from now on are known by their handles
    x, c = tf.Variable(2.0), tf.Variable([1.5, -0.5])
    early = c.handle
    with AssignAwareTape() as earlier:
        c.assign(c * 1.0)
    kept = earlier.versions(c)[1]  # a version of a tape now closed

    def program():
        with AssignAwareTape() as tape:
            handle = {"before_the_tape": early, "from_an_earlier_tape": kept}.get(fetched)
            handle = c.handle if handle is None else handle
            c.assign(c * x)  # [3, -1]
            y = tf.reduce_sum(_RAW_READS[read](handle) ** 2)
        return y, tape.gradient(y, [x, c])

    # The rewrite: y = sum((c x)^2), so dy/dx = 2 x sum(c^2), dy/dc = 2 c x^2.
    y, (gx, gc) = run(mode, program)
    assert float(y) == 10.0
    assert float(gx) == 2 * 2.0 * (1.5**2 + 0.5**2)
    np.testing.assert_allclose(gc, [2 * 1.5 * 4.0, 2 * -0.5 * 4.0])


@modes
def test_a_raw_read_of_a_variable_written_through_a_handle_no_tape_can_name_is_refused(mode):
    uninstall()  # c is created unknown
    x, c = tf.Variable(2.0), tf.Variable(1.5)
    handle = c.handle

    def program():
        with AssignAwareTape() as tape:
            tf.raw_ops.AssignVariableOp(resource=handle, value=x * 3.0)
            y = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)
        return tape.gradient(y, x)

    with pytest.raises(UntrackedWriteError, match="A variable was written by AssignVariableOp.*could name"):
        run(mode, program)


@modes
def test_a_write_through_a_kept_handle_after_an_assign_outside_every_tape_is_a_version(mode):
    with AssignAwareTape():
        pass
    x, c = tf.Variable(2.0), tf.Variable(1.5)
    handle = c.handle
    c.assign(5.0)  # outside every tape: its result shares c's handle
    c.assign_add(1.0)

    def program():
        with AssignAwareTape() as tape:
            tf.raw_ops.AssignVariableOp(resource=handle, value=x * 3.0)
            y = c * c
        return tape.gradient(y, [x, c])

    gx, gc = run(mode, program)
    assert float(gx) == 2 * 6.0 * 3.0 and gc is None


def test_a_gradient_asked_with_an_unnamed_written_source_the_tape_never_read():
    # gradient() must not read the source through its descriptor: that read
    # refused the variable (written through a handle no tape could name) though
    # the tape never read it, where it is plain TensorFlow (adversarial finding).
    uninstall()
    w, c = tf.Variable(2.0), tf.Variable(1.0, name="made_before")
    handle = c.handle
    with AssignAwareTape(persistent=True) as tape:
        tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(5.0))
        y = w * 3.0
        inside = tape.gradient(y, [w, c])
    assert float(inside[0]) == 3.0 and inside[1] is None
