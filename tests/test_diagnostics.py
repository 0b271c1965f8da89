"""``tape.explain`` gives one reason per missing gradient; ``tape.history`` lists
the versions and their ops. Each reason is provoked by a program that really has
it, eager and (where the reason exists in a graph) inside ``tf.function``."""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import tensorflow as tf
from helpers.rules import rules_removed
from oracle import MODES, modes, run

from assigntape import AssignAwareTape, Reason

Program = Callable[[], Tuple[AssignAwareTape, Any, Dict[str, Any]]]


def _explain(mode: str, program: Program, **tape_kwargs: Any):
    """Runs ``program(tape)`` -> (target, sources) in ``mode``; returns the reports
    (built while tracing, in function mode) and the gradients' values."""
    found: List[Any] = []

    def body():
        with AssignAwareTape(**tape_kwargs) as tape:
            target, sources = program(tape)
        explanation = tape.explain(target, sources)
        found.append(explanation)
        return {k: (tf.constant(np.nan) if g is None else g) for k, g in explanation.gradients.items()}

    grads = run(mode, body)
    return found[-1], {k: np.asarray(v) for k, v in grads.items()}


def _by_name(explanation) -> Dict[str, Any]:
    return {r.name.split(":")[0]: r for r in explanation.reports}


@modes
def test_overwritten_before_read(mode):
    a = tf.Variable(1.0, name="a")
    b = tf.Variable(2.0, name="b")

    def program(tape):
        a.assign(5.0)  # a's start value is lost before anything reads it
        return a * b, {"a": a, "b": b}

    explanation, grads = _explain(mode, program)
    report = _by_name(explanation)
    assert report["a"].status == "none" and report["a"].reason == Reason.OVERWRITTEN
    assert "AssignVariableOp" in report["a"].message and "versions(variable)[1]" in report["a"].message
    assert report["b"].reason == Reason.OK and grads["b"] == 5.0
    assert "a:0: gradient is None [overwritten_before_read]" in str(explanation)


def test_overwritten_hint_gives_the_later_gradient():
    a = tf.Variable(1.0, name="a")
    with AssignAwareTape(persistent=True) as tape:
        a.assign_add(1.0)
        a.assign(5.0)
        loss = a * 3.0
    report = tape.explain(loss, [a]).reports[0]
    assert report.reason == Reason.OVERWRITTEN
    assert "write 2 of 2" in report.message and "versions(variable)[2]" in report.message
    assert float(tape.gradient(loss, tape.versions(a)[2])) == 3.0


@modes
def test_never_touched(mode):
    used, unused = tf.Variable(2.0, name="used"), tf.Variable(3.0, name="unused")
    explanation, _ = _explain(mode, lambda tape: (used * 2.0, {"used": used, "unused": unused}))
    report = _by_name(explanation)
    assert report["unused"].reason == Reason.NEVER_TOUCHED
    assert report["used"].reason == Reason.OK


@modes
def test_non_differentiable_dtype(mode):
    steps = tf.Variable(3, name="steps")
    w = tf.Variable(2.0, name="w")

    def program(tape):
        steps.assign_add(1)
        return w * tf.cast(steps, tf.float32), {"steps": steps, "w": w}

    report = _by_name(_explain(mode, program)[0])
    assert report["steps"].reason == Reason.NON_DIFFERENTIABLE and "int32" in report["steps"].message


@modes
def test_non_differentiable_op(mode):
    w = tf.Variable(2.7, name="w")

    def program(tape):
        rounded = tf.cast(tf.cast(w, tf.int32), tf.float32)  # the path has no gradient
        return rounded * 2.0, {"w": w}

    report = _by_name(_explain(mode, program)[0])["w"]
    assert report.reason == Reason.NON_DIFFERENTIABLE and "read on the tape" in report.message


@modes
def test_written_but_never_reaching_the_target(mode):
    c, x = tf.Variable(0.0, name="c"), tf.Variable(1.0, name="x")

    def program(tape):
        c.assign(x * 2.0)
        return x * 3.0, {"c": c}

    report = _by_name(_explain(mode, program)[0])["c"]
    assert report.reason == Reason.NON_DIFFERENTIABLE and "written 1 times" in report.message


@modes
def test_write_under_stop_recording(mode):
    w = tf.Variable(2.0, name="w")

    def program(tape):
        with tape.stop_recording():
            w.assign_add(1.0)  # would pass d/dw through, but is not recorded
        return w * 2.0, {"w": w}

    report = _by_name(_explain(mode, program)[0])["w"]
    assert report.reason == Reason.STOP_RECORDING and "AssignAddVariableOp" in report.message


@modes
def test_cut_write(mode):
    w = tf.Variable(2.0, name="w")

    def program(tape):
        # A write op without a rule (see helpers.rules): the tape cannot differentiate it.
        tf.raw_ops.ResourceApplyGradientDescent(var=w.handle, alpha=tf.constant(0.5), delta=tf.constant(1.0))
        return w * 2.0, {"w": w}

    with warnings.catch_warnings(), rules_removed("ResourceApplyGradientDescent"):
        warnings.simplefilter("ignore")
        report = _by_name(_explain(mode, program, untracked_writes="cut")[0])["w"]
    assert report.reason == Reason.CUT and "ResourceApplyGradientDescent" in report.message


@pytest.mark.parametrize("leave", ["numpy", "float"])
def test_value_left_tensorflow(leave):
    a, c = tf.Variable(1.5, name="a"), tf.Variable(0.0, name="c")
    with AssignAwareTape() as tape:
        doubled = (a * 2.0).numpy() if leave == "numpy" else float(a * 2.0)  # leaves TensorFlow
        line = _line_above()
        c.assign(doubled + 1.0)
        loss = c * 3.0
    report = _by_name(tape.explain(loss, {"a": a}))["a"]
    assert report.reason == Reason.LEFT_TENSORFLOW
    assert re.search(rf"test_diagnostics\.py:{line}\b", report.message), report.message


def test_values_that_never_left_are_not_blamed():
    # .numpy() of a value the tape does not record (a constant) is no escape.
    a, c = tf.Variable(1.5, name="a"), tf.Variable(0.0, name="c")
    with AssignAwareTape() as tape:
        c.assign(tf.constant(2.0).numpy() + 1.0)
        loss = c * 3.0 + tf.cast(tf.cast(a, tf.int32), tf.float32)
    assert _by_name(tape.explain(loss, {"a": a}))["a"].reason == Reason.NON_DIFFERENTIABLE


def _line_above() -> int:
    import inspect

    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno - 1


@modes
def test_tensor_not_watched(mode):
    w = tf.Variable(1.0, name="w")

    def program(tape):
        x = tf.constant(2.0)  # never tape.watch()ed
        return w * x, {"x": x, "w": w}

    report = _by_name(_explain(mode, program)[0])
    assert report["sources[x]"].reason == Reason.NOT_WATCHED
    assert report["w"].reason == Reason.OK


def test_zero_gradient():
    w = tf.Variable(2.0, name="w")
    with AssignAwareTape() as tape:
        w.assign(tf.nn.relu(-w))  # a dead ReLU: connected, derivative 0
        loss = w * 3.0
    explanation = tape.explain(loss, {"w": w})
    assert explanation.reports[0].status == "zero" and explanation.reports[0].reason == Reason.ZERO
    assert float(explanation.gradients["w"]) == 0.0


@modes
def test_explanation_gradients_equal_gradient(mode):
    a, b, c = tf.Variable(1.0, name="a"), tf.Variable(2.0, name="b"), tf.Variable(3.0, name="c")

    def body():
        with AssignAwareTape(persistent=True) as tape:
            c.assign(a + b)
            c.assign_add(a * b)
            loss = c**2
        explained = tape.explain(loss, [a, b, c])
        return explained.gradients[:2], tape.gradient(loss, [a, b])

    got, expected = run(mode, body)
    # c = a + b + a b = 5; dloss/da = 2 c (1 + b) = 30, dloss/db = 2 c (1 + a) = 20.
    np.testing.assert_allclose([float(g) for g in got], [30.0, 20.0])
    np.testing.assert_allclose([float(g) for g in expected], [30.0, 20.0])


def test_all_ok_report():
    w = tf.Variable(2.0, name="w")
    with AssignAwareTape() as tape:
        w.assign(w * 3.0)
        loss = w**2
    explanation = tape.explain(loss, [w])
    assert not explanation.missing and str(explanation) == "Every source has a gradient."
    assert float(explanation.gradients[0]) == 36.0  # d (3w)^2 / dw = 18 w


# -- history ---------------------------------------------------------------------


@modes
def test_history_lists_versions_and_ops(mode):
    w = tf.Variable([1.0, 2.0, 3.0], name="w")
    u = tf.Variable(0.0, name="u")
    found: List[Any] = []

    def body():
        with AssignAwareTape() as tape:
            w.assign_add([1.0, 1.0, 1.0])
            w[1].assign(0.0)
            w.scatter_add(tf.IndexedSlices(tf.constant([5.0]), tf.constant([2])))
            with tape.stop_recording():
                u.assign(1.0)
            loss = tf.reduce_sum(w) + u
        found.append(tape.history())
        return tape.gradient(loss, tape.history().variables["w:0"][1].handle)

    grad = run(mode, body)
    history = found[-1]
    records = history.variables["w:0"]
    assert [r.op for r in records] == [
        None,
        "AssignAddVariableOp",
        "ResourceStridedSliceAssign",
        "ResourceScatterAdd",
    ]
    assert [r.number for r in records] == [0, 1, 2, 3]
    assert history.variables["u:0"][1].recorded is False
    # The handle of version 1 is a real version: the slice write zeroed w[1].
    np.testing.assert_array_equal(np.asarray(grad), [1.0, 0.0, 1.0])
    text = str(history)
    assert "w:0: 4 versions" in text and "v3: ResourceScatterAdd" in text
    assert "u:0: 2 versions" in text and "v1: AssignVariableOp, under stop_recording" in text


def test_history_to_dot_is_well_formed():
    w = tf.Variable(1.0, name='odd"name')
    with warnings.catch_warnings(), rules_removed("ResourceApplyGradientDescent"):
        warnings.simplefilter("ignore")
        with AssignAwareTape(untracked_writes="cut") as tape:
            w.assign_add(1.0)
            tf.raw_ops.ResourceApplyGradientDescent(var=w.handle, alpha=tf.constant(0.5), delta=tf.constant(1.0))
        dot = tape.history().to_dot()
        del tape
    assert dot.startswith("digraph history {") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    edges = re.findall(r"v0_(\d) -> v0_(\d) \[label=\"([^\"]*)\"(, style=dashed)?\]", dot)
    assert edges == [
        ("0", "1", "AssignAddVariableOp", ""),
        ("1", "2", "ResourceApplyGradientDescent, cut: no gradient path", ", style=dashed"),
    ]
    assert r'label="odd\"name:0"' in dot  # quotes in names are escaped


def test_history_empty_and_after_reset():
    w = tf.Variable(1.0, name="w")
    with AssignAwareTape() as tape:
        w.assign(2.0)
        assert "w:0" in tape.history().variables
        tape.reset()
        assert str(tape.history()) == "No variable was written on this tape."


@pytest.mark.parametrize("mode", MODES)
def test_explain_names_nested_sources(mode):
    # Nested sources keep their structure in .gradients and their path in names.
    w = tf.Variable(1.0, name="w")
    explanation, _ = _explain(mode, lambda tape: (w * 2.0, {"x": w, "y": tf.constant(1.0)}))
    assert [r.name for r in explanation.reports] == ["w:0", "sources[y]"]
