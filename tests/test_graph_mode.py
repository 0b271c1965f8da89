"""Graphs without automatic control dependencies: a TF1 graph
(``tf.Graph().as_default()`` run by a ``tf.compat.v1.Session``, its cond and
loop bodies, TF1 control flow) and ``tf.compat.v1.wrap_function``.

There ops run in no build order and a write nothing depends on is pruned, so a
tape's versions (which assume build order is run order) could be silently
wrong: a write to a floating-point variable there while a tape is open in the
thread raises ``GraphWriteOrderError`` before anything is written. Writes
outside every tape, and reads with a tape open, stay plain TensorFlow.

One test per pattern of the adversarial review's findings f02-f10
(/work/adv-early); the expected values of the plain-TensorFlow cases are
derived by hand in comments.
"""

from __future__ import annotations

from typing import Any, Callable, List

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

import assigntape
from assigntape import AssignAwareTape, AssignTapeError

REFUSED = "no automatic control dependencies"


def _session_run(graph: tf.Graph, fetches: Any, feed: Any = None) -> Any:
    with tf.compat.v1.Session(graph=graph) as s:
        s.run(tf.compat.v1.global_variables_initializer())
        return s.run(fetches, feed)


def _variables(dtype: Any = tf.float32) -> List[Any]:
    x = tf.compat.v1.Variable(1.5, use_resource=True, dtype=dtype, name="x")
    w = tf.compat.v1.Variable(2.0, use_resource=True, dtype=dtype, name="w")
    return [x, w]


def _refused_in_graph(build: Callable[[Any, Any], Any], dtype: Any = tf.float32) -> None:
    """``build(x, w)`` inside a tape in a TF1 graph is refused, naming a
    variable and the context; after the refusal (caught inside the tape) the
    variables are as they were: a read of w credits w0 (y = w x: dy/dx = w0 = 2,
    dy/dw = x = 1.5) and the session reads w0 = 2."""
    g = tf.Graph()
    with g.as_default():
        x, w = _variables(dtype)
        with AssignAwareTape() as t:
            with pytest.raises(AssignTapeError, match=REFUSED) as caught:
                build(x, w)
            y = w.read_value() * x
        gx, gw = t.gradient(y, [x, w])
        assert "TF1 graph / wrap_function" in str(caught.value)
        assert "tf.function" in str(caught.value)
        assert isinstance(caught.value, NotImplementedError)
        y_v, gx_v, gw_v, w_v = _session_run(g, [y, gx, gw, w])
    np.testing.assert_allclose([y_v, gx_v, gw_v, w_v], [3.0, 2.0, 1.5, 2.0], rtol=1e-6)


def test_the_error_is_exported_and_narrows_not_implemented() -> None:
    assert issubclass(assigntape.GraphWriteOrderError, AssignTapeError)
    assert issubclass(assigntape.GraphWriteOrderError, NotImplementedError)


# f02: a write in a control-flow-v2 tf.cond branch / tf.while_loop body of a TF1 graph
# (TensorFlow prunes it: nothing depends on it).
def _write_in_body(kind: str) -> Callable[[Any, Any], None]:
    """A tf.cond branch or tf.while_loop body (2 iterations) that writes w,
    its output not depending on the write."""

    def build(x: Any, w: Any) -> None:
        def branch() -> Any:
            w.assign(w * x)
            return tf.constant(1.0)

        if kind == "cond":
            tf.cond(tf.constant(True), branch, lambda: tf.constant(2.0))
        else:
            tf.while_loop(lambda i: i < 2, lambda i: [i + 1 + 0 * tf.cast(branch(), tf.int32)], [tf.constant(0)])

    return build


@pytest.mark.parametrize("kind", ["cond", "while"])
def test_f02_write_in_a_v2_body_of_a_tf1_graph_is_refused(kind: str) -> None:
    _refused_in_graph(_write_in_body(kind))


# f03: TF1 control flow (disable_control_flow_v2): cond and while_loop bodies that write.
@pytest.mark.parametrize("kind", ["cond", "while"])
def test_f03_write_in_tf1_control_flow_is_refused(kind: str) -> None:
    before = control_flow_util.ENABLE_CONTROL_FLOW_V2
    tf.compat.v1.disable_control_flow_v2()
    try:
        _refused_in_graph(_write_in_body(kind))
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = before


def test_tf1_control_flow_without_writes_is_as_tensorflow() -> None:
    """f03's bodies reading w (no write), under the tape: as a plain tape.
    y = w x read after the cond: dy/dx = w0 = 2, dy/dw = x = 1.5. (The gradient
    through a TF1 cond's output fails in TensorFlow itself under a plain tape:
    "Retval[0] does not have value"; not asked here.)"""
    before = control_flow_util.ENABLE_CONTROL_FLOW_V2
    tf.compat.v1.disable_control_flow_v2()
    try:
        g = tf.Graph()
        with g.as_default():
            x, w = _variables()
            p = tf.compat.v1.placeholder(tf.bool, [])
            with AssignAwareTape() as t:
                r = tf.cond(p, lambda: w * x, lambda: w + x)
                with tf.control_dependencies([r]):
                    y = w.read_value() * x
            gx, gw = t.gradient(y, [x, w])
            out = _session_run(g, [y, gx, gw, r], {p: True})
        np.testing.assert_allclose(out, [3.0, 2.0, 1.5, 3.0], rtol=1e-6)
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = before


# f04: an AssignAwareTape entered eagerly, a tf.Graph built inside it with a write.
def test_f04_write_in_a_graph_built_inside_an_eager_tape_is_refused() -> None:
    v = tf.Variable(3.0)
    with AssignAwareTape() as t:
        v.assign(v * 2.0)
        g = tf.Graph()
        with g.as_default():
            x, w = _variables()
            with pytest.raises(AssignTapeError, match=REFUSED):
                w.assign(w * x)
            y = w.read_value() * x
            gx = tf.compat.v1.gradients(y, x)[0]
        u = v * v  # the eager tape goes on: u = (2 v0)^2, du/dv0 = 8 v0 = 24
    assert float(t.gradient(u, v)) == pytest.approx(24.0)
    # The graph is as if the write had not been built: y = w0 x, dy/dx = w0.
    np.testing.assert_allclose(_session_run(g, [y, gx, w]), [3.0, 2.0, 2.0], rtol=1e-6)


# f05: scatter_mul / scatter_div (a rule that keeps the written rows) in a TF1 graph.
@pytest.mark.parametrize("method", ["scatter_mul", "scatter_div"])
def test_f05_scatter_write_in_a_tf1_graph_is_refused(method: str) -> None:
    def build(x: Any, w: Any) -> None:
        rows = tf.compat.v1.Variable([[1.0, 2.0], [3.0, 4.0]], use_resource=True, dtype=tf.float64)
        getattr(rows, method)(tf.IndexedSlices(tf.fill([1, 2], tf.cast(x, tf.float64)), [0]))

    _refused_in_graph(build)


# f06: a tf.compat.v1.train optimizer step (a fused kernel) in a TF1 graph.
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_f06_v1_optimizer_step_in_a_tf1_graph_is_refused(optimizer: str) -> None:
    def build(x: Any, w: Any) -> None:
        if optimizer == "sgd":
            tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(w * w, var_list=[w])
        else:
            tf.compat.v1.train.AdamOptimizer(0.1).apply_gradients([(tf.constant(1.0), w)])

    _refused_in_graph(build)


# f07: a tf.compat.v1.train.Saver built inside the tape (its restore ops write).
def test_f07_saver_built_inside_the_tape_in_a_tf1_graph_is_refused() -> None:
    _refused_in_graph(lambda x, w: tf.compat.v1.train.Saver([w, x]))


# f08: ExponentialMovingAverage.apply (creates a shadow, then writes it).
def test_f08_moving_average_in_a_tf1_graph_is_refused() -> None:
    _refused_in_graph(lambda x, w: tf.compat.v1.train.ExponentialMovingAverage(0.5).apply([w]))


# f09: a cond whose branches write and return a value that depends on the write.
def test_f09_cond_with_connected_writes_in_a_tf1_graph_is_refused() -> None:
    def build(x: Any, w: Any) -> None:
        p = tf.compat.v1.placeholder(tf.bool, [])
        tf.cond(p, lambda: w.assign(w * x).read_value() + 0.0, lambda: w.assign_add(x).read_value() + 0.0)

    _refused_in_graph(build)


# f10: tf.compat.v1.wrap_function (a FuncGraph without automatic control dependencies).
@pytest.mark.parametrize("kind", ["scatter_mul", "cond"])
def test_f10_write_in_wrap_function_is_refused(kind: str) -> None:
    x = tf.Variable(1.5, dtype=tf.float64)
    w = tf.Variable([[1.0, 2.0], [3.0, 4.0]], dtype=tf.float64)
    s = tf.Variable(2.0, dtype=tf.float64)
    messages = []

    def f() -> Any:
        with AssignAwareTape():
            try:
                if kind == "scatter_mul":
                    w.scatter_mul(tf.IndexedSlices(tf.fill([1, 2], x), [0]))
                else:

                    def branch() -> Any:
                        s.assign(s * x)
                        return tf.constant(1.0, tf.float64)

                    tf.cond(x > 0, branch, lambda: tf.constant(2.0, tf.float64))
            except AssignTapeError as e:
                messages.append(str(e))
        return s.read_value()

    tf.compat.v1.wrap_function(f, [])()
    assert len(messages) == 1 and REFUSED in messages[0]
    # Nothing was written.
    np.testing.assert_array_equal(w.numpy(), [[1.0, 2.0], [3.0, 4.0]])
    assert float(s.numpy()) == 2.0


# Outside every tape: plain TensorFlow, in a TF1 graph and in wrap_function.
def test_writes_outside_every_tape_in_a_tf1_graph_are_plain_tensorflow() -> None:
    with AssignAwareTape():  # the patches are installed
        pass
    g = tf.Graph()
    with g.as_default():
        x, w = _variables()
        a = w.assign(w * x)
        with tf.control_dependencies([a]):
            y = w.read_value() * x  # w1 = w0 x = 3; y = w1 x = 4.5
        rows = tf.compat.v1.Variable([[1.0, 2.0]], use_resource=True)
        r = rows.scatter_mul(tf.IndexedSlices(tf.fill([1, 2], x), [0]))  # [[1.5, 3]]
        step = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(x * x, var_list=[x])  # x - 0.5 * 2x = 0
        out = _session_run(g, [y, r])
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(step)
            x_after = sess.run(x)
    assert out[0] == pytest.approx(4.5)
    np.testing.assert_allclose(out[1], [[1.5, 3.0]])
    assert x_after == pytest.approx(0.0)


def test_writes_outside_every_tape_in_wrap_function_are_plain_tensorflow() -> None:
    with AssignAwareTape():
        pass
    w = tf.Variable(2.0)

    def f() -> Any:
        a = w.assign(w * 1.5)
        with tf.control_dependencies([a]):
            return w.read_value() * 2.0  # w1 = 3, 6

    assert float(tf.compat.v1.wrap_function(f, [])()) == pytest.approx(6.0)
    assert float(w.numpy()) == pytest.approx(3.0)


def test_reads_creation_and_integer_writes_inside_a_tape_in_a_tf1_graph_are_as_tensorflow() -> None:
    """No float write: the tape answers as a plain tape. Variables made inside
    the tape (their initializers write) and an integer counter's write work.
    y = w x with w = 2, x = 1.5 (made inside the tape): dy/dx = 2, dy/dw = 1.5."""
    g = tf.Graph()
    with g.as_default():
        with AssignAwareTape() as t:
            x, w = _variables()
            step = tf.compat.v1.Variable(0, use_resource=True, dtype=tf.int64)
            inc = step.assign_add(1)
            y = w.read_value() * x
        gx, gw = t.gradient(y, [x, w])
        out = _session_run(g, [y, gx, gw, inc])
    np.testing.assert_allclose(out, [3.0, 2.0, 1.5, 1], rtol=1e-6)


def test_the_same_write_in_a_tf_function_is_followed() -> None:
    """tf.function has automatic control dependencies: not refused.
    w1 = w0 x; y = w1 x = w0 x^2: dy/dx = 2 w0 x = 6, dy/dw0 = x^2 = 2.25."""
    x, w = tf.Variable(1.5), tf.Variable(2.0)

    @tf.function
    def f() -> Any:
        with AssignAwareTape() as t:

            def branch() -> Any:
                w.assign(w * x)
                return tf.constant(1.0)

            r = tf.cond(x > 0, branch, lambda: tf.constant(2.0))
            with tf.control_dependencies([r]):
                y = w.read_value() * x
        return t.gradient(y, [x, w])

    gx, gw = f()
    assert float(gx) == pytest.approx(6.0)
    assert float(gw) == pytest.approx(2.25)


def test_f10_wrap_function_traced_inside_an_eager_tape_is_refused() -> None:
    """As f04, with wrap_function: the eager tape is open while the function's
    graph (no automatic control dependencies) is built with a write."""
    w = tf.Variable(2.0)
    messages = []

    def f() -> Any:
        try:
            w.assign(w * 1.5)
        except AssignTapeError as e:
            messages.append(str(e))
        return w.read_value()

    with AssignAwareTape() as t:
        y = tf.compat.v1.wrap_function(f, [])() * w  # no write ran: y = w0 * w0
    assert len(messages) == 1 and REFUSED in messages[0] and "AssignVariableOp" in messages[0]
    assert float(y) == pytest.approx(4.0)
    # The program with the write refused: y = w * w, dy/dw = 2 w0 = 4.
    assert float(t.gradient(y, w)) == pytest.approx(4.0)
    assert float(w.numpy()) == 2.0


# A tf.data function that writes, pulled in a TF1 graph inside a tape: refused
# as a direct write there is (its map function is traced with automatic control
# dependencies, but the TF1 graph runs the dataset's functions in no order the
# tape knows).
def _writing_dataset(x: Any, w: Any) -> Any:
    return tf.data.Dataset.from_tensors(tf.constant(3.0)).map(lambda e: (w.assign(w * x), e)[1])


def _initializable(x: Any, w: Any) -> Any:
    return tf.compat.v1.data.make_initializable_iterator(_writing_dataset(x, w)).get_next()


def _reinitializable(x: Any, w: Any) -> Any:
    ds = _writing_dataset(x, w)
    it = tf.compat.v1.data.Iterator.from_structure(tf.float32, tf.TensorShape([]))
    it.make_initializer(ds)
    return it.get_next()


def _optional(x: Any, w: Any) -> Any:
    return tf.compat.v1.data.make_initializable_iterator(_writing_dataset(x, w)).get_next_as_optional()


def _feedable(x: Any, w: Any) -> Any:
    """A feedable iterator runs the functions of whichever iterator's handle
    is fed: any of the graph's, here one whose dataset writes."""
    tf.compat.v1.data.make_initializable_iterator(_writing_dataset(x, w))
    handle = tf.compat.v1.placeholder(tf.string, [])
    return tf.compat.v1.data.Iterator.from_string_handle(handle, tf.float32, tf.TensorShape([])).get_next()


def _feedable_first(x: Any, w: Any) -> Any:
    """The feedable iterator's get_next first, the writing iterator after
    (refused as it is made: its handle may be fed there)."""
    handle = tf.compat.v1.placeholder(tf.string, [])
    tf.compat.v1.data.Iterator.from_string_handle(handle, tf.float32, tf.TensorShape([])).get_next()
    return tf.compat.v1.data.make_initializable_iterator(_writing_dataset(x, w))


DATASET_PULLS = {
    "feedable_iterator": _feedable,
    "feedable_iterator_first": _feedable_first,
    "initializable_iterator": _initializable,
    "reinitializable_iterator": _reinitializable,
    "get_next_as_optional": _optional,
    "reduce": lambda x, w: _writing_dataset(x, w).reduce(tf.constant(0.0), lambda s, e: s + e),
    "get_single_element": lambda x, w: _writing_dataset(x, w).get_single_element(),
}


@pytest.mark.parametrize("pull", sorted(DATASET_PULLS))
def test_f11_dataset_write_pulled_in_a_tf1_graph_is_refused(pull: str) -> None:
    def build(x: Any, w: Any) -> None:
        with pytest.raises(AssignTapeError, match="tf.data function") as caught:
            DATASET_PULLS[pull](x, w)
        assert "'w'" in str(caught.value)
        raise caught.value

    _refused_in_graph(build)


def test_f11_iterator_made_before_the_tape_is_refused_at_get_next() -> None:
    g = tf.Graph()
    with g.as_default():
        x, w = _variables()
        it = tf.compat.v1.data.make_initializable_iterator(_writing_dataset(x, w))
        with AssignAwareTape():
            with pytest.raises(AssignTapeError, match=REFUSED):
                it.get_next()
        # Outside every tape: plain TensorFlow (w1 = w0 x = 3).
        e = it.get_next()
        with tf.compat.v1.Session(graph=g) as s:
            s.run(tf.compat.v1.global_variables_initializer())
            s.run(it.initializer)
            assert s.run(e) == pytest.approx(3.0)
            assert s.run(w) == pytest.approx(3.0)


@pytest.mark.parametrize("pull", ["iterator", "reduce", "feedable"])
def test_a_dataset_that_only_reads_in_a_tf1_graph_is_as_tensorflow(pull: str) -> None:
    """The element is e = 3 w = 6 (w = 2), read by the map; y = e x = 9. The
    element is no function of x for the gradient: dy/dx = e = 6, dy/dw none
    (tf.data's ops have no gradient), as a plain tape answers."""
    g = tf.Graph()
    with g.as_default():
        x, w = _variables()
        ds = tf.data.Dataset.from_tensors(tf.constant(3.0)).map(lambda c: c * w)
        with AssignAwareTape() as t:
            if pull != "reduce":
                it = tf.compat.v1.data.make_initializable_iterator(ds)
                e = it.get_next()
            if pull == "feedable":
                handle = tf.compat.v1.placeholder(tf.string, [])
                e = tf.compat.v1.data.Iterator.from_string_handle(handle, tf.float32, tf.TensorShape([])).get_next()
            if pull == "reduce":
                e = ds.reduce(tf.constant(0.0), lambda s, c: s + c)
            y = e * x
        gx, gw = t.gradient(y, [x, w])
        assert gw is None
        with tf.compat.v1.Session(graph=g) as s:
            s.run(tf.compat.v1.global_variables_initializer())
            feed = None
            if pull != "reduce":
                s.run(it.initializer)
            if pull == "feedable":
                feed = {handle: s.run(it.string_handle())}
            out = s.run([y, gx], feed)
    np.testing.assert_allclose(out, [9.0, 6.0], rtol=1e-6)
