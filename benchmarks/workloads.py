"""The benchmarked programs of issue #11, each with its baseline.

Every workload returns a dict of zero-argument step callables: ``"assigntape"``
(the candidate) and ``"baseline"`` (``tf.GradientTape`` on the same program, or
the same math written functionally, with no variable written inside the tape).
In compiled mode each step is a ``tf.function`` traced once before timing.

The network is the issue's: 8 tanh layers of 64x64 (weights and biases, 16
variables), batch 32.

``assigntape`` is imported inside the functions only: ``benchmarks.worker``
builds the same network in a process that must never import it.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import tensorflow as tf

Step = Callable[[], object]

WIDTH = 64
DEPTH = 8
BATCH = 32


def _tape():
    from assigntape import AssignAwareTape

    return AssignAwareTape


def maybe_compile(fn: Step, compiled: bool) -> Step:
    if not compiled:
        return fn
    f = tf.function(fn)
    f.get_concrete_function()  # trace now, without running a step
    return f


def net(width: int = WIDTH, depth: int = DEPTH, seed: int = 0) -> List[tf.Variable]:
    """``depth`` layers of ``width x width``: [W0, b0, W1, b1, ...]."""
    params = []
    for i in range(depth):
        params.append(tf.Variable(tf.random.stateless_normal([width, width], [seed, i]) / width**0.5))
        params.append(tf.Variable(tf.zeros([width])))
    return params


def forward(params, x):
    h = x
    for i in range(0, len(params), 2):
        h = tf.tanh(h @ params[i] + params[i + 1])
    return h


def data(width: int = WIDTH, batch: int = BATCH, seed: int = 1):
    x = tf.random.stateless_normal([batch, width], [seed, 1])
    y = tf.random.stateless_normal([batch, width], [seed, 2])
    return x, y


def no_write_step(tape_cls, params, x, y) -> Step:
    def step():
        with tape_cls() as tape:
            loss = tf.reduce_mean((forward(params, x) - y) ** 2)
        return tape.gradient(loss, params)

    return step


def enter_exit() -> Dict[str, Step]:
    """``with AssignAwareTape(): pass`` against ``with tf.GradientTape(): pass``."""
    AssignAwareTape = _tape()

    def cand():
        with AssignAwareTape():
            pass

    def base():
        with tf.GradientTape():
            pass

    return {"assigntape": cand, "baseline": base}


def no_writes(compiled: bool) -> Dict[str, Step]:
    """Forward and gradient of the net, no writes, under either tape."""
    params = net()
    x, y = data()
    return {
        "assigntape": maybe_compile(no_write_step(_tape(), params, x, y), compiled),
        "baseline": maybe_compile(no_write_step(tf.GradientTape, params, x, y), compiled),
    }


def meta_step(compiled: bool, hidden: int = WIDTH, batch: int = BATCH, depth: int = DEPTH) -> Dict[str, Step]:
    """One MAML-style step: an inner SGD step written with ``assign_sub`` on the
    weights inside an AssignAwareTape, then the outer loss's gradient with
    respect to the learning rate and the starting weights; against the
    functional rewrite (the adapted weights are tensors, nothing is written
    inside the tape) under ``tf.GradientTape``. Both reset the weights from the
    same start first, so they do the same writes outside the tape."""
    AssignAwareTape = _tape()
    params = net(hidden, depth)
    start = [tf.Variable(p) for p in params]
    lr = tf.Variable(0.01)
    x, y = data(hidden, batch, seed=2)

    def written():
        for p, s in zip(params, start):
            p.assign(s)
        with AssignAwareTape() as outer:
            with tf.GradientTape() as inner:
                inner_loss = tf.reduce_mean((forward(params, x) - y) ** 2)
            grads = inner.gradient(inner_loss, params)
            for p, g in zip(params, grads):
                p.assign_sub(lr * g)
            outer_loss = tf.reduce_mean((forward(params, x) - 2.0 * y) ** 2)
        return outer.gradient(outer_loss, [lr] + params)

    def functional(keep: bool) -> Step:
        def step():
            for p, s in zip(params, start):
                p.assign(s)
            with tf.GradientTape() as outer:
                with tf.GradientTape() as inner:
                    inner_loss = tf.reduce_mean((forward(params, x) - y) ** 2)
                grads = inner.gradient(inner_loss, params)
                fast = [p - lr * g for p, g in zip(params, grads)]
                outer_loss = tf.reduce_mean((forward(fast, x) - 2.0 * y) ** 2)
            result = outer.gradient(outer_loss, [lr] + params)
            if keep:
                for p, f in zip(params, fast):
                    p.assign(f)
            return result

        return step

    return {
        "assigntape": maybe_compile(written, compiled),
        "baseline": maybe_compile(functional(False), compiled),
        # The rewrite that ends as the written program does: the adapted
        # weights written to the variables after the gradient. The written
        # program's variables must hold them after its step, so its memory
        # keeps them where the bare rewrite frees them (``benchmarks.memory``).
        "baseline_same_end_state": maybe_compile(functional(True), compiled),
    }


def writes_per_tape(n: int, size: int = 16, compiled: bool = False) -> Dict[str, Step]:
    """``n`` writes to one variable under the tape, against the rewrite's ``n``
    rebindings of a tensor; the difference over ``n`` is the per-write cost."""
    AssignAwareTape = _tape()
    v, a = tf.Variable(tf.ones([size])), tf.Variable(0.999)

    def written():
        v.assign(tf.ones([size]))
        with AssignAwareTape() as tape:
            for _ in range(n):
                v.assign(v * a)
            loss = tf.reduce_sum(v)
        return tape.gradient(loss, a)

    def functional():
        v.assign(tf.ones([size]))
        with tf.GradientTape() as tape:
            t = v.read_value()
            for _ in range(n):
                t = t * a
            loss = tf.reduce_sum(t)
        return tape.gradient(loss, a)

    return {"assigntape": maybe_compile(written, compiled), "baseline": maybe_compile(functional, compiled)}


def hypergradient(k: int, size: int = 100_000) -> Dict[str, Step]:
    """d (final loss) / d (learning rate) through ``k`` Keras ``SGD`` steps on a
    ``size``-element weight: forward mode (``assigntape.ForwardAccumulator``)
    and reverse mode (an ``AssignAwareTape``'s ``gradient``)."""
    import keras

    import assigntape

    w = tf.Variable(tf.random.stateless_normal([size], [3, 1]) * 0.1)
    start = tf.Variable(w)
    lr = tf.Variable(0.01)
    x = tf.random.stateless_normal([size], [3, 2])
    opt = keras.optimizers.SGD(learning_rate=lambda: lr * 1.0)
    opt.build([w])

    def loss():
        return tf.reduce_sum((w * x - 1.0) ** 2) / size

    def steps():
        for _ in range(k):
            with tf.GradientTape() as inner:
                value = loss()
            opt.apply_gradients([(inner.gradient(value, w), w)])
        return loss()

    def forward_mode():
        w.assign(start)
        with assigntape.ForwardAccumulator(lr, tf.constant(1.0)) as acc:
            final = steps()
        return acc.jvp(final)

    def reverse_mode():
        w.assign(start)
        with assigntape.AssignAwareTape() as tape:
            final = steps()
        return tape.gradient(final, lr)

    return {"forward": forward_mode, "reverse": reverse_mode}


def unrolled_writes(n: int) -> Dict[str, Callable[[], tf.types.experimental.GenericFunction]]:
    """A ``tf.function`` of ``n`` Python-unrolled writes (tape and gradient
    inside), and its rewrite; each entry makes a new, untraced function, whose
    first call is trace plus run."""
    AssignAwareTape = _tape()
    v, a = tf.Variable(tf.ones([16])), tf.Variable(0.999)

    def written():
        with AssignAwareTape() as tape:
            for _ in range(n):
                v.assign(v * a + 0.001)
            loss = tf.reduce_sum(v)
        return tape.gradient(loss, a)

    def functional():
        with tf.GradientTape() as tape:
            t = v.read_value()
            for _ in range(n):
                t = t * a + 0.001
            loss = tf.reduce_sum(t)
        return tape.gradient(loss, a)

    return {"assigntape": lambda: tf.function(written), "baseline": lambda: tf.function(functional)}
