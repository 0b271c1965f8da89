"""Forward mode over random programs: the jvp of each generated program's loss
(tangents on every variable's start value and every parameter) under a
``ForwardAccumulator``, against the rewrite's jvp under TensorFlow's own
accumulator (tensors rebound by every write).

Three ways to carry tangents across the writes: ``tf.autodiff.ForwardAccumulator``
around an ``AssignAwareTape``, the same inside a ``tf.function``, and
``assigntape.ForwardAccumulator`` alone (no reverse tape). Real dtypes only:
TensorFlow's accumulator ignores complex primals. No write is under
``stop_recording``: a tape's ``stop_recording`` does not pause accumulators,
so it has no forward-mode meaning to compare.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import assigntape
from assigntape import AssignAwareTape
from assigntape.testing._interpreter import TensorStore, VariableStore, _tf_variable, interpret, state
from assigntape.testing._program import tolerances
from assigntape.testing._vocabulary import REAL
from assigntape.testing.strategies import programs

_SCALE = 10 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 1


def _tangents(program, vars0, params0):
    rng = np.random.default_rng(program.seed + 7)
    var_t = [tf.constant(rng.normal(size=np.shape(v)), d) for v, d in zip(vars0, program.tf_dtypes)]
    param_t = [tf.constant(rng.normal(), tf.float64) for _ in params0]
    return var_t, param_t


def _rewrite_jvp(program, vars0, params0, var_t, param_t):
    tensors = [tf.constant(v, d) for v, d in zip(vars0, program.tf_dtypes)]
    params = [tf.constant(p, tf.float64) for p in params0]
    with tf.autodiff.ForwardAccumulator(tensors + params, var_t + param_t) as acc:
        loss = interpret(program, TensorStore(tensors), params)
    return loss, acc.jvp(loss)


def _tape_jvp(program, how):
    vars0, params0, variables, params = state(program)
    var_t, param_t = _tangents(program, vars0, params0)

    def body():
        if how == "assigntape":
            with assigntape.ForwardAccumulator(variables + params, var_t + param_t) as acc:
                loss = interpret(program, VariableStore(variables, []), params)
        else:
            # TensorFlow's accumulator takes the tf.Variable a Keras 3 one wraps.
            primals = [_tf_variable(v) for v in variables] + params
            with tf.autodiff.ForwardAccumulator(primals, var_t + param_t) as acc:
                with AssignAwareTape() as tape:
                    loss = interpret(program, VariableStore(variables, [tape]), params)
        return loss, acc.jvp(loss)

    got = tf.function(body)() if how == "compiled" else body()
    return got, _rewrite_jvp(program, vars0, params0, var_t, param_t)


def _check(program, how):
    (loss, jvp), (expected_loss, expected_jvp) = _tape_jvp(program, how)
    rtol, atol = tolerances(program)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=rtol, atol=atol)
    if expected_jvp is None:
        assert jvp is None or float(jvp) == 0.0
    else:
        assert jvp is not None, "the tape lost the tangent"
        np.testing.assert_allclose(float(jvp), float(expected_jvp), rtol=rtol, atol=atol)


@settings(max_examples=40 * _SCALE)
@given(programs(dtypes=REAL, stopped_writes=False), st.sampled_from(["around_a_tape", "assigntape"]))
def test_random_programs_forward_mode_eager(program, how):
    _check(program, how)


def _reads_through_a_function(node) -> bool:
    if isinstance(node, tuple):
        if len(node) == 3 and node[0] == "var" and isinstance(node[2], int) and node[2] >= 4:
            return True
        return any(_reads_through_a_function(n) for n in node)
    return False


@settings(max_examples=20 * _SCALE)
@given(programs(dtypes=REAL, stopped_writes=False, compiled=True))
def test_random_programs_forward_mode_compiled(program):
    # Inside a tf.function, TensorFlow's accumulator gives no tangent to a
    # variable read in a nested tf.function, with or without a tape (see
    # test_a_nested_function_read_has_no_tangent_compiled_as_in_tensorflow).
    assume(not _reads_through_a_function(program.statements))
    _check(program, "compiled")


def test_a_nested_function_read_has_no_tangent_compiled_as_in_tensorflow():
    v = tf.Variable(2.0)
    inner = tf.function(lambda: tf.convert_to_tensor(v) * 1.0)

    def body(aware):
        with tf.autodiff.ForwardAccumulator(v, tf.constant(1.0)) as acc:
            if aware:
                with AssignAwareTape():
                    y = inner() * 3.0
            else:
                y = inner() * 3.0
        return acc.jvp(y)

    assert float(body(True)) == float(body(False)) == 3.0  # eagerly, both right
    assert tf.function(body)(False) is None  # TensorFlow's own limit...
    assert tf.function(body)(True) is None  # ...which the tape shares
