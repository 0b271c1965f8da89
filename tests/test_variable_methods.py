"""A variable's own methods under a tape: same values, results and errors as
TensorFlow's, whichever path the tape takes (eagerly, ``value`` and the
write methods take a short path while a tape is open; see ``_short_paths``)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run
from tensorflow.python.framework import ops
from tensorflow.python.ops import resource_variable_ops as rvo

from assigntape import AssignAwareTape

WRITES = ["assign", "assign_add", "assign_sub"]
VALUES = {
    "tuple": lambda: (0.5, -1.0),
    "numpy": lambda: np.array([0.5, -1.0], np.float32),
    "list": lambda: [0.5, -1.0],
    "tensor": lambda: tf.constant([0.5, -1.0]),
    "float64 numpy into float32": lambda: np.array([0.5, -1.0]),
    # A tensor of another dtype: TensorFlow's error (the short path converts
    # only what is not already a tensor of the variable's dtype).
    "float64 tensor": lambda: tf.constant([0.5, -1.0], tf.float64),
    "int32 tensor": lambda: tf.constant([1, -1]),
}
REFUSED = {"float64 numpy into float32", "float64 tensor", "int32 tensor"}  # by TensorFlow's methods


def _outcome(fn):
    """What ``fn()`` gave: its result's type, value, or its error's type."""
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - compared, not swallowed
        return ("raised", type(e).__name__)
    if result is None:
        return ("None",)
    return (type(result).__name__, np.asarray(result).tolist())


def _write_outcome(tape_cls, method, value, **kwargs):
    v = tf.Variable([1.0, 2.0])
    with tape_cls():
        got = _outcome(lambda: getattr(v, method)(value(), **kwargs))
        after = v.numpy().tolist()
    return got, after, v.numpy().tolist()


def test_the_short_paths_are_served_while_a_tape_is_open_and_only_then():
    served = [(rvo.ResourceVariable, name) for name in ["value", *WRITES]] + [(ops, "convert_to_tensor")]
    outside = {place: vars(place[0]).get(place[1]) for place in served}
    with AssignAwareTape():
        for owner, name in served:
            assert vars(owner).get(name) is not outside[owner, name], name
    for owner, name in served:
        assert vars(owner).get(name) is outside[owner, name], name


CONVERSIONS = {
    "plain": lambda v: ops.convert_to_tensor(v),
    "own dtype": lambda v: ops.convert_to_tensor(v, dtype=tf.float32),
    "own dtype by name": lambda v: ops.convert_to_tensor(v, dtype="float32"),
    "other dtype": lambda v: ops.convert_to_tensor(v, dtype=tf.int32),  # TensorFlow's ValueError
    "own dtype preferred": lambda v: ops.convert_to_tensor(v, preferred_dtype=tf.float32),
    "other dtype preferred": lambda v: ops.convert_to_tensor(v, dtype_hint=tf.int32),  # ignored
    "named": lambda v: ops.convert_to_tensor(v, name="x"),
    "restricted result types": lambda v: ops.convert_to_tensor(v, accepted_result_types=(tf.Variable,)),
    "public": lambda v: tf.convert_to_tensor(v),
    "matmul": lambda v: tf.ones([1, 2]) @ tf.reshape(v, [2, 1]),
    "operator": lambda v: v * tf.constant(2.0),
}


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_a_conversion_returns_and_raises_as_tensorflows(conversion):
    """Inside a tape ``ops.convert_to_tensor`` reads a plain variable
    through ``value()`` directly (``_short_paths.convert_function``): the same
    result or error as TensorFlow's, and the read watched alike."""

    def outcome(tape_cls):
        v = tf.Variable([1.0, 2.0], name="converted")
        with tape_cls() as tape:
            got = _outcome(lambda: CONVERSIONS[conversion](v))
        return got, [w.name for w in tape.watched_variables()]

    assert outcome(AssignAwareTape) == outcome(tf.GradientTape)


_K = [100.0, 200.0]
OVERRIDES = {
    # (on the variable, undone after)
    "instance _dense_var_to_tensor": lambda v: (
        setattr(v, "_dense_var_to_tensor", lambda dtype=None, name=None, as_ref=False: tf.constant(_K)),
        None,
    ),
    "instance __tf_tensor__": lambda v: (
        setattr(v, "__tf_tensor__", lambda dtype=None, name=None: tf.constant(_K)),
        None,
    ),
    "class __tf_tensor__": lambda v: (
        setattr(rvo.BaseResourceVariable, "__tf_tensor__", lambda self, dtype=None, name=None: tf.constant(_K)),
        lambda: delattr(rvo.BaseResourceVariable, "__tf_tensor__"),
    ),
}


@pytest.mark.parametrize("override", list(OVERRIDES))
def test_a_conversion_someone_overrides_is_used_inside_a_tape(override):
    """TensorFlow's registry asks a value's ``__tf_tensor__`` first, then the
    variable's ``_dense_var_to_tensor``: one put on the instance, or on the
    class after the first tape, is used inside a tape too (helper-32)."""
    with AssignAwareTape():
        ops.convert_to_tensor(tf.Variable(0.0))  # the short path served before

    def outcome(tape_cls):
        v = tf.Variable([1.0, 2.0])
        _, undo = OVERRIDES[override](v)
        try:
            with tape_cls() as tape:
                y = ops.convert_to_tensor(v)
            return y.numpy().tolist(), tape.gradient(y, v)
        finally:
            if undo is not None:
                undo()

    assert outcome(AssignAwareTape) == outcome(tf.GradientTape) == (_K, None)


def test_a_conversion_error_in_a_function_reads_as_tensorflows():
    """AutoGraph converts the functions a tf.function calls unless they are
    TensorFlow's (or marked): the conversion served inside a tape is left
    alone as TensorFlow's is (helper-32: converted, its error grew frames of
    AutoGraph's rewrite). Its own frame is listed, TensorFlow's are not."""

    def message(tape_cls):
        @tf.function
        def f(x):
            return ops.convert_to_tensor(x, dtype=tf.int32)

        with tape_cls():
            with pytest.raises(ValueError) as raised:
                f(tf.constant([1.5]))
        return str(raised.value)

    ours, plain = message(AssignAwareTape), message(tf.GradientTape)
    own = [line for line in ours.splitlines() if "_short_paths.py" in line]
    assert all(line.endswith("  **") for line in own), own  # called as it is, not converted ("  *")
    ours_lines = [
        line for line in ours.splitlines() if "_short_paths.py" not in line and "return original(" not in line
    ]
    assert ours_lines == plain.splitlines()


def test_the_served_conversion_shows_tensorflows_argument_spec():
    from tensorflow.python.util import tf_inspect

    outside = tf_inspect.getfullargspec(ops.convert_to_tensor)
    with AssignAwareTape():
        assert tf_inspect.getfullargspec(ops.convert_to_tensor) == outside


@modes
@pytest.mark.parametrize("conversion", ["plain", "own dtype preferred", "matmul", "operator"])
def test_a_converted_version_gives_the_rewrites_gradient(mode, conversion):
    convert = CONVERSIONS[conversion]
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(3.0)

    def written():
        v.assign([1.0, 2.0])
        with AssignAwareTape() as tape:
            v.assign(a * v)
            y = tf.reduce_sum(convert(v) ** 2)
        return tape.gradient(y, [a, v])

    def rewrite():
        v.assign([1.0, 2.0])
        with tf.GradientTape() as tape:
            t0 = tf.identity(v)
            t = a * t0
            y = tf.reduce_sum(convert(t) ** 2)
        return tape.gradient(y, [a, t0])

    assert_grads_close(run(mode, written), run(mode, rewrite))


@pytest.mark.parametrize("method", WRITES)
@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("read_value", [True, False])
def test_a_write_method_returns_and_writes_as_tensorflows(method, value, read_value):
    ours = _write_outcome(AssignAwareTape, method, VALUES[value], read_value=read_value)
    plain = _write_outcome(tf.GradientTape, method, VALUES[value], read_value=read_value)
    assert ours == plain
    if value not in REFUSED:
        assert ours[0][0] == ("_UnreadVariable" if read_value else "None")


@pytest.mark.parametrize(
    "method,value",
    [
        ("assign", lambda: tf.constant([1, 2])),  # int32 into float32
        ("assign_add", lambda: tf.constant([1, 2])),
        ("assign", lambda: tf.constant([1.0, 2.0, 3.0])),  # wrong shape
        ("assign_add", lambda: tf.constant([1.0, 2.0, 3.0])),
        ("assign_sub", lambda: tf.constant([[1.0, 2.0]])),
        ("assign", lambda: "text"),
    ],
)
def test_a_failed_write_raises_as_tensorflow_and_changes_nothing(method, value):
    ours, ours_after, _ = _write_outcome(AssignAwareTape, method, value)
    plain, plain_after, _ = _write_outcome(tf.GradientTape, method, value)
    assert ours[0] == "raised" and ours == plain and ours_after == plain_after == [1.0, 2.0]
    # The tape carries on from the version before the failed write.
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(3.0)
    with AssignAwareTape() as tape:
        v.assign(a * v)
        with pytest.raises(Exception):  # noqa: B017 (whichever TensorFlow raises: compared with a plain tape's above)
            getattr(v, method)(value())
        loss = tf.reduce_sum(v * v)
    assert float(tape.gradient(loss, a)) == pytest.approx(2 * 3.0 * (1.0 + 4.0))


@modes
def test_chained_results_and_keywords_follow_the_versions(mode):
    v, a = tf.Variable(2.0), tf.Variable(3.0)

    def body():
        with AssignAwareTape() as tape:
            r = v.assign(value=a * v).assign_add(delta=a, name="step")
            r.assign_sub(1.0, read_value=False)
            y = v.value() * r.read_value()  # both the latest version
        return y, tape.gradient(y, [a, v])

    y, grads = run(mode, body)
    latest = 3.0 * 2.0 + 3.0 - 1.0  # a v + a - 1, with a = 3 and v = 2
    assert float(y) == latest**2
    # y = (a v + a - 1)^2: dy/da = 2 (a v + a - 1)(v + 1), dy/dv = 2 (a v + a - 1) a
    assert_grads_close(grads, [2 * latest * (2.0 + 1.0), 2 * latest * 3.0])


@modes
@pytest.mark.parametrize("trainable", [True, False])
def test_a_read_is_watched_as_tensorflows(mode, trainable):
    """``value()`` (every conversion: ``v * x``) watches a trainable variable
    only, and marks it read, as TensorFlow's does."""
    v = tf.Variable(2.0, trainable=trainable)

    def body():
        with AssignAwareTape() as tape:
            y = v * v
        return tape.gradient(y, v), [w.name for w in tape.watched_variables()]

    grad, watched = run(mode, body)
    if trainable:
        assert float(grad) == 4.0 and watched == [v.name]
    else:
        assert grad is None and watched == []
    # What TensorFlow's read notes on the variable (since 2.17), noted alike.
    plain = tf.Variable(2.0, trainable=trainable)
    with tf.GradientTape():
        run(mode, lambda: plain * plain)
    assert v.__dict__.get("_variable_read") == plain.__dict__.get("_variable_read")


def test_reads_and_writes_of_other_variable_kinds_keep_tensorflows_methods():
    """A variable whose class or state the short paths do not cover (a cached
    value, an ``_UnreadVariable``, an int variable) goes to TensorFlow's
    method, and its gradient is still the rewrite's."""
    a = tf.Variable(3.0)
    counter = tf.Variable(0, dtype=tf.int64)
    v = tf.Variable(1.0)
    with AssignAwareTape() as tape:
        unread = v.assign(a * 2.0)  # an _UnreadVariable: TensorFlow's method
        unread.assign_add(a)
        counter.assign_add(1)
        y = unread.value() * v.value()
    assert int(counter.numpy()) == 1
    # y = (3a)^2: dy/da = 18a
    assert float(tape.gradient(y, a)) == pytest.approx(54.0)


@pytest.mark.parametrize("method", WRITES)
@pytest.mark.parametrize("read_value", [True, False])
def test_a_write_watches_the_variable_as_tensorflows(method, read_value):
    """TensorFlow's method watches the variable it wrote when it returns the
    lazy read (``read_value=True``); a partial write reads the old value,
    which the tape watches too (see ``test_write_kinds``)."""

    def watched(tape_cls):
        v = tf.Variable([1.0, 2.0], name="written")
        with tape_cls() as tape:
            getattr(v, method)(tf.constant([0.5, 0.5]), read_value=read_value)
        return [w.name for w in tape.watched_variables()]

    ours, plain = watched(AssignAwareTape), watched(tf.GradientTape)
    if method == "assign":
        assert ours == plain
    else:
        assert ours == ["written:0"]
    assert ours == ([] if method == "assign" and not read_value else ["written:0"])


def _both_ways(tape, target, sources):
    """The gradient asked for a list of variables (which TensorFlow may answer
    directly) and for the same variables in a dict (always mapped)."""
    listed = tape.gradient(target, list(sources))
    mapped = tape.gradient(target, {str(i): s for i, s in enumerate(sources)})
    return listed, [mapped[str(i)] for i in range(len(sources))]


@pytest.mark.parametrize(
    "case",
    [
        "no write",
        "writes",
        "outer tape wrote first",
        "persistent tape re-entered",
        "reset",
        "read before a write",
        "another tape's version adopted",
    ],
)
def test_a_gradient_is_the_same_whichever_way_the_sources_are_given(case):
    v, w, a = tf.Variable(2.0), tf.Variable(3.0), tf.Variable(0.5)
    other = AssignAwareTape(persistent=True)
    if case == "another tape's version adopted":
        with other:
            v.assign(a * v)  # the other tape's latest version of v...
    outer = AssignAwareTape(persistent=True)
    with outer:
        if case == "another tape's version adopted":
            with other:  # ...current again while it is open, here
                v.assign_add(w)
        if case == "outer tape wrote first":
            v.assign(a * v)
        tape = AssignAwareTape(persistent=True)
        with tape:
            if case == "persistent tape re-entered":
                w.assign(a * w)
        if case == "persistent tape re-entered":
            v.assign(v * 2.0)  # while the tape is closed
        with tape:
            y0 = v * w
            if case in ("writes", "persistent tape re-entered", "read before a write"):
                v.assign_add(a * w)
            if case == "reset":
                v.assign(a * 4.0)
                tape.reset()
                v.assign_sub(a)
            y = v * w * a + y0
    listed, mapped = _both_ways(tape, y, [v, w, a])
    assert_grads_close(listed, mapped)
    outer_listed, outer_mapped = _both_ways(outer, y, [v, w, a])
    assert_grads_close(outer_listed, outer_mapped)


_WRAPPED_FIRST = r"""
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import functools
import wrapt
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops as rvo

calls = []
assign = rvo.ResourceVariable.assign

@functools.wraps(assign)
def clipped(self, value, *args, **kwargs):  # someone's wrapper, before any tape
    calls.append("assign")
    return assign(self, tf.clip_by_value(value, -1.0, 1.0), *args, **kwargs)

rvo.ResourceVariable.assign = clipped

def counted(wrapped, instance, args, kwargs):
    calls.append("assign_add")
    return wrapped(*args, **kwargs)

wrapt.wrap_function_wrapper(rvo.ResourceVariable, "assign_add", counted)

from assigntape import AssignAwareTape
v, x = tf.Variable([0.0, 0.0, 0.0]), tf.Variable([0.3, -0.7, 1.1])
with AssignAwareTape() as tape:
    v.assign(3.0 * x)
    v.assign_add(x)
    y = tf.reduce_sum(v)
print(repr((v.numpy().tolist(), tape.gradient(y, x).numpy().tolist(), calls)))
"""


def test_a_method_someone_wrapped_before_the_first_tape_keeps_their_wrapper():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _WRAPPED_FIRST], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    values, grad, calls = eval(out.stdout.strip().splitlines()[-1])
    # clip(3x) + x, and its gradient 3 * [|3x| < 1] + 1.
    np.testing.assert_allclose(values, [0.9 + 0.3, -1.0 - 0.7, 1.0 + 1.1], rtol=1e-6)
    np.testing.assert_allclose(grad, [4.0, 1.0, 1.0])
    assert calls == ["assign", "assign_add"]


@pytest.mark.parametrize("tape_cls", [AssignAwareTape, tf.GradientTape])
def test_reads_and_writes_in_init_scope_while_tracing_are_noted_as_tensorflows(tape_cls):
    """Eager inside ``tf.init_scope()`` while a function is traced: the
    function notes the variables used there (TensorFlow's ``variable_accessed``),
    whichever tape is open (found by an adversarial review)."""
    v, w = tf.Variable(2.0, name="read_in_init"), tf.Variable(3.0, name="written_in_init")

    @tf.function
    def f(x):
        with tf.init_scope():
            c = v * 2.0
            w.assign_add(1.0)
            got = w.assign_sub(0.5)
        return x * c, got._graph_key

    with tape_cls() as tape:
        x = tf.constant(1.0)
        tape.watch(x)
        y, key = f(x)
    cf = f.get_concrete_function(tf.constant(1.0))
    assert sorted(a.name for a in cf.graph.variables) == ["read_in_init:0", "written_in_init:0"]
    assert sorted(a.name for a in tape.watched_variables()) == ["read_in_init:0", "written_in_init:0"]
    assert float(tape.gradient(y, x)) == 4.0
    # What a write returns there belongs to the eager context's graph, as TensorFlow's.
    assert key == tf.compat.v1.get_default_graph()._graph_key


def test_a_kept_write_result_names_its_variable_for_later_tapes():
    """A variable made after uninstall() is known by a kept ``assign`` result
    (found by an adversarial review: the result built from a template did not
    note its handle)."""
    import assigntape

    with AssignAwareTape():
        pass
    import gc

    gc.collect()
    assigntape.uninstall()
    v = tf.Variable(1.0, name="made_after_uninstall")
    handle = v.handle  # fetched before any tape
    with AssignAwareTape():
        kept = v.assign(2.0)
    x = tf.constant(2.0)
    with AssignAwareTape() as tape:
        tape.watch(x)
        tf.raw_ops.AssignVariableOp(resource=handle, value=x * 5.0)
        y = v * 3.0
    assert float(y) == 30.0 and float(tape.gradient(y, x)) == 15.0
    assert float(kept.numpy()) == 10.0


def test_a_write_result_belongs_to_the_default_graph_as_tensorflows():
    from tensorflow.python.eager import context

    graph, v = tf.Graph(), tf.Variable(1.0)
    with AssignAwareTape():
        v.assign_add(0.0)  # a write elsewhere first (the template is made once)
    keys = []
    for tape_cls in (AssignAwareTape, tf.GradientTape):
        with tape_cls():
            with graph.as_default(), context.eager_mode():
                keys.append(v.assign_add(1.0)._graph_key)
    assert keys == [graph._graph_key, graph._graph_key]


class _OwnHandle(rvo.ResourceVariable):
    """Keeps its handle behind a ``_handle`` property of its own."""

    @property
    def _handle(self):
        return self.__dict__["_my_handle"]

    @_handle.setter
    def _handle(self, value):
        self.__dict__["_my_handle"] = value


@pytest.mark.parametrize("tape_cls", [AssignAwareTape, tf.GradientTape])
def test_a_subclass_with_its_own_handle_property_reads_as_in_tensorflow(tape_cls):
    """``v.handle`` is TensorFlow's property (``self._handle``) inside a tape
    too, so a subclass's own ``_handle`` is honoured (serving ``handle``
    beside ``_handle`` broke it: helper-31)."""
    s = _OwnHandle(2.0)
    with tape_cls():
        assert s.handle is s.__dict__["_my_handle"]
        assert float(s * s) == 4.0


def test_a_variable_without_a_handle_raises_tensorflows_error_inside_a_tape():
    v = rvo.ResourceVariable.__new__(rvo.ResourceVariable)  # no handle set yet
    with pytest.raises(AttributeError) as outside:
        v.handle
    with AssignAwareTape():
        with pytest.raises(AttributeError) as inside:
            v.handle
    assert str(inside.value) == str(outside.value)


_REGISTERED_CONVERSION = """
import tensorflow as tf
from tensorflow.python.framework import tensor_conversion_registry
from tensorflow.python.ops import resource_variable_ops as rvo
from assigntape import AssignAwareTape

v = tf.Variable([[1.0], [2.0]])
with AssignAwareTape():  # the short paths served, and taken off, before the registration
    tf.ones([1, 2]) @ v

def doubled(var, dtype=None, name=None, as_ref=False):
    return var.value() * 2.0

tensor_conversion_registry.register_tensor_conversion_function(rvo.ResourceVariable, doubled, priority=1)
got = []
for tape_cls in (AssignAwareTape, tf.GradientTape, AssignAwareTape):  # before and after TensorFlow's own lookup
    with tape_cls():
        got.append((tf.ones([1, 2]) @ v).numpy().tolist())  # matmul converts v
print(repr(got))
"""


def test_a_conversion_someone_registered_for_variables_is_used_inside_a_tape():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _REGISTERED_CONVERSION], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # Through ``doubled``: 2 * (1 + 2).
    assert eval(out.stdout.strip().splitlines()[-1]) == [[[6.0]]] * 3


_WRAPPED_CONVERSION_FIRST = """
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops as rvo

calls = []
original = rvo.BaseResourceVariable._dense_var_to_tensor

def scaled(self, dtype=None, name=None, as_ref=False):  # someone's wrapper, before assigntape
    calls.append(1)
    return original(self, dtype=dtype, name=name, as_ref=as_ref) * 10.0

rvo.BaseResourceVariable._dense_var_to_tensor = scaled

from assigntape import AssignAwareTape
v = tf.Variable([[1.0], [2.0]])
got = []
for tape_cls in (tf.GradientTape, AssignAwareTape):
    with tape_cls():
        got.append((tf.ones([1, 2]) @ v).numpy().tolist())  # matmul converts v
print(repr((got, len(calls))))
"""


def test_a_conversion_someone_wrapped_before_import_is_used_inside_a_tape():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _WRAPPED_CONVERSION_FIRST], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # Through ``scaled``, under both tapes: 10 * (1 + 2).
    assert eval(out.stdout.strip().splitlines()[-1]) == ([[[30.0]], [[30.0]]], 2)
