"""A refusal of ours raised inside a TensorFlow builder leaves TensorFlow's
process-wide state as it was.

``tf.map_fn``, ``tf.scan``, ``tf.foldl`` and ``tf.foldr`` set a caching device
on the variable scope while they build in a graph and put it back only when
``fn`` returns. A tf.function's graph shares that scope object with the eager
program, so a refusal raised in ``fn`` once left it set for the process: every
later ``tf.distribute`` strategy scope raised NotImplementedError ("Caching
devices is not yet supported when eager execution is enabled"), in tests far
from the one that raised. Crossed with the builders, two refusals (forward mode
through a loop body that reads a variable, in a tf.function; a write in a TF1
graph) and the state of the tape and the variable after it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import pytest
import tensorflow as tf
from tensorflow.python.ops import variable_scope

import assigntape
from assigntape import AssignAwareTape


def _elems() -> Any:
    return tf.constant([1.0, 2.0])  # (made where the builder runs)


# Each builder, called with fn(element) -> a float tensor.
BUILDERS: Dict[str, Callable[[Callable[[Any], Any]], Any]] = {
    "map_fn": lambda fn: tf.map_fn(fn, _elems()),
    "scan": lambda fn: tf.scan(lambda acc, e: acc + fn(e), _elems(), initializer=0.0),
    "foldl": lambda fn: tf.foldl(lambda acc, e: acc + fn(e), _elems(), initializer=0.0),
    "foldr": lambda fn: tf.foldr(lambda acc, e: acc + fn(e), _elems(), initializer=0.0),
    # tf.compat.v1's API holds the functions themselves, not their modules'.
    "v1.map_fn": lambda fn: tf.compat.v1.map_fn(fn, _elems()),
    "v1.scan": lambda fn: tf.compat.v1.scan(lambda acc, e: acc + fn(e), _elems(), initializer=0.0),
    "v1.foldl": lambda fn: tf.compat.v1.foldl(lambda acc, e: acc + fn(e), _elems(), initializer=0.0),
    "v1.foldr": lambda fn: tf.compat.v1.foldr(lambda acc, e: acc + fn(e), _elems(), initializer=0.0),
}


def _strategy_scope_works() -> bool:
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        made = tf.Variable(1.0)
    return float(made.numpy()) == 1.0


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_forward_mode_refusal_in_a_compiled_builder_leaves_the_variable_scope(builder: str) -> None:
    x, v = tf.Variable(2.0), tf.Variable(3.0)

    @tf.function
    def f() -> Any:
        with assigntape.ForwardAccumulator(v, tf.constant(1.0)) as acc:
            y = tf.reduce_sum(BUILDERS[builder](lambda e: v * e * x))
        return acc.jvp(y)

    with pytest.raises(assigntape.ControlFlowWriteError, match="graph loop"):
        f()
    assert variable_scope.get_variable_scope().caching_device is None
    assert _strategy_scope_works()
    # The variables are as they were, and a tape afterwards works.
    assert (float(x.numpy()), float(v.numpy())) == (2.0, 3.0)
    with AssignAwareTape() as tape:
        v.assign(x * 4.0)
        y = v * x
    assert float(tape.gradient(y, x)) == pytest.approx(16.0)


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_write_refusal_in_a_tf1_graph_builder_leaves_the_graphs_variable_scope(builder: str) -> None:
    graph = tf.Graph()
    with graph.as_default():
        v = tf.compat.v1.Variable(1.0, use_resource=True)
        with AssignAwareTape():
            with pytest.raises(assigntape.GraphWriteOrderError):
                BUILDERS[builder](lambda e: v.assign_add(e))
        assert variable_scope.get_variable_scope().caching_device is None
        # The graph's own variable scopes still work.
        with tf.compat.v1.variable_scope("after"):
            w = tf.compat.v1.get_variable("w", shape=(), initializer=tf.compat.v1.zeros_initializer())
        assert w.name == "after/w:0"
    assert _strategy_scope_works()


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_an_interrupt_in_a_compiled_builder_leaves_the_variable_scope(builder: str) -> None:
    # A KeyboardInterrupt may land in our code, most of what runs in fn while
    # a tape is open (here raised by fn itself, after a write of ours).
    v = tf.Variable(1.0)

    def fn(e: Any) -> Any:
        v.assign_add(e)
        raise KeyboardInterrupt

    @tf.function(autograph=False)
    def f() -> Any:
        with AssignAwareTape():
            return BUILDERS[builder](fn)

    with pytest.raises(KeyboardInterrupt):
        f()
    assert variable_scope.get_variable_scope().caching_device is None
    assert _strategy_scope_works()
    assert float(v.numpy()) == 1.0


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_a_users_error_in_a_builder_is_left_to_tensorflow(builder: str) -> None:
    # An error not ours passes through unchanged, as without a tape (the
    # caching device TensorFlow leaves then is its own; put back here so as
    # not to disturb later tests).
    def fn(e: Any) -> Any:
        raise KeyError("the user's")

    scope = variable_scope.get_variable_scope()

    @tf.function(autograph=False)
    def f() -> Any:
        with AssignAwareTape():
            return BUILDERS[builder](fn)

    try:
        with pytest.raises(KeyError, match="the user's"):
            f()
        assert scope.caching_device is not None  # as plain TensorFlow leaves it
    finally:
        scope._caching_device = None
