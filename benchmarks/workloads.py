"""The benchmarked programs, each with its baseline.

Every workload returns zero-argument step callables: the candidate (with
``AssignAwareTape``) and its baseline (``tf.GradientTape`` on the same program,
the same math written functionally, or the hand-written chain rule). In
``compiled`` mode each step is a ``tf.function`` traced once before timing.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import tensorflow as tf

from assigntape import AssignAwareTape

Step = Callable[[], object]


def _maybe_compile(fn: Step, compiled: bool) -> Step:
    if not compiled:
        return fn
    f = tf.function(fn)
    f.get_concrete_function()  # trace now, without running a step
    return f


def _mlp(sizes: List[int], seed: int = 0) -> List[tf.Variable]:
    weights = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        weights.append(tf.Variable(tf.random.stateless_normal([n_in, n_out], [seed, i]) / n_in**0.5))
        weights.append(tf.Variable(tf.zeros([n_out])))
    return weights


def _forward(params, x):
    h = x
    for i in range(0, len(params), 2):
        h = h @ params[i] + params[i + 1]
        if i + 2 < len(params):
            h = tf.nn.relu(h)
    return h


SIZES = [64, 128, 128, 128, 1]  # 4 layers, 8 weight variables
BATCH = 64


def no_writes(compiled: bool) -> Dict[str, Step]:
    """Workload 1: a 4-layer MLP forward and backward, no writes."""
    params = _mlp(SIZES)
    x = tf.random.stateless_normal([BATCH, SIZES[0]], [1, 1])
    y = tf.random.stateless_normal([BATCH, 1], [1, 2])

    def make(tape_cls):
        def step():
            with tape_cls() as tape:
                loss = tf.reduce_mean((_forward(params, x) - y) ** 2)
            return tape.gradient(loss, params)

        return _maybe_compile(step, compiled)

    return {"baseline": make(tf.GradientTape), "assigntape": make(AssignAwareTape)}


def meta_step(compiled: bool, hidden: int = 128, batch: int = BATCH) -> Dict[str, Step]:
    """Workload 2: one MAML step, inner SGD written with assign_sub."""
    sizes = [SIZES[0], hidden, hidden, hidden, 1]
    params = _mlp(sizes)
    start = [tf.Variable(p) for p in params]
    lr = tf.Variable(0.01)
    x = tf.random.stateless_normal([batch, sizes[0]], [2, 1])
    y = tf.random.stateless_normal([batch, 1], [2, 2])

    def written():
        for p, s in zip(params, start):  # each task starts from the same weights
            p.assign(s)
        with AssignAwareTape() as outer:
            with tf.GradientTape() as inner:
                inner_loss = tf.reduce_mean((_forward(params, x) - y) ** 2)
            grads = inner.gradient(inner_loss, params)
            for p, g in zip(params, grads):
                p.assign_sub(lr * g)
            outer_loss = tf.reduce_mean((_forward(params, x) - 2.0 * y) ** 2)
        return outer.gradient(outer_loss, [lr] + params)

    def functional():
        for p, s in zip(params, start):  # the same reset, for the same work
            p.assign(s)
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner_loss = tf.reduce_mean((_forward(params, x) - y) ** 2)
            grads = inner.gradient(inner_loss, params)
            fast = [p - lr * g for p, g in zip(params, grads)]
            outer_loss = tf.reduce_mean((_forward(fast, x) - 2.0 * y) ** 2)
        return outer.gradient(outer_loss, [lr] + params)

    return {"baseline": _maybe_compile(functional, compiled), "assigntape": _maybe_compile(written, compiled)}


def workaround(k: int, compiled: bool) -> Dict[str, Step]:
    """Workload 3: K variables each written once, against the hand-written chain rule."""
    a = [tf.Variable(tf.random.stateless_normal([16], [3, i])) for i in range(k)]
    c = [tf.Variable(tf.zeros([16])) for _ in range(k)]
    x = tf.Variable(0.3)

    def written():
        with AssignAwareTape() as tape:
            for ci, ai in zip(c, a):
                ci.assign(tf.tanh(ai * x))
            loss = tf.add_n([tf.reduce_sum(ci**2) for ci in c])
        return tape.gradient(loss, [x] + a)

    def chain_rule():
        with tf.GradientTape(persistent=True) as tape:
            new = []
            for ci, ai in zip(c, a):
                value = tf.tanh(ai * x)
                ci.assign(value)
                new.append(value)
            loss = tf.add_n([tf.reduce_sum(ci**2) for ci in c])
        g_c = tape.gradient(loss, c)  # d loss / d c, stage one
        total = [tf.zeros([])] + [tf.zeros([16]) for _ in a]
        for value, g in zip(new, g_c):  # stage two, once per write
            parts = tape.gradient(value, [x] + a, output_gradients=g)
            total = [t if p is None else t + p for t, p in zip(total, parts)]
        return total

    return {"baseline": _maybe_compile(chain_rule, compiled), "assigntape": _maybe_compile(written, compiled)}


def writes_per_tape(n: int, size: int = 16, compiled: bool = False) -> Dict[str, Step]:
    """Workload 4a: n writes to one variable, against tensors rebound n times."""
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

    return {"baseline": _maybe_compile(functional, compiled), "assigntape": _maybe_compile(written, compiled)}


def variables_per_tape(n: int, compiled: bool = False) -> Dict[str, Step]:
    """Workload 4b: n variables written once each, against n tensors."""
    vs = [tf.Variable(tf.ones([16])) for _ in range(n)]
    a = tf.Variable(0.5)

    def written():
        with AssignAwareTape() as tape:
            for v in vs:
                v.assign(tf.fill([16], a))
            loss = tf.add_n([tf.reduce_sum(v) for v in vs])
        return tape.gradient(loss, a)

    def functional():
        with tf.GradientTape() as tape:
            ts = []
            for v in vs:
                t = tf.fill([16], a)
                v.assign(t)
                ts.append(t)
            loss = tf.add_n([tf.reduce_sum(t) for t in ts])
        return tape.gradient(loss, a)

    return {"baseline": _maybe_compile(functional, compiled), "assigntape": _maybe_compile(written, compiled)}


def tensor_size(n: int, compiled: bool = False) -> Dict[str, Step]:
    """Workload 4c: one assign_add of an n-element tensor."""
    v, a = tf.Variable(tf.ones([n])), tf.Variable(tf.ones([n]))

    def written():
        with AssignAwareTape() as tape:
            v.assign_add(a * 2.0)
            loss = tf.reduce_sum(v * v)
        return tape.gradient(loss, a)

    def functional():
        with tf.GradientTape() as tape:
            t = v + a * 2.0
            v.assign(t)
            loss = tf.reduce_sum(t * t)
        return tape.gradient(loss, a)

    return {"baseline": _maybe_compile(functional, compiled), "assigntape": _maybe_compile(written, compiled)}


def adam_step(compiled: bool) -> Dict[str, Step]:
    """Workload 5: Keras 3 Adam.apply_gradients on a ~1M-parameter model."""
    import keras

    model = keras.Sequential(
        [keras.Input((512,)), keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(512), keras.layers.Dense(1)]
    )
    opt = keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)
    x = tf.random.stateless_normal([32, 512], [5, 1])
    y = tf.random.stateless_normal([32, 1], [5, 2])

    def make(tape_cls):
        def step():
            with tape_cls():
                with tf.GradientTape() as inner:
                    loss = tf.reduce_mean((model(x) - y) ** 2)
                grads = inner.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return _maybe_compile(step, compiled)

    return {"baseline": make(tf.GradientTape), "assigntape": make(AssignAwareTape)}
