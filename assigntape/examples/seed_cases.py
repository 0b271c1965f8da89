"""The three reference cases, side by side: plain tape, AssignAwareTape, the
hand-written chain rule, and the assignment-free rewrite.

Run with ``python -m assigntape.examples.seed_cases`` (or ``python -m assigntape``).
Each case is a program that writes variables. The *chain rule* is today's
workaround: d loss / d c for each written variable c, then a second gradient of
the written value with those as output gradients, summed. The *rewrite* is the
same program with every write rebinding a plain tensor, differentiated by
``tf.GradientTape``: the answer a correct tape must give.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Type

import tensorflow as tf

from assigntape import AssignAwareTape

__all__ = ["Case", "CASES", "main"]


class Case(NamedTuple):
    name: str
    # program(tape_class) -> (loss, gradient) with tf.Variables and writes.
    program: Callable[[Type[tf.GradientTape]], Any]
    # rewrite() -> (loss, gradient) with tensors rebound instead of writes.
    rewrite: Callable[[], Any]
    # chain_rule() -> (loss, gradient) by the two-stage hand-written workaround.
    chain_rule: Callable[[], Any]


def _sum_case(tape_class: Type[tf.GradientTape]) -> Any:
    a, b, c = tf.Variable(1.0), tf.Variable(2.0), tf.Variable(3.0)
    with tape_class() as tape:
        c.assign(a + b)
        loss = tf.reduce_mean(c**2)
    return loss, tape.gradient(loss, b)


def _sum_rewrite() -> Any:
    a, b = tf.constant(1.0), tf.constant(2.0)
    with tf.GradientTape() as tape:
        tape.watch(b)
        c = a + b
        loss = tf.reduce_mean(c**2)
    return loss, tape.gradient(loss, b)


def _chain_rule(tape: tf.GradientTape, loss: Any, writes: Sequence[Any], source: Any) -> Any:
    """Sum over writes (variable, value) of d value / d source, weighted by
    d loss / d variable: one extra backward pass per write."""
    total = None
    for var, value in writes:
        g_var = tape.gradient(loss, var)
        part = tape.gradient(value, source, output_gradients=g_var)
        total = part if total is None else total + part
    return total


def _sum_chain_rule() -> Any:
    a, b, c = tf.Variable(1.0), tf.Variable(2.0), tf.Variable(3.0)
    with tf.GradientTape(persistent=True) as tape:
        value = a + b
        c.assign(value)
        loss = tf.reduce_mean(c**2)
    return loss, _chain_rule(tape, loss, [(c, value)], b)


def _mix(x: Any, a: Any, b: Any) -> Any:
    return (1 - x) * a + x * b


def _lists_case(
    a0: Sequence[Any], b0: Sequence[Any], x0: float, loss_fn: Callable[[List[Any]], Any]
) -> Tuple[Callable[[Type[tf.GradientTape]], Any], Callable[[], Any], Callable[[], Any]]:
    def program(tape_class: Type[tf.GradientTape]) -> Any:
        a = [tf.Variable(v, dtype=tf.float32) for v in a0]
        b = [tf.Variable(v, dtype=tf.float32) for v in b0]
        c = [tf.Variable(tf.zeros_like(v)) for v in a]
        x = tf.Variable(x0)
        with tape_class() as tape:
            for ci, ai, bi in zip(c, a, b):
                ci.assign(_mix(x, ai, bi))
            loss = loss_fn(c)
        return loss, tape.gradient(loss, x)

    def rewrite() -> Any:
        a = [tf.constant(v, dtype=tf.float32) for v in a0]
        b = [tf.constant(v, dtype=tf.float32) for v in b0]
        x = tf.constant(x0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            c = [_mix(x, ai, bi) for ai, bi in zip(a, b)]
            loss = loss_fn(c)
        return loss, tape.gradient(loss, x)

    def chain_rule() -> Any:
        a = [tf.Variable(v, dtype=tf.float32) for v in a0]
        b = [tf.Variable(v, dtype=tf.float32) for v in b0]
        c = [tf.Variable(tf.zeros_like(v)) for v in a]
        x = tf.Variable(x0)
        with tf.GradientTape(persistent=True) as tape:
            writes = []
            for ci, ai, bi in zip(c, a, b):
                value = _mix(x, ai, bi)
                ci.assign(value)
                writes.append((ci, value))
            loss = loss_fn(c)
        return loss, _chain_rule(tape, loss, writes, x)

    return program, rewrite, chain_rule


_scalars = _lists_case([1.0, 4.0], [2.0, 9.0], 0.01, tf.norm)
_nested = _lists_case([[1, 2], [5], 7], [[3, 4], [6], 8], 0.5, lambda c: tf.norm([tf.norm(ci) for ci in c]))

CASES = [
    Case("c.assign(a + b); loss = c**2  ->  d/db", _sum_case, _sum_rewrite, _sum_chain_rule),
    Case("c[i].assign((1-x)*a[i] + x*b[i]), scalar a,b,c  ->  d/dx", *_scalars),
    Case("c[i].assign((1-x)*a[i] + x*b[i]), nested a,b,c  ->  d/dx", *_nested),
]


def _fmt(x: Optional[tf.Tensor]) -> str:
    return "None" if x is None else f"{float(x):.7f}"


def main() -> None:
    header = f"{'case':<58} {'tf.GradientTape':>16} {'AssignAwareTape':>16} {'chain rule':>12} {'rewrite':>12}"
    print(header)
    print("-" * len(header))
    for case in CASES:
        _, plain = case.program(tf.GradientTape)
        _, aware = case.program(AssignAwareTape)
        _, by_hand = case.chain_rule()
        _, oracle = case.rewrite()
        print(f"{case.name:<58} {_fmt(plain):>16} {_fmt(aware):>16} {_fmt(by_hand):>12} {_fmt(oracle):>12}")


if __name__ == "__main__":
    main()
