"""Every TensorFlow op that can write a resource variable is differentiated or
refused, never silently missed.

The registry tests walk every op TensorFlow has registered and fail on one with a
DT_RESOURCE input that the library's tables do not classify: a write op added by
a future TensorFlow fails here instead of writing a tracked variable behind the
tape's back. The behaviour tests write tracked variables through refused ops
(eager, in a compiled function with the tape inside, and from an eager tape
calling one) and check the refusal names the variable and the op and leaves the
value as it was.
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import op_def_pb2, types_pb2
from tensorflow.python.client import pywrap_tf_session
from tensorflow.python.ops import gen_stateful_random_ops, gen_tpu_ops

from assigntape import AssignAwareTape, UntrackedWriteError, _functions, _patches, _rules, _writes


def _registry() -> Dict[str, op_def_pb2.OpDef]:
    """Every op registered in this TensorFlow, by name."""
    buffer = pywrap_tf_session.TF_GetAllOpList()
    op_list = op_def_pb2.OpList()
    op_list.ParseFromString(pywrap_tf_session.TF_GetBuffer(buffer))
    return {op.name: op for op in op_list.op}


REGISTRY = _registry()


def _takes_resource(op: op_def_pb2.OpDef) -> bool:
    return any(arg.type == types_pb2.DT_RESOURCE for arg in op.input_arg)


RESOURCE_OPS = sorted(name for name, op in REGISTRY.items() if _takes_resource(op))
NOT_WRITES = frozenset().union(*_rules.NOT_VARIABLE_WRITES.values())
# Every write the library refuses, by prefix or by name, that this TensorFlow has.
REFUSED = sorted(name for name in REGISTRY if _rules.refused(name))


def _unclassified(names: Iterable[str]) -> List[str]:
    return [name for name in names if name not in _rules.RULES and not _rules.refused(name) and name not in NOT_WRITES]


# -- the registry ----------------------------------------------------------------


def test_the_registry_is_enumerated():
    # Guards the tests below against passing on an empty or partial registry.
    assert len(REGISTRY) > 1000
    assert {"AssignVariableOp", "ReadVariableOp", "ResourceApplyAdam", "AssignVariableXlaConcatND"} <= set(RESOURCE_OPS)
    assert len(RESOURCE_OPS) > 150


def test_every_op_with_a_resource_input_is_differentiated_refused_or_not_a_write():
    missing = _unclassified(RESOURCE_OPS)
    assert not missing, (
        f"TensorFlow ops with a resource input that assigntape does not classify: {missing}. "
        "If an op can write a variable's value, give it a rule in assigntape/_rules.py RULES "
        "or add it to REFUSED_WRITES there (and check that its Python wrapper is patched); "
        "otherwise add it to NOT_VARIABLE_WRITES under the group that says why it writes no variable."
    )


def test_an_unknown_resource_op_is_reported():
    # The check above can fail: a write op TensorFlow might add is named.
    assert _unclassified(["AssignVariableOp", "ReadVariableOp", "AssignVariableXlaFutureND"]) == [
        "AssignVariableXlaFutureND"
    ]


def test_every_listed_op_exists_in_tensorflow():
    listed = {"RULES": set(_rules.RULES), "REFUSED_WRITES": set(_rules.REFUSED_WRITES)}
    for reason, names in _rules.NOT_VARIABLE_WRITES.items():
        listed[f"NOT_VARIABLE_WRITES[{reason!r}]"] = set(names)
    # Allowed to be missing: the ops only some supported TensorFlow versions register.
    known = set(REGISTRY) | _rules.VERSION_SPECIFIC
    gone = {table: sorted(names - known) for table, names in listed.items() if names - known}
    assert not gone, f"listed ops this TensorFlow does not register (remove them from assigntape/_rules.py): {gone}"
    for prefix in _rules.UNDIFFERENTIABLE_PREFIXES:
        assert any(name.startswith(prefix) for name in REGISTRY), f"no op starts with {prefix!r}"


def test_not_variable_writes_take_resources_and_no_op_is_listed_twice():
    # An op listed as not writing that no longer takes a resource is a stale entry.
    stale = sorted(name for name in NOT_WRITES if name in REGISTRY and not _takes_resource(REGISTRY[name]))
    assert all(name in REGISTRY for name in NOT_WRITES - _rules.VERSION_SPECIFIC)
    assert not stale, stale
    groups = list(_rules.NOT_VARIABLE_WRITES.values())
    assert sum(map(len, groups)) == len(NOT_WRITES), "an op is in two NOT_VARIABLE_WRITES groups"
    written = set(_rules.RULES) | set(REFUSED)
    assert not (written & NOT_WRITES), sorted(written & NOT_WRITES)
    assert not (set(_rules.RULES) & set(REFUSED)), sorted(set(_rules.RULES) & set(REFUSED))


def test_every_write_with_a_python_wrapper_is_patched():
    # Including fused kernels a future TensorFlow adds under the prefixes,
    # wherever their generated module is.
    patched = {(id(owner), name) for owner, name in _patches.patched_places()}
    for name in sorted(set(_rules.RULES) | set(REFUSED)):
        if name in vars(tf.raw_ops):
            assert (id(tf.raw_ops), name) in patched, f"tf.raw_ops.{name} is not patched"
            module = _patches._module_of(name)
            snake = _patches._snake(name, module)
            assert (id(module), snake) in patched, f"{module.__name__}.{snake} is not patched"
    # The refused ops in this TensorFlow that have wrappers, which the
    # behaviour tests below call through both of them.
    assert (id(gen_tpu_ops), "assign_variable_xla_concat_nd") in patched
    assert (id(gen_stateful_random_ops), "rng_skip") in patched


def test_the_graph_scan_finds_every_write_and_nothing_else():
    # Ops with no Python wrapper (XlaLaunch, TPU launches) can only be met in a
    # graph: the scan is what refuses them.
    for name in sorted(set(_rules.RULES) | set(REFUSED) | set(_rules.REFUSED_WRITES)):
        assert _functions._writes_anything(name), name
    for name in sorted(NOT_WRITES):
        assert not _functions._writes_anything(name), name


# -- refused at run time ---------------------------------------------------------


def _concat_write(v: tf.Variable, snake: bool = False) -> None:
    """``v = concat([5, 2], [3, 4])`` by AssignVariableXlaConcatND (XLA kernels only)."""
    pieces = [tf.constant([5.0, 2.0]), tf.constant([3.0, 4.0])]
    if snake:
        gen_tpu_ops.assign_variable_xla_concat_nd(v.handle, pieces, num_concats=[2])
    else:
        tf.raw_ops.AssignVariableXlaConcatND(resource=v.handle, inputs=pieces, num_concats=[2])


def _check_refusal(info: pytest.ExceptionInfo, var_name: str, op_name: str) -> None:
    message = str(info.value)
    assert var_name in message and op_name in message, message
    assert "untracked_writes='cut'" in message, message


def test_the_concat_write_writes_outside_a_tape():
    # The refusals below leave the value unchanged; this shows the op would change it.
    v = tf.Variable([1.0, 2.0, 3.0, 4.0])
    tf.function(lambda: _concat_write(v), jit_compile=True)()
    np.testing.assert_array_equal(v.numpy(), [5.0, 2.0, 3.0, 4.0])


@pytest.mark.parametrize("snake", [False, True], ids=["raw_op", "gen_tpu_ops"])
def test_concat_write_is_refused_eagerly(snake):
    v = tf.Variable([1.0, 2.0, 3.0, 4.0], name="concat_target")
    with AssignAwareTape() as tape:
        loss = tf.reduce_sum(v * v)
        versions = tape.versions(v)
        # Refused before the kernel runs (eagerly it has none on CPU and would
        # raise InvalidArgumentError instead).
        with pytest.raises(UntrackedWriteError) as info:
            _concat_write(v, snake)
        assert tape.versions(v) == versions
    _check_refusal(info, "concat_target", "AssignVariableXlaConcatND")
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(tape.gradient(loss, v), [2.0, 4.0, 6.0, 8.0])


def test_concat_write_is_refused_in_a_compiled_function_with_the_tape_inside():
    v = tf.Variable([1.0, 2.0, 3.0, 4.0], name="concat_in_xla")

    @tf.function(jit_compile=True)
    def step():
        with AssignAwareTape() as tape:
            loss = tf.reduce_sum(v * v)
            _concat_write(v)
        return tape.gradient(loss, v)

    with pytest.raises(UntrackedWriteError) as info:
        step()
    _check_refusal(info, "concat_in_xla", "AssignVariableXlaConcatND")
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0, 3.0, 4.0])


def test_concat_write_in_a_function_called_from_an_eager_tape_is_refused():
    v, a = tf.Variable([1.0, 2.0, 3.0, 4.0], name="concat_in_called_fn"), tf.Variable(2.0)
    step = tf.function(lambda: _concat_write(v), jit_compile=True)
    step.get_concrete_function()  # traced before the tape, as a model's step would be
    with AssignAwareTape() as tape:
        v.assign(a * tf.constant([1.0, 2.0, 3.0, 4.0]))
        before = v.numpy()
        with pytest.raises(UntrackedWriteError) as info:
            step()
        np.testing.assert_array_equal(v.numpy(), before)  # refused before running
        loss = tf.reduce_sum(v)
    _check_refusal(info, "concat_in_called_fn", "AssignVariableXlaConcatND")
    assert float(tape.gradient(loss, a)) == 10.0


def test_concat_write_cut_by_option_in_a_compiled_function():
    v, a = tf.Variable([1.0, 2.0, 3.0, 4.0], name="concat_cut"), tf.Variable(2.0)

    @tf.function(jit_compile=True)
    def step():
        with AssignAwareTape(untracked_writes="cut") as tape:
            v.assign(a * v)
            _concat_write(v)
            loss = tf.reduce_sum(v * a)
        return tape.gradient(loss, a)

    with pytest.warns(UserWarning, match="concat_cut"):
        da = step()
    np.testing.assert_array_equal(v.numpy(), [5.0, 2.0, 3.0, 4.0])
    assert float(da) == 14.0  # only the read after the cut write


def test_an_rng_op_given_a_tracked_float_variable_is_refused():
    # A second module's wrappers (gen_stateful_random_ops). The kernel would
    # reject the float state anyway; what counts is that the tape refuses it
    # first, naming the variable and the op.
    v = tf.Variable([1.0, 2.0, 3.0], name="not_rng_state")
    with AssignAwareTape():
        _ = v * 1.0
        with pytest.raises(UntrackedWriteError) as info:
            one = tf.constant(1, tf.int64)
            tf.raw_ops.RngSkip(resource=v.handle, algorithm=one, delta=one)
    _check_refusal(info, "not_rng_state", "RngSkip")
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0, 3.0])


def test_a_resource_in_a_list_argument_is_found():
    # Ops that write N variables take them as one list argument.
    v = tf.Variable([1.0, 2.0], name="listed_resource")
    calls = []
    wrapper = _writes.untracked_write("FakeWriteN", ["resources", "name"])
    with AssignAwareTape():
        _ = v * 1.0
        with pytest.raises(UntrackedWriteError) as info:
            wrapper(lambda *a, **k: calls.append(a), None, ([tf.constant(1.0), v.handle],), {})
    _check_refusal(info, "listed_resource", "FakeWriteN")
    assert calls == []


# -- integer state writes stay plain TensorFlow -----------------------------------


def _rng_and_counter(gen: tf.random.Generator, counter: tf.Variable) -> tf.Tensor:
    sample = gen.uniform([3])
    tf.raw_ops.ResourceCountUpTo(resource=counter.handle, limit=10, T=tf.int64)
    return sample


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_integer_state_writes_in_a_tape_are_plain_tensorflow(compiled):
    # RNG and counter ops are refused writes, but their variables are integers,
    # which carry no gradient: the same samples and counts as without a tape.
    expected = _rng_and_counter(tf.random.Generator.from_seed(7), tf.Variable(0, dtype=tf.int64))
    gen, counter, w = tf.random.Generator.from_seed(7), tf.Variable(0, dtype=tf.int64), tf.Variable(3.0)

    def body():
        with AssignAwareTape() as tape:
            _ = gen.state + counter  # both tracked as read
            sample = _rng_and_counter(gen, counter)
            loss = tf.reduce_sum(sample) * w
        return sample, tape.gradient(loss, w)

    sample, dw = (tf.function(body) if compiled else body)()
    np.testing.assert_array_equal(sample, expected)
    np.testing.assert_allclose(dw, tf.reduce_sum(expected))
    assert int(counter.numpy()) == 1
