"""The reference values from DESIGN.md, eager and compiled, and the demo's table."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from oracle import modes, run

from assigntape import AssignAwareTape
from assigntape.examples import seed_cases

# Exact values from the hand-written chain rule (DESIGN.md).
SUM_CASE_DB = 6.0
SCALARS_DX = 5.0933886
NESTED_LOSS, NESTED_DX = 9.974969, 2.3057709


@modes
def test_sum_case(mode):
    a, b, c = tf.Variable(1.0), tf.Variable(2.0), tf.Variable(3.0)

    def body():
        with AssignAwareTape() as tape:
            c.assign(a + b)
            loss = tf.reduce_mean(c**2)
        return tape.gradient(loss, [a, b])

    da, db = run(mode, body)
    assert float(db) == SUM_CASE_DB
    assert float(da) == SUM_CASE_DB


@modes
def test_lists_of_scalars(mode):
    a = [tf.Variable(1.0), tf.Variable(4.0)]
    b = [tf.Variable(2.0), tf.Variable(9.0)]
    c = [tf.Variable(3.0), tf.Variable(0.0)]
    x = tf.Variable(0.01)

    def body():
        with AssignAwareTape() as tape:
            for ci, ai, bi in zip(c, a, b):
                ci.assign((1 - x) * ai + x * bi)
            loss = tf.norm(c)
        return tape.gradient(loss, x)

    np.testing.assert_allclose(float(run(mode, body)), SCALARS_DX, rtol=1e-6)


@modes
def test_nested_lists(mode):
    def var(v):
        return tf.Variable(v, dtype=tf.float32)

    a = [var([1, 2]), var([5]), var(7)]
    b = [var([3, 4]), var([6]), var(8)]
    c = [var([-1, 11]), var([0.5]), var(3)]  # any values: all are overwritten
    x = tf.Variable(0.5)

    def body():
        with AssignAwareTape() as tape:
            for ci, ai, bi in zip(c, a, b):
                ci.assign((1 - x) * ai + x * bi)
            loss = tf.norm([tf.norm(ci) for ci in c])
        return loss, tape.gradient(loss, x)

    loss, dx = run(mode, body)
    np.testing.assert_allclose(float(loss), NESTED_LOSS, rtol=1e-6)
    np.testing.assert_allclose(float(dx), NESTED_DX, rtol=1e-6)


def test_plain_tape_really_loses_the_gradient():
    # The bug this library exists for: if this ever starts passing through,
    # the comparison in the demo stops meaning anything.
    for case in seed_cases.CASES:
        _, grad = case.program(tf.GradientTape)
        assert grad is None, case.name


def test_demo_cases_match_the_reference_values():
    expected = [SUM_CASE_DB, SCALARS_DX, NESTED_DX]
    for case, value in zip(seed_cases.CASES, expected):
        _, aware = case.program(AssignAwareTape)
        _, rewrite = case.rewrite()
        _, by_hand = case.chain_rule()
        np.testing.assert_allclose(float(aware), value, rtol=1e-6)
        np.testing.assert_allclose(float(rewrite), value, rtol=1e-6)
        np.testing.assert_allclose(float(by_hand), value, rtol=1e-6)


def test_demo_prints_the_table(capsys):
    seed_cases.main()
    out = capsys.readouterr().out
    assert out.count("None") == 3  # the plain tape column
    assert "6.0000000" in out and "5.0933886" in out and "2.3057709" in out
