"""One recorder protocol: every kind of recorder answers "my current version of
v" the same way (``_resuming.latest_version``).

A variable target asked of a tape entered again, before the variable's first
read in it, means the version the tape goes on from (docs/semantics.md, 6b and
6c), or, for a variable written while the tape was closed, a version it did not
see made: no gradient path (rule 7). The expected values are the rewrite's:
the same program on tensors, by hand, in the comments.
"""

from __future__ import annotations

import pytest
import tensorflow as tf
from oracle import modes, run

from assigntape import AssignAwareTape


def _ours(v, x, written_meanwhile):
    tape = AssignAwareTape(persistent=True)
    with tape:
        v.assign(3.0 * x)
    if written_meanwhile:
        v.assign(5.0)
    with tape:  # entered again; v not read in it
        return tape.gradient(v, x)


def _plain(v, x, written_meanwhile):
    tape = tf.GradientTape(persistent=True)
    with tape:
        with AssignAwareTape():
            v.assign(3.0 * x)
    if written_meanwhile:
        v.assign(5.0)
    with tape:  # entered again; v not read in it
        return tape.gradient(v, x)


def _both(v, x, written_meanwhile):
    """Both kinds entered again together (the plain one outside)."""
    plain = tf.GradientTape(persistent=True)
    ours = AssignAwareTape(persistent=True)
    with plain:
        with ours:
            v.assign(3.0 * x)
    if written_meanwhile:
        v.assign(5.0)
    with plain:
        with ours:
            return ours.gradient(v, x), plain.gradient(v, x)


KINDS = {"ours": _ours, "plain": _plain, "both": _both}


@modes
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("written_meanwhile", [False, True], ids=["goes_on", "written_meanwhile"])
def test_a_variable_target_before_its_first_read_in_a_tape_entered_again(mode, kind, written_meanwhile):
    x, v = tf.Variable(2.0), tf.Variable(1.0)

    def body():
        grads = KINDS[kind](v, x, written_meanwhile)
        grads = grads if isinstance(grads, tuple) else (grads,)
        return tuple(tf.constant(-1.0) if g is None else g for g in grads)

    # The rewrite: v1 = 3 x, d v1 / dx = 3; written meanwhile, v2 = 5 (a
    # constant): no gradient path (None, -1 here).
    expected = -1.0 if written_meanwhile else 3.0
    assert [float(g) for g in run(mode, body)] == [expected] * (2 if kind == "both" else 1)
