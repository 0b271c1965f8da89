"""One recorder protocol: every kind of recorder answers "my current version of
v" the same way (``_resuming.latest_version``).

A variable target asked of a tape entered again, before the variable's first
read in it, means the version the tape goes on from (docs/semantics.md, 6b and
6c), or, for a variable written while the tape was closed, a version it did not
see made: no gradient path (rule 7). The expected values are the rewrite's:
the same program on tensors, by hand, in the comments.
"""

from __future__ import annotations

import contextlib

import pytest
import tensorflow as tf
from oracle import modes, run

from assigntape import AssignAwareTape


def _entered_again(kinds, v, x, written_meanwhile):
    """Tapes of ``kinds`` (outermost first; an AssignAwareTape inside them
    writes) enter, v is written, they exit, v may be written with none open,
    and they are entered again: a variable target before v's first read."""
    tapes = [make(persistent=True) for make in kinds]
    with contextlib.ExitStack() as stack:
        for tape in tapes:
            stack.enter_context(tape)
        with AssignAwareTape():
            v.assign(3.0 * x)
    if written_meanwhile:
        v.assign(5.0)
    with contextlib.ExitStack() as stack:
        for tape in tapes:
            stack.enter_context(tape)  # entered again; v not read in it
        return tuple(tape.gradient(v, x) for tape in tapes)


KINDS = {
    "ours": [AssignAwareTape],
    "plain": [tf.GradientTape],
    "both": [tf.GradientTape, AssignAwareTape],  # the plain one outside
}


@modes
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("written_meanwhile", [False, True], ids=["goes_on", "written_meanwhile"])
def test_a_variable_target_before_its_first_read_in_a_tape_entered_again(mode, kind, written_meanwhile):
    x, v = tf.Variable(2.0), tf.Variable(1.0)

    def body():
        grads = _entered_again(KINDS[kind], v, x, written_meanwhile)
        return tuple(tf.constant(-1.0) if g is None else g for g in grads)

    # The rewrite: v1 = 3 x, d v1 / dx = 3; written meanwhile, v2 = 5 (a
    # constant): no gradient path (None, -1 here).
    expected = -1.0 if written_meanwhile else 3.0
    assert [float(g) for g in run(mode, body)] == [expected] * (2 if kind == "both" else 1)
