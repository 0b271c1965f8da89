"""A write op given a value of another dtype: TensorFlow's own error, inside a tape too.

Outside every tape, a raw or generated write op (``tf.raw_ops.AssignVariableOp``,
``gen_resource_variable_ops.assign_variable_op``, the scatter and slice
writes, the fused optimizer kernels) given a Python list, a NumPy array or a
tensor whose dtype is not the variable's raises ``InvalidArgumentError`` (a
Python number list becomes float32 or int32 first, a NumPy array keeps its
dtype). Inside an ``AssignAwareTape`` the same call must raise the same
exception type and leave the variable and the tape as they were; a value
TensorFlow accepts must be written as TensorFlow writes it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops as grv

from assigntape import AssignAwareTape, WriteDtypeError


def _vector(kind: str, n: int, dtype: Any) -> Any:
    """A value of ``n`` elements as the user might give it."""
    if kind == "python floats":
        return [0.5 * (i + 1) for i in range(n)]
    if kind == "python ints":
        return [i + 1 for i in range(n)]
    if kind == "numpy float64":
        return np.arange(1.0, n + 1.0)
    if kind == "int32 tensor":
        return tf.range(1, n + 1, dtype=tf.int32)
    if kind == "right dtype":
        return tf.range(1.0, n + 1.0, dtype=dtype)
    raise ValueError(kind)


# op -> (call(var, slot, value_of(n)), how many elements the value has)
def _ops() -> Dict[str, Tuple[Callable[..., Any], int]]:
    raw = tf.raw_ops
    return {
        "AssignVariableOp": (lambda v, s, x: raw.AssignVariableOp(resource=v.handle, value=x), 3),
        "assign_variable_op": (lambda v, s, x: grv.assign_variable_op(v.handle, x), 3),
        "AssignAddVariableOp": (lambda v, s, x: raw.AssignAddVariableOp(resource=v.handle, value=x), 3),
        "assign_sub_variable_op": (lambda v, s, x: grv.assign_sub_variable_op(v.handle, x), 3),
        "ResourceStridedSliceAssign": (
            lambda v, s, x: raw.ResourceStridedSliceAssign(ref=v.handle, begin=[0], end=[2], strides=[1], value=x),
            2,
        ),
        "ResourceScatterUpdate": (
            lambda v, s, x: raw.ResourceScatterUpdate(resource=v.handle, indices=[0, 2], updates=x),
            2,
        ),
        "ResourceScatterAdd": (lambda v, s, x: raw.ResourceScatterAdd(resource=v.handle, indices=[0, 2], updates=x), 2),
        "ResourceScatterMax": (lambda v, s, x: raw.ResourceScatterMax(resource=v.handle, indices=[0, 2], updates=x), 2),
        "ResourceScatterNdUpdate": (
            lambda v, s, x: raw.ResourceScatterNdUpdate(ref=v.handle, indices=[[0], [2]], updates=x),
            2,
        ),
        "ResourceScatterNdAdd": (
            lambda v, s, x: raw.ResourceScatterNdAdd(ref=v.handle, indices=[[0], [2]], updates=x),
            2,
        ),
        "ResourceApplyGradientDescent": (
            lambda v, s, x: raw.ResourceApplyGradientDescent(var=v.handle, alpha=0.1, delta=x),
            3,
        ),
        "ResourceApplyMomentum": (
            lambda v, s, x: raw.ResourceApplyMomentum(var=v.handle, accum=s.handle, lr=0.1, grad=x, momentum=0.9),
            3,
        ),
        "ResourceSparseApplyAdagrad": (
            lambda v, s, x: raw.ResourceSparseApplyAdagrad(
                var=v.handle, accum=s.handle, lr=0.1, grad=x, indices=[0, 2]
            ),
            2,
        ),
    }


OPS = _ops()
KINDS = ["python floats", "python ints", "numpy float64", "int32 tensor", "right dtype"]


def _outcome(op: str, kind: str, dtype: Any, tape: bool) -> Any:
    """The exception type the call raises, or the variable's value after it;
    inside a tape also the gradient of the variable's value afterwards (a
    failed write leaves it the start version's: ones)."""
    call, n = OPS[op]
    v = tf.Variable(tf.constant([1.0, 2.0, 3.0], dtype), name="written")
    slot = tf.Variable(tf.ones([3], dtype), name="slot")
    value = _vector(kind, n, dtype)
    if not tape:
        try:
            call(v, slot, value)
        except Exception as error:  # the type is the outcome
            return type(error), v.numpy().tolist()
        return None, v.numpy().tolist()
    with AssignAwareTape() as t:
        try:
            call(v, slot, value)
        except Exception as error:
            raised = type(error)
        else:
            raised = None
        y = tf.reduce_sum(v * v)
    grad = t.gradient(y, v)
    if raised is not None:
        # Nothing written: y = sum(v^2) of the start version, dy/dv = 2v.
        np.testing.assert_allclose(grad, 2.0 * np.array([1.0, 2.0, 3.0]))
    return raised, v.numpy().tolist()


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_write_op_inside_a_tape_takes_its_value_as_tensorflow_does(op, kind, dtype):
    if _aborts(op, kind, dtype):
        # TensorFlow's kernel aborts the process outside a tape
        # (test_these_writes_given_another_dtype_abort_outside_a_tape):
        # inside a tape, refused before anything is written.
        assert _outcome(op, kind, dtype, tape=True) == (WriteDtypeError, [1.0, 2.0, 3.0])
        return
    outside = _outcome(op, kind, dtype, tape=False)
    inside = _outcome(op, kind, dtype, tape=True)
    assert inside == outside


_FUSED = {"ResourceApplyGradientDescent", "ResourceApplyMomentum", "ResourceSparseApplyAdagrad"}


def _aborts(op: str, kind: str, dtype: Any) -> bool:
    """Where TensorFlow 2.21 aborts the process with no tape (probed one by
    one in subprocesses): a fused kernel on a float64 variable given values
    that are not tensors (the first input, lr = 0.1, makes them float32),
    and a ResourceScatterNd* write given a value of another dtype; a
    strided-slice assign given one while a tensor shares the variable's
    buffer, as a recording tape keeps one (a plain tape too; found by an
    adversarial review). (An int32 tensor given a fused kernel raises
    TypeError: lr = 0.1 is no int32.)"""
    if op in _FUSED:
        return dtype == tf.float64 and kind in {"python floats", "python ints", "numpy float64"}
    if op.startswith("ResourceScatterNd") or op == "ResourceStridedSliceAssign":
        converted = {"python floats": tf.float32, "python ints": tf.int32, "numpy float64": tf.float64}
        return kind == "int32 tensor" or converted.get(kind, dtype) != dtype
    return False


@pytest.mark.parametrize(
    "call",
    [
        "tf.raw_ops.ResourceApplyGradientDescent(var=v.handle, alpha=0.1, delta=[1.0, 1.0, 1.0])",
        "tf.raw_ops.ResourceScatterNdAdd(ref=v.handle, indices=[[0]], updates=[1.0])",
        "with tf.GradientTape():\n    _ = tf.reduce_sum(v)\n"
        "    tf.raw_ops.ResourceStridedSliceAssign(ref=v.handle, begin=[0], end=[1], strides=[1], value=[9.0])",
    ],
)
def test_these_writes_given_another_dtype_abort_outside_a_tape(call):
    """Why the refusals above: TensorFlow 2.21 itself, with no tape, kills the process."""
    import subprocess
    import sys

    code = f"""
import tensorflow as tf
v = tf.Variable([1.0, 2.0, 3.0], dtype=tf.float64)
{call}
print("returned")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "returned" not in done.stdout


def _compiled_outcome(op: str, kind: str, dtype: Any, tape: bool) -> Any:
    """``_outcome`` in a ``tf.function`` (the tape, if any, opened inside
    it): the exception type, or None, and the variable's value after the
    call. (TensorFlow raises when the function runs: a failed write fails
    the whole function, the tape's gradient included.)"""
    call, n = OPS[op]
    v = tf.Variable(tf.constant([1.0, 2.0, 3.0], dtype), name="written")
    slot = tf.Variable(tf.ones([3], dtype), name="slot")
    value = _vector(kind, n, dtype)

    @tf.function
    def program() -> Any:
        if not tape:
            call(v, slot, value)
            return tf.constant(0.0)
        with AssignAwareTape() as t:
            t.watch(v)
            call(v, slot, value)
            y = tf.reduce_sum(v * v)
        return t.gradient(y, v, unconnected_gradients="zero")

    try:
        program()
    except Exception as error:  # the type is the outcome
        return type(error), v.numpy().tolist()
    return None, v.numpy().tolist()


_COMPILED = ["AssignVariableOp", "AssignAddVariableOp", "ResourceScatterUpdate", "ResourceStridedSliceAssign"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", _COMPILED)
def test_a_write_op_in_a_tapes_function_takes_its_value_as_tensorflow_does(op, kind):
    dtype = tf.float64  # (Python floats convert to float32: another dtype)
    assert _compiled_outcome(op, kind, dtype, tape=True) == _compiled_outcome(op, kind, dtype, tape=False)


def test_a_strided_slice_assign_of_another_dtype_after_a_read_is_refused_not_a_crash():
    """Found by an adversarial review: after the tape read the variable, a
    strided-slice assign given a value of another dtype aborted the process
    (TensorFlow's kernel, while a tensor shares the variable's buffer; a
    plain tape aborts too). Run in a subprocess so that an abort fails this
    test instead of the test run."""
    import subprocess
    import sys

    code = """
import numpy as np
import tensorflow as tf
from assigntape import AssignAwareTape, WriteDtypeError
v = tf.Variable([1.0, 2.0, 3.0], name="v32")
with AssignAwareTape() as tape:
    a = tf.reduce_sum(v)
    try:
        tf.raw_ops.ResourceStridedSliceAssign(ref=v.handle, begin=[0], end=[1], strides=[1],
                                              value=tf.constant([9.0], tf.float64))
    except WriteDtypeError as e:
        assert "v32" in str(e), str(e)
    else:
        raise AssertionError("not refused")
    y = tf.reduce_sum(v * v)
# Nothing written: y = sum(v0^2), dy/dv = 2 v0.
np.testing.assert_allclose(tape.gradient(y, v), [2.0, 4.0, 6.0])
assert v.numpy().tolist() == [1.0, 2.0, 3.0]
print("refused")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "refused" in done.stdout, done.stderr[-2000:]
