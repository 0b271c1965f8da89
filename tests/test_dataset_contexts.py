"""``tf.data`` functions that write, run where the tape does not see them:
datasets and iterators passed as arguments to a ``tf.function``, ``Dataset.save``,
distributed datasets.

The program reads ``v`` (so the tape tracks it), then something runs a
dataset whose ``map`` writes ``v.assign(v * x * e)``, then it reads
``y = sum(v * v) * x``. Either the write is refused (``UntrackedWriteError``
eagerly, ``ControlFlowWriteError`` while tracing the tape's function), with
the variable left as it was, or, with ``untracked_writes="cut"``, it is a new
version with no gradient path: the rewrite ``w = stop_gradient(v * x * E)``.
Never the gradient of the version before the write.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest
import tensorflow as tf
from helpers import helper_output

from assigntape import AssignAwareTape, ControlFlowWriteError, UntrackedWriteError

V0 = np.array([1.5, -0.5, 2.0])
X0 = 0.7
E = 1.25

# No element made ahead, in the background (a documented limit).
_NOT_AHEAD = tf.data.Options()
_NOT_AHEAD.autotune.enabled = False
_NOT_AHEAD.experimental_optimization.inject_prefetch = False


def _program() -> Tuple[tf.Variable, tf.Variable, tf.data.Dataset]:
    v = tf.Variable(V0, dtype=tf.float64, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64, name="x_read")
    ds = tf.data.Dataset.from_tensors(tf.constant(E, tf.float64)).map(lambda e: (v.assign(v * x * e), e)[1])
    return v, x, ds.with_options(_NOT_AHEAD)


def _cut_oracle() -> Tuple[float, List[np.ndarray]]:
    """y, dy/dx, dy/dv of the rewrite with the write cut: w = v * x * E is a
    new version with no gradient path, so y = sum(w * w) * x depends on x
    only through the last factor."""
    x = tf.constant(X0, tf.float64)
    v = tf.constant(V0, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch([x, v])
        w = tf.stop_gradient(v * x * E)
        y = tf.reduce_sum(w * w) * x
    gx, gv = tape.gradient(y, [x, v], unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return float(y), [np.asarray(gx), np.asarray(gv)]


def _plain(value: Any) -> np.ndarray:
    return np.zeros_like(V0) if value is None else np.asarray(value)


# How a tf.function is given the dataset, and what it runs it with.
def _iterator_argument(ds: tf.data.Dataset) -> Tuple[Callable[[Any], Any], Any]:
    return tf.function(lambda it: next(it)), iter(ds)


def _dataset_argument(ds: tf.data.Dataset) -> Tuple[Callable[[Any], Any], Any]:
    return tf.function(lambda d: next(iter(d))), ds


def _reduce_in_dict(ds: tf.data.Dataset) -> Tuple[Callable[[Any], Any], Any]:
    return tf.function(lambda d: d["data"].reduce(tf.constant(0.0, tf.float64), lambda s, e: s + e)), {"data": ds}


def _for_loop(ds: tf.data.Dataset) -> Tuple[Callable[[Any], Any], Any]:
    def pull(items: List[Any]) -> Any:
        total = tf.constant(0.0, tf.float64)
        for e in items[1]:  # autograph: a reduce over the dataset
            total += e
        return total

    return tf.function(pull), [tf.constant(1.0), ds]


def _concrete_function(ds: tf.data.Dataset) -> Tuple[Callable[[Any], Any], Any]:
    return tf.function(lambda d: next(iter(d))).get_concrete_function(ds), ds


ARGUMENTS: Dict[str, Callable[[tf.data.Dataset], Tuple[Callable[[Any], Any], Any]]] = {
    "iterator": _iterator_argument,
    "concrete_function": _concrete_function,
    "dataset": _dataset_argument,
    "reduce_in_dict": _reduce_in_dict,
    "for_loop": _for_loop,
}


@pytest.mark.parametrize("how", sorted(ARGUMENTS))
def test_a_dataset_argument_of_a_function_called_from_the_tape_is_refused(how: str) -> None:
    v, x, ds = _program()
    function, argument = ARGUMENTS[how](ds)
    with AssignAwareTape() as tape:
        before = tf.reduce_sum(v)
        with pytest.raises(UntrackedWriteError, match=r"(?s)(?=.*v_written)(?=.*tf\.function .\w*(<lambda>|pull))"):
            function(argument)
    np.testing.assert_array_equal(v.numpy(), V0)  # refused before the map ran
    del tape, before


def _saved(ds: tf.data.Dataset) -> Tuple[Callable[[Any], Any], Any]:
    return lambda path: ds.save(path), os.path.join(tempfile.mkdtemp(), "saved")


@pytest.mark.parametrize("how", sorted(ARGUMENTS) + ["save"])
def test_a_dataset_run_unseen_is_cut_by_option(how: str) -> None:
    """A dataset given to a tf.function as an argument, or saved: with
    ``untracked_writes="cut"`` the write is a new version, no gradient path."""
    v, x, ds = _program()
    function, argument = (_saved if how == "save" else ARGUMENTS[how])(ds)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with AssignAwareTape(untracked_writes="cut") as tape:
            before = tf.reduce_sum(v)
            function(argument)
            y = tf.reduce_sum(v * v) * x + 0.0 * before
    assert any("v_written" in str(w.message) for w in caught)
    gx, gv = tape.gradient(y, [x, v])
    y_ref, (gx_ref, gv_ref) = _cut_oracle()
    np.testing.assert_allclose(float(y), y_ref)
    np.testing.assert_allclose(float(gx), gx_ref)
    np.testing.assert_allclose(_plain(gv), gv_ref)


def test_a_function_traced_before_the_tape_is_refused_for_the_dataset_it_is_given_now() -> None:
    """The concrete function is reused for any dataset of the same element
    spec: what it is given is checked at each call, not at its trace."""
    v, x, ds = _program()
    quiet = tf.data.Dataset.from_tensors(tf.constant(E, tf.float64))
    pull = tf.function(lambda d: next(iter(d)))
    pull(quiet)  # traced outside every tape, with a dataset that writes nothing
    with AssignAwareTape() as tape:
        before = tf.reduce_sum(v)
        pull(quiet)  # still nothing to refuse
        with pytest.raises(UntrackedWriteError, match="v_written"):
            pull(ds)
    np.testing.assert_array_equal(v.numpy(), V0)
    del tape, before, x


@pytest.mark.parametrize("how", ["iterator", "dataset", "reduce_in_dict"])
def test_a_dataset_argument_of_the_tapes_function_is_refused_while_tracing(how: str) -> None:
    v, x, ds = _program()
    argument = {"iterator": iter(ds), "dataset": ds, "reduce_in_dict": {"data": ds}}[how]

    @tf.function
    def step(d: Any) -> Any:
        with AssignAwareTape() as tape:
            before = tf.reduce_sum(v)
            if how == "iterator":
                element = next(d)
            elif how == "dataset":
                element = next(iter(d))
            else:
                element = d["data"].reduce(tf.constant(0.0, tf.float64), lambda s, e: s + e)
            with tf.control_dependencies([element]):
                y = tf.reduce_sum(v * v) * x + 0.0 * before
        return y, tape.gradient(y, [x, v])

    with pytest.raises(ControlFlowWriteError, match="v_written"):
        step(argument)
    np.testing.assert_array_equal(v.numpy(), V0)


# -- datasets that write nothing stay plain --------------------------------------


def _train_oracle(batches: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Two SGD steps on loss = sum((w * b - 1)^2), written on tensors, under
    a plain tape: (w after, the last loss's gradient)."""
    w = tf.constant(V0, tf.float64)
    grad = None
    for b in batches:
        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = tf.reduce_sum((w * b - 1.0) ** 2)
        grad = tape.gradient(loss, w)
        w = w - 0.1 * grad
    return w.numpy(), np.asarray(grad)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_keras_style_step_given_an_iterator_that_writes_nothing_runs(compiled: bool) -> None:
    """A train step taking an iterator (as Keras's ``fit`` does): its dataset
    writes nothing, so nothing is refused, and the step's writes are followed."""
    batches = np.array([[1.0, 2.0, 0.5], [0.5, -1.0, 2.0]])
    w = tf.Variable(V0, dtype=tf.float64, name="w")
    iterator = iter(tf.data.Dataset.from_tensor_slices(batches).map(lambda b: b * 1.0))

    def step(it: Any) -> Any:
        b = next(it)
        with AssignAwareTape() as tape:
            loss = tf.reduce_sum((w * b - 1.0) ** 2)
        grad = tape.gradient(loss, w)
        w.assign_sub(0.1 * grad)
        return grad

    run = tf.function(step) if compiled else step
    grad = None
    for _ in batches:
        grad = run(iterator)
    w_ref, grad_ref = _train_oracle(batches)
    np.testing.assert_allclose(w.numpy(), w_ref)
    np.testing.assert_allclose(np.asarray(grad), grad_ref)


def test_a_dataset_argument_that_writes_nothing_is_not_refused_from_the_tape() -> None:
    """From an eager tape: a function given a dataset that only reads ``v``
    is a function that reads it (y = sum(v) * e * x, its gradient by hand:
    dy/dv = e * x, dy/dx = sum(v) * e)."""
    v = tf.Variable(V0, dtype=tf.float64, name="v_read")
    x = tf.Variable(X0, dtype=tf.float64, name="x_read")
    ds = tf.data.Dataset.from_tensors(tf.constant(E, tf.float64)).map(lambda e: e * 1.0)
    pull = tf.function(lambda d, it: next(iter(d)) + 0.0 * next(it))
    with AssignAwareTape() as tape:
        e = pull(ds, iter(ds))
        y = tf.reduce_sum(v) * e * x
    gx, gv = tape.gradient(y, [x, v])
    np.testing.assert_allclose(float(gx), V0.sum() * E)
    np.testing.assert_allclose(np.asarray(gv), np.full(3, E * X0))


# -- Dataset.save ----------------------------------------------------------------


def test_dataset_save_of_a_writing_dataset_is_refused_eagerly() -> None:
    v, x, ds = _program()
    with AssignAwareTape() as tape:
        before = tf.reduce_sum(v)
        with pytest.raises(UntrackedWriteError, match=r"(?s)(?=.*v_written)(?=.*Dataset\.save)"):
            ds.save(tempfile.mkdtemp())
    np.testing.assert_array_equal(v.numpy(), V0)
    del tape, before, x


def test_dataset_save_in_the_tapes_function_is_refused_while_tracing() -> None:
    v, x, ds = _program()
    path = tempfile.mkdtemp()

    @tf.function
    def step() -> Any:
        with AssignAwareTape() as tape:
            before = tf.reduce_sum(v)
            saved = ds.save(path)
            with tf.control_dependencies([saved] if saved is not None else []):
                y = tf.reduce_sum(v * v) * x + 0.0 * before
        return y, tape.gradient(y, [x, v])

    with pytest.raises(ControlFlowWriteError, match=r"(?s)(?=.*v_written)(?=.*Dataset\.save)"):
        step()
    np.testing.assert_array_equal(v.numpy(), V0)


def test_dataset_save_of_a_dataset_that_writes_nothing_runs_in_a_tape() -> None:
    ds = tf.data.Dataset.from_tensor_slices(tf.constant([1.0, 2.0], tf.float64))
    path = os.path.join(tempfile.mkdtemp(), "saved")
    v = tf.Variable(V0, dtype=tf.float64)
    with AssignAwareTape() as tape:
        ds.save(path)
        y = tf.reduce_sum(v * v)
    np.testing.assert_allclose(tape.gradient(y, v).numpy(), 2 * V0)  # d sum(v^2) / dv = 2v
    np.testing.assert_allclose([e.numpy() for e in tf.data.Dataset.load(path)], [1.0, 2.0])


# -- MirroredStrategy's distributed datasets (in a fresh process) ----------------


def test_distributed_datasets_that_write_are_refused_and_quiet_ones_run() -> None:
    """tests/helpers/mirrored_datasets.py: a distributed dataset (either kind)
    whose map writes ``v`` is refused, eagerly (looped over, or given to a
    tf.function as a dataset or iterator) with ``UntrackedWriteError`` and in
    the tape's function (made there, captured, given) with
    ``ControlFlowWriteError``, ``v`` unwritten; a step given a distributed
    iterator whose dataset writes nothing gives the plain tape's gradients."""
    out = helper_output("mirrored_datasets")
    got, expected = out.pop("quiet_step")
    np.testing.assert_allclose(got, expected)
    for case, (error, unwritten) in out.items():
        want = "ControlFlowWriteError" if case.startswith("compiled/") else "UntrackedWriteError"
        assert (error, unwritten) == (want, True), case
