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

    step = _sgd_step(w, compiled, pull=next)
    grad = None
    for _ in batches:
        grad = step(iterator)
    _check_trained(w, grad, batches)


def _sgd_step(w: tf.Variable, compiled: bool, pull: Callable[[Any], Any] = tf.identity) -> Callable[[Any], Any]:
    """One SGD step on loss = sum((w * b - 1)^2), its gradient from the tape,
    on the batch ``pull`` takes from the step's argument."""

    def step(argument: Any) -> Any:
        b = pull(argument)
        with AssignAwareTape() as tape:
            loss = tf.reduce_sum((w * b - 1.0) ** 2)
        grad = tape.gradient(loss, w)
        w.assign_sub(0.1 * grad)
        return grad

    return tf.function(step) if compiled else step


def _check_trained(w: tf.Variable, grad: Any, batches: np.ndarray) -> None:
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


# -- datasets known only by their variant ----------------------------------------


def _from_variant(ds: tf.data.Dataset) -> tf.data.Dataset:
    return tf.data.experimental.from_variant(tf.data.experimental.to_variant(ds), ds.element_spec)


def test_a_dataset_rebuilt_from_its_variant_is_refused_eagerly() -> None:
    """Its functions are read from its serialized graph: the map writes (which
    variable is not said there), so pulling from it in the tape is refused."""
    v, x, ds = _program()
    rebuilt = _from_variant(ds)
    with AssignAwareTape() as tape:
        before = tf.reduce_sum(v)
        with pytest.raises(UntrackedWriteError, match=r"(?s)Dataset_map_lambda.*next element.*variant"):
            next(iter(rebuilt))
    np.testing.assert_array_equal(v.numpy(), V0)
    del tape, before, x


def test_a_raw_variant_given_to_a_function_called_from_the_tape_is_refused() -> None:
    v, x, ds = _program()
    spec = ds.element_spec
    pull = tf.function(lambda variant: next(iter(tf.data.experimental.from_variant(variant, spec))))
    with AssignAwareTape() as tape:
        before = tf.reduce_sum(v)
        with pytest.raises(UntrackedWriteError, match=r"(?s)Dataset_map_lambda.*variant"):
            pull(tf.data.experimental.to_variant(ds))
    np.testing.assert_array_equal(v.numpy(), V0)
    del tape, before, x


def test_a_dataset_rebuilt_from_its_variant_in_the_tapes_function_is_refused_while_tracing() -> None:
    v, x, ds = _program()
    variant = tf.data.experimental.to_variant(ds)

    @tf.function
    def step() -> Any:
        with AssignAwareTape() as tape:
            before = tf.reduce_sum(v)
            element = next(iter(tf.data.experimental.from_variant(variant, ds.element_spec)))
            with tf.control_dependencies([element]):
                y = tf.reduce_sum(v * v) * x + 0.0 * before
        return y, tape.gradient(y, [x, v])

    with pytest.raises(ControlFlowWriteError, match=r"(?s)Dataset_map_lambda.*variant"):
        step()
    np.testing.assert_array_equal(v.numpy(), V0)


def test_a_dataset_rebuilt_from_its_variant_that_only_reads_runs() -> None:
    """y = sum(v) * e * x; by hand dy/dx = sum(v) * e, dy/dv = e * x."""
    v = tf.Variable(V0, dtype=tf.float64, name="v_read")
    x = tf.Variable(X0, dtype=tf.float64, name="x_read")
    rebuilt = _from_variant(tf.data.Dataset.from_tensors(tf.constant(E, tf.float64)).map(lambda e: e + 0.0 * v[0]))
    with AssignAwareTape() as tape:
        e = next(iter(rebuilt))
        y = tf.reduce_sum(v) * e * x
    gx, gv = tape.gradient(y, [x, v])
    np.testing.assert_allclose(float(gx), V0.sum() * E)
    np.testing.assert_allclose(np.asarray(gv), np.full(3, E * X0))


def test_a_function_traced_before_import_that_pulls_a_captured_writing_dataset_is_refused() -> None:
    """tests/helpers/traced_before_import.py: its trace noted nothing, so
    the call scans the datasets it captured; one that only reads still runs."""
    out = helper_output("traced_before_import")
    got, expected = out.pop("quiet")
    np.testing.assert_allclose(got, expected)
    for case, (error, unwritten) in out.items():
        assert (error, unwritten) == ("UntrackedWriteError", True), case


# -- Dataset.save's shard_func -----------------------------------------------------


def _writing_shard_func(v: tf.Variable, x: tf.Variable) -> Callable[[Any], Any]:
    return lambda e: (v.assign(v * x * e), tf.constant(0, tf.int64))[1]


def test_dataset_save_with_a_shard_func_that_writes_is_refused_eagerly() -> None:
    v, x, _ = _program()
    quiet = tf.data.Dataset.from_tensors(tf.constant(E, tf.float64))
    with AssignAwareTape() as tape:
        before = tf.reduce_sum(v)
        with pytest.raises(UntrackedWriteError, match=r"(?s)(?=.*v_written)(?=.*shard_func)"):
            quiet.save(os.path.join(tempfile.mkdtemp(), "saved"), shard_func=_writing_shard_func(v, x))
    np.testing.assert_array_equal(v.numpy(), V0)
    del tape, before


def test_dataset_save_with_a_shard_func_that_writes_is_refused_while_tracing() -> None:
    v, x, _ = _program()
    quiet = tf.data.Dataset.from_tensors(tf.constant(E, tf.float64))
    path = os.path.join(tempfile.mkdtemp(), "saved")

    @tf.function
    def step() -> Any:
        with AssignAwareTape() as tape:
            before = tf.reduce_sum(v)
            saved = quiet.save(path, shard_func=_writing_shard_func(v, x))
            with tf.control_dependencies([saved] if saved is not None else []):
                y = tf.reduce_sum(v * v) * x + 0.0 * before
        return y, tape.gradient(y, [x, v])

    with pytest.raises(ControlFlowWriteError, match=r"(?s)(?=.*v_written)(?=.*shard_func)"):
        step()
    np.testing.assert_array_equal(v.numpy(), V0)


def test_dataset_save_with_a_shard_func_that_only_reads_runs_in_a_tape() -> None:
    v = tf.Variable(V0, dtype=tf.float64, name="v_read")
    ds = tf.data.Dataset.from_tensor_slices(tf.constant([1.0, 2.0], tf.float64))
    path = os.path.join(tempfile.mkdtemp(), "saved")
    with AssignAwareTape() as tape:
        ds.save(path, shard_func=lambda e: tf.cast(v[0] > 0.0, tf.int64))
        y = tf.reduce_sum(v * v)
    np.testing.assert_allclose(tape.gradient(y, v).numpy(), 2 * V0)  # d sum(v^2) / dv = 2v
    np.testing.assert_allclose(sorted(e.numpy() for e in tf.data.Dataset.load(path)), [1.0, 2.0])


# -- py_function bodies in a dataset made before the tape ------------------------------


def _py_writing(kind: str) -> Tuple[tf.Variable, tf.Variable, tf.data.Dataset]:
    v = tf.Variable(V0, dtype=tf.float64, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64, name="x_read")

    def body(e: Any) -> Any:
        v.assign(v * x * e)
        return e

    if kind == "from_generator":

        def generate() -> Any:
            yield body(tf.constant(E, tf.float64))

        ds = tf.data.Dataset.from_generator(generate, output_signature=tf.TensorSpec((), tf.float64))
    else:
        make = tf.py_function if kind == "py_function" else tf.numpy_function
        base = tf.data.Dataset.from_tensors(tf.constant(E, tf.float64))
        ds = base.map(lambda e: make(body, [e], tf.float64))
    return v, x, ds.with_options(_NOT_AHEAD)


@pytest.mark.parametrize("read_first", [False, True], ids=["unread", "read"])
@pytest.mark.parametrize("kind", ["py_function", "numpy_function", "from_generator"])
def test_a_py_function_of_a_dataset_made_before_the_tape_that_writes_is_refused(kind: str, read_first: bool) -> None:
    """The body runs in one of tf.data's threads: a write there, whether or
    not the tape has read ``v`` yet, is refused (after it is made: the body
    is Python that no graph shows). Unrefused, the tape's reads of ``v``
    after it would have no path to ``x`` through ``v * x * e``."""
    v, x, ds = _py_writing(kind)
    with AssignAwareTape() as tape:
        before = tf.reduce_sum(v) if read_first else tf.constant(0.0, tf.float64)
        with pytest.raises(UntrackedWriteError, match="v_written"):
            next(iter(ds))
    del tape, before, x


def test_a_py_function_of_a_dataset_made_before_the_tape_is_refused_in_the_tapes_function() -> None:
    """Compiled: TensorFlow's runtime reports the body's refusal as its own
    error, carrying ours."""
    v, x, ds = _py_writing("py_function")

    @tf.function
    def step() -> Any:
        with AssignAwareTape() as tape:
            element = next(iter(ds))
            y = tf.reduce_sum(v * v) * x * element
        return y, tape.gradient(y, [x, v])

    with pytest.raises(tf.errors.UnknownError, match=r"(?s)UntrackedWriteError.*v_written"):
        step()


# -- datasets that run ahead, in the background ----------------------------------------


def _ahead(how: str) -> Tuple[tf.Variable, tf.Variable, tf.data.Dataset]:
    v = tf.Variable(V0, dtype=tf.float64, name="v_written")
    x = tf.Variable(X0, dtype=tf.float64, name="x_read")
    base = tf.data.Dataset.from_tensors(tf.constant(E, tf.float64)).repeat(4)

    def write(e: Any) -> Any:
        return (v.assign(v * x * e), e)[1]

    made = {
        "autotune": lambda: base.map(write),  # autotune injects a prefetch
        "prefetch": lambda: base.map(write).prefetch(1).with_options(_NOT_AHEAD),
        "parallel_map": lambda: base.map(write, num_parallel_calls=2).with_options(_NOT_AHEAD),
    }
    return v, x, made[how]()


AHEAD = ["autotune", "prefetch", "parallel_map"]


@pytest.mark.parametrize("how", AHEAD)
def test_a_tape_refuses_reading_a_variable_that_an_iterator_made_before_writes_ahead(how: str) -> None:
    """A training loop pulls outside the tape; tf.data makes the next element
    meanwhile, writing ``v`` while the tape is open: the tape's read of ``v``
    is refused, before it reads."""
    v, x, ds = _ahead(how)
    iterator = iter(ds)
    e = next(iterator)
    with AssignAwareTape() as tape:
        with pytest.raises(UntrackedWriteError, match=r"(?s)(?=.*v_written)(?=.*ahead)"):
            tf.reduce_sum(v * v) * x * e
    del tape, iterator


@pytest.mark.parametrize("how", AHEAD)
def test_an_iterator_made_in_the_tape_of_a_dataset_that_writes_ahead_is_refused(how: str) -> None:
    v, x, ds = _ahead(how)
    with AssignAwareTape() as tape:
        before = tf.reduce_sum(v)
        with pytest.raises(UntrackedWriteError, match=r"(?s)(?=.*v_written)(?=.*making of an iterator)"):
            iter(ds)
    np.testing.assert_array_equal(v.numpy(), V0)  # refused before tf.data started
    del tape, before, x


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("how", AHEAD)
def test_a_dataset_that_runs_ahead_and_only_reads_works_in_a_tape(how: str, compiled: bool) -> None:
    """Prefetch and a parallel map on a map that reads ``w``: the oracle's two
    SGD steps (``_train_oracle``), the batches scaled by 1 + 0 * w[0]."""
    batches = np.array([[1.0, 2.0, 0.5], [0.5, -1.0, 2.0]])
    w = tf.Variable(V0, dtype=tf.float64, name="w")
    base = tf.data.Dataset.from_tensor_slices(batches)
    scale = lambda b: b * (1.0 + 0.0 * w[0])  # noqa: E731
    ds = {
        "autotune": lambda: base.map(scale),
        "prefetch": lambda: base.map(scale).prefetch(2),
        "parallel_map": lambda: base.map(scale, num_parallel_calls=2, deterministic=True).prefetch(2),
    }[how]()

    step = _sgd_step(w, compiled)
    grad = None
    for b in ds:
        grad = step(b)
    _check_trained(w, grad, batches)


def test_tf_data_debug_mode_functions_that_write_are_refused() -> None:
    """tests/helpers/debug_mode_datasets.py: in debug mode a dataset's
    functions run as Python bodies, probed like a py_function's."""
    out = helper_output("debug_mode_datasets")
    got, expected = out.pop("quiet")
    np.testing.assert_allclose(got, expected)
    assert out == {"unread": "UntrackedWriteError", "read": "UntrackedWriteError"}
