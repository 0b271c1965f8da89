"""A recorder entered again after a write made while it was closed (rule 7:
for it that write has no gradient path), whose first touch of the variable
after the re-entry is inside a ``tf.cond`` branch, a ``tf.switch_case``
branch or a graph loop body (``tf.while_loop``, ``map_fn``). The version it
did not see made is made in the graph of the tape's scope, as a read at its
entry would have made it, so every branch, the body and the code after them
can use it (it was made in the branch graph: ``... accessed from false_fn``,
``InaccessibleTensorError``). Every kind of recorder: ours, our
ForwardAccumulator, a plain tape beside ours, and ours that never knew the
variable. Expected values: the assignment-free rewrite under a plain tape,
the closed write a ``stop_gradient``."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import pytest
import tensorflow as tf

import assigntape
from assigntape import AssignAwareTape

X = 2.0


def _write_in_cond(x: Any, v: Any) -> Any:
    tf.cond(x > 0.0, lambda: v.assign_add(x).read_value(), lambda: v.read_value())
    return v * x


def _write_in_cond_t(x: Any, v: Any) -> Any:
    v = tf.cond(x > 0.0, lambda: v + x, lambda: v)
    return v * x


def _read_in_both_branches(x: Any, v: Any) -> Any:
    return tf.cond(x > 0.0, lambda: v * x, lambda: v * 2.0)


def _read_in_branch_then_after(x: Any, v: Any) -> Any:
    a = tf.cond(x > 0.0, lambda: v * x, lambda: x)
    return a + v * x


def _switch_case_read(x: Any, v: Any) -> Any:
    # (A write in a switch_case branch is refused in a function: documented.)
    i = tf.cast(x > 0.0, tf.int32)
    return tf.switch_case(i, [lambda: v * 2.0, lambda: v * x]) + v


def _write_in_loop(x: Any, v: Any) -> Any:
    for _ in tf.range(2):
        v.assign_add(x)
    return v * x


def _write_in_loop_t(x: Any, v: Any) -> Any:
    for _ in range(2):
        v = v + x
    return v * x


def _map_fn(x: Any, v: Any) -> Any:
    return tf.reduce_sum(tf.map_fn(lambda e: v * e * x, tf.constant([1.0, 2.0])))


# (name, the program on the variable, the same on tensors, refused compiled
# in forward mode: a graph loop that reads or writes a variable, a switch_case
# (documented limits, docs/known-limits.md))
CASES: List[Tuple[str, Callable[..., Any], Callable[..., Any], bool]] = [
    ("write_in_cond", _write_in_cond, _write_in_cond_t, False),
    ("read_in_both_branches", _read_in_both_branches, _read_in_both_branches, False),
    ("read_in_branch_then_after", _read_in_branch_then_after, _read_in_branch_then_after, False),
    ("switch_case_read", _switch_case_read, _switch_case_read, True),
    ("write_in_loop", _write_in_loop, _write_in_loop_t, True),
    ("map_fn", _map_fn, _map_fn, True),
]
KINDS = ["ours", "forward", "plain", "ours_unknown"]


def _oracle(program: Callable[..., Any]) -> float:
    x = tf.constant(X)
    with tf.GradientTape() as t:
        t.watch(x)
        _ = tf.constant(1.0)  # v's start value; v.assign(3x) is replaced below
        c = tf.stop_gradient(5.0 * x)  # the write made while the recorder was closed
        y = program(x, c)
    return float(t.gradient(y, x))


def _run(kind: str, program: Callable[..., Any], compiled: bool) -> float:
    x, v = tf.Variable(X), tf.Variable(1.0)

    def f() -> Any:
        r: Any
        if kind == "forward":
            r = assigntape.ForwardAccumulator(x, tf.constant(1.0))
            with r:
                v.assign(3.0 * x)
        elif kind == "plain":
            r = tf.GradientTape(persistent=True)
            with r:
                with AssignAwareTape():
                    v.assign(3.0 * x)
        else:
            r = AssignAwareTape(persistent=True)
            with r:
                if kind == "ours":
                    v.assign(3.0 * x)
                else:
                    _ = x * 1.0  # never knew v
        v.assign(5.0 * x)  # while r is closed
        if kind == "plain":
            with r:
                with AssignAwareTape():
                    y = program(x, v)
        else:
            with r:
                y = program(x, v)
        return r.jvp(y) if kind == "forward" else r.gradient(y, x)

    return float(tf.function(f)() if compiled else f())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,program,rewrite,no_forward", CASES, ids=[c[0] for c in CASES])
def test_first_touch_after_reentry_in_a_branch_or_body(
    name: str, program: Any, rewrite: Any, no_forward: bool, kind: str, compiled: bool
) -> None:
    if kind == "forward" and no_forward and compiled:
        # Forward mode, compiled, through this op: a documented limit, refused.
        with pytest.raises(assigntape.ControlFlowWriteError):
            _run(kind, program, compiled)
        return
    assert _run(kind, program, compiled) == pytest.approx(_oracle(rewrite))
