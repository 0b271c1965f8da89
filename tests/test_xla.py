"""A program compiled with XLA (``jit_compile=True``) behaves as the same
program uncompiled.

* Reads of a variable written in a nested body (a cond in a cond branch, a
  cond in a loop body) by every read path (``tf.gather``, ``sparse_read``,
  ``embedding_lookup``, dense), inside the branch after the write and after the
  cond: forward values identical to the same program under a plain
  ``tf.GradientTape`` in the same mode, gradients those of the functional
  rewrite, eagerly, in ``tf.function`` and under XLA. The realistic trigger is
  a Keras 3 ``SGD(momentum, gradient_accumulation_steps=2)`` step (a cond) in a
  ``tf.range`` inner loop on an Embedding model.
* Scatter writes with duplicate indices, whose gradient the tape refuses
  (``update``, ``mul``, ``div``, ``min``, ``max``): XLA drops the run-time check,
  so indices known while tracing are refused then, with
  ``DuplicateIndicesError``, and indices known only at run time give NaN in the
  affected gradient entries (a write inside a cond branch or loop body).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close

from assigntape import AssignAwareTape, DuplicateIndicesError

ZERO = tf.UnconnectedGradients.ZERO
MODES = ("eager", "function", "xla")
E0 = [[1.0, 2.0], [3.0, -4.0], [5.0, 0.5]]
IDS = [2, 0, 2]  # a row read twice


def _run(mode: str, fn: Callable[..., Any], *args: Any) -> Any:
    if mode == "eager":
        return fn(*args)
    return tf.function(fn, jit_compile=mode == "xla")(*args)


def _numpy(structure: Any) -> Any:
    return tf.nest.map_structure(lambda t: None if t is None else np.asarray(t), structure)


# Each read of the variable, and the same read of a tensor (for the rewrite).
READS: Dict[str, Callable[[Any], Any]] = {
    "gather": lambda e: tf.gather(e, IDS),
    "sparse_read": lambda e: e.sparse_read(IDS) if isinstance(e, tf.Variable) else tf.gather(e, IDS),
    "embedding_lookup": lambda e: tf.nn.embedding_lookup(e, IDS),
    "dense": lambda e: e * 1.0,
}


def _loss(rows: Any) -> Any:
    # Non-linear, so that a stale forward value also gives a wrong gradient.
    return tf.reduce_sum(tf.sin(rows) * rows)


# -- reads of a variable written in a nested body ---------------------------------


# Each program takes the read, the variable (or the rewrite's current tensor),
# the scalar, how to write, and the control flow to use: TensorFlow's, or, for
# the rewrite, Python's.
Write = Callable[[Callable[[Any], Any]], Any]


def _python_cond(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    return true_fn() if bool(pred) else false_fn()


def _python_while(cond: Callable[..., Any], body: Callable[..., Any], state: Any, **_: Any) -> Any:
    while bool(cond(*state)):
        state = body(*state)
    return state


def _cond_in_cond(
    read: Callable[[Any], Any], e: Callable[[], Any], a: Any, write: Write, cond: Any = tf.cond, while_loop: Any = None
) -> Any:
    """The outer branch writes, then a cond in it writes again and reads the
    new version, and reads follow each cond."""

    def inner_true() -> Any:
        write(lambda x: x - a * x)
        return _loss(read(e()))  # read inside the branch, after its write

    def outer_true() -> Any:
        write(lambda x: x * 1.5 + a)
        before = _loss(read(e()))  # a read of the outer version, before the inner write
        inside = cond(a > 0.0, inner_true, lambda: _loss(read(e())) * a)
        return before + inside + _loss(read(e()))  # ... and after the inner cond

    inside = cond(a < 10.0, outer_true, lambda: tf.constant(0.0))
    return inside + _loss(read(e()))  # after the outer cond


def _cond_in_loop(
    read: Callable[[Any], Any],
    e: Callable[[], Any],
    a: Any,
    write: Write,
    cond: Any = tf.cond,
    while_loop: Any = tf.while_loop,
) -> Any:
    """A loop body writes (the variable is carried), then a cond in it writes
    on even iterations and reads the new version."""

    def inner_true() -> Any:
        write(lambda x: x - a * x)
        return _loss(read(e()))

    def body(i: Any, acc: Any) -> Any:
        write(lambda x: x * 0.5 + a)
        inside = cond(i % 2 == 0, inner_true, lambda: _loss(read(e())) * a)
        return i + 1, acc + inside + _loss(read(e()))

    _, acc = while_loop(lambda i, acc: i < 3, body, (tf.constant(0), tf.constant(0.0)), maximum_iterations=3)
    return acc + _loss(read(e()))


NESTINGS = {"cond_in_cond": _cond_in_cond, "cond_in_loop": _cond_in_loop}


def _nested_program(nesting: str, read_name: str, tape_class: type) -> Callable[[], Any]:
    emb, a = tf.Variable(E0), tf.Variable(0.25)

    def program() -> Any:
        emb.assign(E0)
        with tape_class() as tape:
            tape.watch(a)
            y = NESTINGS[nesting](READS[read_name], lambda: emb, a, lambda f: emb.assign(f(emb)))
        grads = tape.gradient(y, [emb, a], unconnected_gradients=ZERO) if tape_class is AssignAwareTape else None
        return y, grads

    return program


def _nested_rewrite(nesting: str, read_name: str) -> Any:
    """The same program on a tensor rebound by each write, in Python control
    flow (both conds' predicates are known: a = 0.25)."""
    e0, a0 = tf.constant(E0), tf.constant(0.25)
    with tf.GradientTape() as tape:
        tape.watch([e0, a0])
        box = [e0]

        def write(f: Callable[[Any], Any]) -> None:
            box[0] = f(box[0])

        y = NESTINGS[nesting](READS[read_name], lambda: box[0], a0, write, _python_cond, _python_while)
    return y, tape.gradient(y, [e0, a0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("read_name", sorted(READS))
@pytest.mark.parametrize("nesting", sorted(NESTINGS))
def test_reads_after_writes_in_nested_bodies(nesting: str, read_name: str, mode: str) -> None:
    y, grads = _run(mode, _nested_program(nesting, read_name, AssignAwareTape))
    plain_y, _ = _run(mode, _nested_program(nesting, read_name, tf.GradientTape))
    # Forward values: exactly those of the same program under a plain tape.
    assert float(y) == float(plain_y)
    expected_y, expected_grads = _nested_rewrite(nesting, read_name)
    np.testing.assert_allclose(float(y), float(expected_y), rtol=1e-5)
    assert_grads_close(grads, expected_grads, rtol=1e-4, atol=1e-5)


_CALLS = ("PartitionedCall", "StatefulPartitionedCall")


def _ops(graph: Any) -> Iterator[Any]:
    """The ops of ``graph`` and of the functions its calls run: in a graph
    where a tape records, a cond is wrapped in a function call."""
    for op in graph.get_operations():
        yield op
        if op.type in _CALLS:
            yield from _ops(graph._get_function(op.get_attr("f").name).graph)


def test_a_read_before_a_nested_write_runs_before_it() -> None:
    """In a branch, a read of the branch's version and a write in a cond nested
    after it touch one resource through different handles (the branch's
    version, and the tape-level version the nested cond is given): the read
    must still run first. Checked on the graph, where the order is decided."""
    v, a = tf.Variable([1.0, 2.0]), tf.Variable(3.0)

    def f() -> Any:
        v.assign([1.0, 2.0])
        with AssignAwareTape() as tape:

            def outer() -> Any:
                v.assign(v * a)
                before = tf.reduce_sum(v * 1.0)  # 3 * (1 + 2)
                tf.cond(a > 0.0, lambda: v.assign_add([100.0, 100.0]).read_value(), lambda: v * 1.0)
                return before

            before = tf.cond(a > 0.0, outer, lambda: tf.constant(0.0))
        return before, tape.gradient(before, a)

    concrete = tf.function(f).get_concrete_function()
    outer_if = next(op for op in _ops(concrete.graph) if op.type in ("If", "StatelessIf"))
    branch = outer_if._true_graph
    # (The nested cond, or the function call it is wrapped in, prepared for higher order.)
    nested = [op for op in branch.get_operations() if op.type in ("If", "StatelessIf") + _CALLS]
    reads = [op for op in branch.get_operations() if op.type == "ReadVariableOp"]
    assert len(nested) == 1 and reads
    ancestors, frontier = set(), [nested[0]]
    while frontier:
        op = frontier.pop()
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if parent not in ancestors:
                ancestors.add(parent)
                frontier.append(parent)
    assert all(read in ancestors for read in reads), [r.name for r in reads if r not in ancestors]
    before, grad = concrete()
    assert float(before) == 9.0 and float(grad) == 3.0


# -- the realistic trigger: a Keras optimizer step inside a cond, in a loop ------


def test_keras_sgd_with_gradient_accumulation_in_a_compiled_inner_loop() -> None:
    """Keras 3's SGD with momentum and ``gradient_accumulation_steps=2`` steps
    inside a cond (accumulate, or apply and reset); its momentum update writes
    the momentum and then reads it. Four steps in a ``tf.range`` loop on an
    Embedding model, inside the tape, compiled with XLA: the loss equals the
    plain tape's, the hypergradient and the weights' gradients the eager tape's
    and the rewrite's (Keras' update written out on tensors)."""
    import keras

    keras.utils.set_random_seed(3)
    emb, dense = keras.layers.Embedding(5, 3), keras.layers.Dense(1)
    ids = tf.constant([[1, 4], [0, 1], [3, 3]])
    target = tf.constant([[1.0], [0.0], [-1.0]])
    emb.build((None, 2))
    dense.build((None, 3))
    weights = emb.trainable_variables + dense.trainable_variables
    lr = tf.Variable(0.3)
    opt = keras.optimizers.SGD(learning_rate=lambda: lr, momentum=0.9, gradient_accumulation_steps=2)
    opt.build(weights)
    w0 = [w.numpy() for w in weights]
    o0 = [o.numpy() for o in opt.variables]
    steps = 4

    def forward(params: List[Any]) -> Any:
        table, kernel, bias = params
        return tf.reduce_mean(tf.gather(table, ids), axis=1) @ kernel + bias

    def program(tape_class: type) -> Callable[[], Any]:
        def f() -> Any:
            for w, start in zip(weights, w0):
                w.assign(start)
            for o, start in zip(opt.variables, o0):
                o.assign(start)
            with tape_class() as tape:
                tape.watch(lr)
                total = tf.constant(0.0)
                for _ in range(steps) if tf.executing_eagerly() else tf.range(steps):
                    with tf.GradientTape() as inner:
                        loss = tf.reduce_mean((forward(weights) - target) ** 2)
                    # Dense gradients: TensorFlow's own XLA cond gradient cannot pass on the
                    # embedding's IndexedSlices densified inside the cond in a loop (its
                    # placeholder for the other branch gets a zero-size shape).
                    dense = [tf.convert_to_tensor(g) for g in inner.gradient(loss, weights)]
                    opt.apply_gradients(zip(dense, weights))
                    total += tf.reduce_mean((forward(weights) - 2.0 * target) ** 2)
            grads = tape.gradient(total, [lr] + weights) if tape_class is AssignAwareTape else None
            return total, grads

        return f

    def rewrite() -> Any:
        lr0, params0 = tf.constant(0.3), [tf.constant(w) for w in w0]
        with tf.GradientTape() as tape:
            tape.watch([lr0] + params0)
            params, total = list(params0), 0.0
            momenta = [tf.zeros_like(p) for p in params]
            accumulated = [tf.zeros_like(p) for p in params]
            for step in range(steps):
                with tf.GradientTape() as inner:
                    inner.watch(params)
                    loss = tf.reduce_mean((forward(params) - target) ** 2)
                grads = [tf.convert_to_tensor(g) for g in inner.gradient(loss, params)]
                if (step + 1) % 2 == 0:  # apply the mean, then reset the accumulators
                    grads = [(g + acc) / 2 for g, acc in zip(grads, accumulated)]
                    momenta = [m * 0.9 - g * lr0 for m, g in zip(momenta, grads)]
                    params = [p + m for p, m in zip(params, momenta)]
                    accumulated = [tf.zeros_like(p) for p in params]
                else:
                    accumulated = [acc + g for acc, g in zip(accumulated, grads)]
                total += tf.reduce_mean((forward(params) - 2.0 * target) ** 2)
        return total, tape.gradient(total, [lr0] + params0)

    expected_total, expected_grads = rewrite()
    eager_total, eager_grads = program(AssignAwareTape)()
    np.testing.assert_allclose(float(eager_total), float(expected_total), rtol=1e-5)
    assert_grads_close(eager_grads, expected_grads, rtol=1e-4, atol=1e-6)
    for jit in (False, True):
        total, grads = tf.function(program(AssignAwareTape), jit_compile=jit)()
        plain_total, _ = tf.function(program(tf.GradientTape), jit_compile=jit)()
        assert float(total) == float(plain_total), (jit, float(total), float(plain_total))
        np.testing.assert_allclose(float(total), float(expected_total), rtol=1e-5)
        assert_grads_close(grads, expected_grads, rtol=1e-4, atol=1e-6)


# -- duplicate indices under XLA --------------------------------------------------

# The writes whose gradient depends on how duplicates combine, each with the
# indices it takes (rows for scatter_*, [n, 1] for scatter_nd_*).
DUPLICATE_WRITES: Dict[str, Callable[[Any, Any, Any], Any]] = {
    "scatter_update": lambda v, idx, u: v.scatter_update(tf.IndexedSlices(u, idx)),
    "scatter_mul": lambda v, idx, u: v.scatter_mul(tf.IndexedSlices(u, idx)),
    "scatter_div": lambda v, idx, u: v.scatter_div(tf.IndexedSlices(u, idx)),
    "scatter_max": lambda v, idx, u: v.scatter_max(tf.IndexedSlices(u, idx)),
    "scatter_min": lambda v, idx, u: v.scatter_min(tf.IndexedSlices(u, idx)),
    "scatter_nd_update": lambda v, idx, u: v.scatter_nd_update(tf.expand_dims(idx, -1), u),
}
V0 = [1.0, 2.0, 3.0, 4.0]
U0 = [2.0, 6.0, 0.5]


@pytest.mark.parametrize("in_branch", [False, True], ids=["tape_level", "in_a_branch"])
@pytest.mark.parametrize("kind", sorted(DUPLICATE_WRITES))
def test_indices_known_while_tracing_are_refused_while_tracing_under_xla(kind: str, in_branch: bool) -> None:
    v, u = tf.Variable(V0, name="table"), tf.Variable(U0)

    @tf.function(jit_compile=True)
    def f() -> Any:
        with AssignAwareTape() as tape:
            write = lambda: DUPLICATE_WRITES[kind](v, tf.constant([1, 3, 1]), u * 1.0)  # noqa: E731
            if in_branch:
                tf.cond(u[0] > 0.0, lambda: (write(), tf.constant(0.0))[1], lambda: tf.constant(0.0))
            else:
                write()
            y = tf.reduce_sum(v * v)
        return tape.gradient(y, u)

    with pytest.raises(DuplicateIndicesError) as info:
        f()
    message = str(info.value)
    assert "table" in message and "ResourceScatter" in message and "scatter_add" in message
    assert "XLA" in message
    np.testing.assert_array_equal(v.numpy(), V0)  # refused before anything ran


def test_uncompiled_duplicates_are_still_refused_when_the_write_runs() -> None:
    # The same write in a graph without XLA: the run-time check refuses it.
    v, u = tf.Variable(V0), tf.Variable(U0)

    @tf.function
    def f(idx: Any) -> Any:
        with AssignAwareTape() as tape:
            v.scatter_update(tf.IndexedSlices(u * 1.0, idx))
            y = tf.reduce_sum(v * v)
        return tape.gradient(y, u)

    with pytest.raises(tf.errors.InvalidArgumentError, match="duplicate indices"):
        f(tf.constant([1, 3, 1]))
    assert np.isfinite(f(tf.constant([1, 3, 0])).numpy()).all()


def _branch_scatter(kind: str, tape_class: type) -> Callable[[Any], Any]:
    v, u = tf.Variable(V0), tf.Variable(U0)

    def f(idx: Any) -> Any:
        v.assign(V0)
        with tape_class() as tape:
            tape.watch(u)

            def write() -> Any:
                DUPLICATE_WRITES[kind](v, idx, u * 1.0)
                return tf.reduce_sum(v * v)  # a read after the write, in the branch

            inside = tf.cond(u[0] > 0.0, write, lambda: tf.constant(0.0))
            y = inside + tf.reduce_sum(tf.sin(v) * v)
        grads = tape.gradient(y, [v, u]) if tape_class is AssignAwareTape else None
        return y, v.read_value(), grads

    return f


def _scatter_rewrite(kind: str, idx: List[int], written: Any) -> Any:
    """The functional rewrite, for unique indices; with duplicates, the written
    rows are taken as observed and cut from the gradient (only the other
    entries are compared)."""
    v0, u0 = tf.constant(V0), tf.constant(U0)
    with tf.GradientTape() as tape:
        tape.watch([v0, u0])
        rows, nd = tf.gather(v0, idx), [[i] for i in idx]
        combined = {
            "scatter_update": u0,
            "scatter_nd_update": u0,
            "scatter_mul": rows * u0,
            "scatter_div": rows / u0,
            "scatter_max": tf.maximum(rows, u0),
            "scatter_min": tf.minimum(rows, u0),
        }[kind]
        if len(set(idx)) < len(idx):
            repeated = [i for i in idx if idx.count(i) > 1]
            combined = tf.where([i in repeated for i in idx], tf.stop_gradient(tf.gather(written, idx)), combined)
        t = tf.tensor_scatter_nd_update(v0, nd, combined)
        y = tf.reduce_sum(t * t) + tf.reduce_sum(tf.sin(t) * t)
    return y, tape.gradient(y, [v0, u0], unconnected_gradients=ZERO)


@pytest.mark.parametrize("kind", sorted(DUPLICATE_WRITES))
def test_indices_known_only_at_run_time_under_xla(kind: str) -> None:
    """In a branch compiled by XLA: unique indices give the rewrite's gradient;
    repeated ones give NaN in the gradient entries they affect (the updates
    written to a repeated position, and that position of the previous value
    where the write combines it), and the rewrite's gradient elsewhere. The
    forward values are the plain tape's."""
    compiled = tf.function(_branch_scatter(kind, AssignAwareTape), jit_compile=True)
    plain = tf.function(_branch_scatter(kind, tf.GradientTape), jit_compile=True)
    for idx in ([3, 0, 2], [1, 3, 1]):
        y, written, (g_v, g_u) = compiled(tf.constant(idx))
        plain_y, plain_written, _ = plain(tf.constant(idx))
        assert float(y) == float(plain_y)
        np.testing.assert_array_equal(written.numpy(), plain_written.numpy())
        expected_y, (e_v, e_u) = _scatter_rewrite(kind, idx, written)
        np.testing.assert_allclose(float(y), float(expected_y), rtol=1e-5)
        g_v, g_u = np.asarray(g_v), np.asarray(g_u)
        repeated = sorted({i for i in idx if idx.count(i) > 1})
        affected_u = np.array([i in repeated for i in idx])
        combines_old = kind not in ("scatter_update", "scatter_nd_update")
        affected_v = np.array([combines_old and i in repeated for i in range(len(V0))])
        # Elsewhere: the rewrite's gradient, finite.
        np.testing.assert_allclose(g_u[~affected_u], e_u.numpy()[~affected_u], rtol=1e-5)
        np.testing.assert_allclose(g_v[~affected_v], e_v.numpy()[~affected_v], rtol=1e-5)
        if kind not in ("scatter_max", "scatter_min"):
            assert np.isnan(g_u[affected_u]).all() and np.isnan(g_v[affected_v]).all()
            continue
        # max / min: each candidate is compared with the previous value alone, so
        # a candidate that loses that comparison gets its true gradient, 0; the
        # one that wins overall (the previous value on a tie) always gets NaN.
        assert (np.isnan(g_u[affected_u]) | (g_u[affected_u] == 0)).all()
        assert (np.isnan(g_v[affected_v]) | (g_v[affected_v] == 0)).all()
        better = np.greater if kind == "scatter_max" else np.less
        for position in repeated:
            # The previous value first: a tie goes to it.
            winner, grad = V0[position], g_v[position]
            for j, i in enumerate(idx):
                if i == position and better(U0[j], winner):
                    winner, grad = U0[j], g_u[j]
            assert np.isnan(grad), (position, winner)


def test_tape_level_indices_known_only_at_run_time_under_xla() -> None:
    v, u = tf.Variable(V0), tf.Variable(U0)

    @tf.function(jit_compile=True)
    def f(idx: Any) -> Any:
        v.assign(V0)
        with AssignAwareTape() as tape:
            v.scatter_update(tf.IndexedSlices(u * 1.0, idx))
            y = tf.reduce_sum(v * v)
        return tape.gradient(y, u)

    grad = f(tf.constant([1, 3, 1])).numpy()
    assert np.isnan(grad[[0, 2]]).all()
    np.testing.assert_allclose(grad[1], 2 * np.asarray(U0)[1])  # the unique index keeps its gradient


def _loop_in_a_branch(tape_class: Any, write: bool) -> Callable[[], Any]:
    v, x = tf.Variable(1.0), tf.Variable(0.5)

    @tf.function(jit_compile=True)
    def f() -> Any:
        with tape_class() as tape:

            def branch() -> Any:
                y = tf.constant(1.0)
                for _ in tf.range(3):
                    if write:
                        v.assign_add(x * v)
                    else:
                        y = y * v + x
                return v.read_value() if write else y

            y = tf.cond(x > 0, branch, lambda: v * 1.0)
            y = v * 2.0 if write else y
        return tape.gradient(y, x)

    return f


def test_a_differentiated_graph_loop_in_a_branch_does_not_compile_in_tensorflow_either() -> None:
    """A known limit (README): TensorFlow's XLA bridge cannot compile a graph
    loop in a cond branch whose gradient goes through a variable the loop
    carries. The tape's writes in such a loop hit it; so does plain
    TensorFlow reading a variable in the loop."""
    for tape_class, write in ((AssignAwareTape, True), (tf.GradientTape, False)):
        with pytest.raises(tf.errors.UnimplementedError, match="_Retval node's input does not come from _Arg"):
            _loop_in_a_branch(tape_class, write)()
    # Without jit_compile the tape's program is right: d(2 v3)/dx = 2 * 3 (1 + x)^2 at v0 = 1.
    assert float(tf.function(_loop_in_a_branch(AssignAwareTape, True).python_function)()) == pytest.approx(6 * 1.5**2)


# Scatter writes whose indices come from tf.unique (a dynamic number of rows
# under XLA), as the sparse path of the legacy Adam family deduplicates them:
# the write, and its rewrite on tensors.
UNIQUE_SCATTERS: Dict[str, Any] = {
    "add": (
        lambda v, u, x: v.scatter_add(tf.IndexedSlices(x, u)),
        lambda t, u, x: tf.tensor_scatter_nd_add(t, u[:, None], x),
    ),
    "sub": (
        lambda v, u, x: v.scatter_sub(tf.IndexedSlices(x, u)),
        lambda t, u, x: tf.tensor_scatter_nd_sub(t, u[:, None], x),
    ),
    "nd_add": (
        lambda v, u, x: v.scatter_nd_add(u[:, None], x),
        lambda t, u, x: tf.tensor_scatter_nd_add(t, u[:, None], x),
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(UNIQUE_SCATTERS))
def test_scatter_writes_with_indices_from_unique(kind: str, mode: str) -> None:
    """The gradient of an additive scatter write whose indices come from
    ``tf.unique`` of constant ids, the values summed per row
    (``unsorted_segment_sum``): equal to the rewrite's in the same mode. Was,
    under XLA: InvalidArgumentError ("Incompatible shapes: [3,2] vs. [2,2]")
    in the tape's backward pass, from a shape computation on the dynamic
    number of rows, where the rewrite compiles."""
    write, rewrite = UNIQUE_SCATTERS[kind]
    ids = None  # made inside the program: XLA folds tf.unique's row count differently

    def rows(ids: Any, s: Any) -> Any:
        u, idx = tf.unique(tf.constant(IDS))
        x = tf.math.unsorted_segment_sum(tf.ones([3, 2]) * s, idx, tf.shape(u)[0])
        return u, x

    def aware(ids: Any) -> Any:
        v, s = tf.Variable(E0), tf.Variable(0.5)
        with AssignAwareTape() as tape:
            u, x = rows(ids, s)
            write(v, u, x)
            loss = tf.reduce_sum(v**2 * tf.constant([[1.0, 2.0]]))
        return tape.gradient(loss, [s, v], unconnected_gradients=ZERO)

    def functional(ids: Any) -> Any:
        t, s = tf.constant(E0), tf.constant(0.5)
        with tf.GradientTape() as tape:
            tape.watch([t, s])
            u, x = rows(ids, s)
            new = rewrite(t, u, x)
            loss = tf.reduce_sum(new**2 * tf.constant([[1.0, 2.0]]))
        return tape.gradient(loss, [s, t], unconnected_gradients=ZERO)

    if mode == "eager":
        got, expected = aware(ids), functional(ids)
    else:
        # Variables made on the first trace only.
        made: Dict[str, Any] = {}

        def traced(ids: Any) -> Any:
            if not made:
                made["v"], made["s"] = tf.Variable(E0), tf.Variable(0.5)
            v, s = made["v"], made["s"]
            v.assign(E0)
            with AssignAwareTape() as tape:
                u, x = rows(ids, s)
                write(v, u, x)
                loss = tf.reduce_sum(v**2 * tf.constant([[1.0, 2.0]]))
            return tape.gradient(loss, [s, v], unconnected_gradients=ZERO)

        got = tf.function(traced, jit_compile=mode == "xla")(ids)
        expected = tf.function(functional, jit_compile=mode == "xla")(ids)
    assert expected[0] is not None and float(expected[0]) != 0.0
    assert_grads_close(got, expected)


def test_legacy_adam_sparse_step_under_xla() -> None:
    """A tf_keras legacy Adam step on an embedding's sparse gradient (its
    sparse path deduplicates the indices with tf.unique), compiled with XLA.
    By hand, the first Adam step moves each touched row by lr * g / |g| = lr
    (g > 0 here; epsilon 1e-7 is negligible at this tolerance), with no
    gradient through g / |g|: w1 = w0 - lr on rows 0 and 2. So d sum(w1^2) /
    d lr = -2 (0.99 + 1.99 + 4.99 + 5.99) = -27.92, and d / d w0 = 2 w1 on
    the touched rows, 2 w0 on the other. Was: InvalidArgumentError in the
    tape's backward pass."""
    import tf_keras

    table, lr = tf.Variable([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), tf.Variable(0.01)
    optimizer = tf_keras.optimizers.legacy.Adam(learning_rate=lambda: lr * 1.0)
    optimizer._create_all_weights([table])

    @tf.function(jit_compile=True)
    def step() -> Any:
        with AssignAwareTape() as outer:
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(tf.gather(table, [0, 2, 0]) ** 3)
            optimizer.apply_gradients([(inner.gradient(loss, table), table)])
            val = tf.reduce_sum(table**2)
        return outer.gradient(val, [lr, table])

    d_lr, d_table = step()
    np.testing.assert_allclose(float(d_lr), -27.92, rtol=1e-4)
    np.testing.assert_allclose(
        tf.convert_to_tensor(d_table).numpy(), [[1.98, 3.98], [6.0, 8.0], [9.98, 11.98]], rtol=1e-4
    )


# -- a writing loop differentiated in the same compiled function ---------------------
#
# With a persistent tape or nested tapes recording, TensorFlow wraps a graph loop
# in a function call for tape gradients, and a gradient through the loop taken
# later in the same graph turns that call into a forward function; under XLA the
# loop's writes then lost their order (a read after the loop saw the old value, a
# write after it was overwritten by the loop's). Each loop writes v <- v * x * e
# for e in ES; after it, a read, a write, and a read by tf.gather.

V_START = [1.5, -0.5, 2.0]
X_START = 0.7
ES = [1.25, 0.8]


def _loop_writes(v: Any, x: Any, kind: str) -> None:
    es = tf.constant(ES, tf.float64)

    def step(e: Any) -> None:
        v.assign(v * x * e)

    if kind == "map_fn":
        tf.map_fn(lambda e: (step(e), e)[1], es)
    elif kind == "while_loop":
        # (XLA differentiates a while_loop only with maximum_iterations.)
        body = lambda i: (step(tf.gather(es, i)), i + 1)[1]  # noqa: E731
        tf.while_loop(lambda i: i < len(ES), body, [0], maximum_iterations=len(ES))
    elif kind == "scan":
        tf.scan(lambda acc, e: (step(e), acc + e)[1], es, initializer=tf.constant(0.0, tf.float64))
    else:  # foldl
        tf.foldl(lambda acc, e: (step(e), acc + e)[1], es, initializer=tf.constant(0.0, tf.float64))


def _after_the_loop(v: Any, x: Any) -> Any:
    """The reads and the write after the loop (``v`` a variable, or the rewrite's tensor)."""
    y = tf.reduce_sum(tf.sin(v) * v) * x
    if isinstance(v, tf.Variable):
        v.assign_add(x * tf.constant([1.0, 2.0, 3.0], tf.float64))
    else:
        v = v + x * tf.constant([1.0, 2.0, 3.0], tf.float64)
    return y + tf.reduce_sum(tf.gather(v, [0, 2]) ** 2), v


def _loop_then_gradient(kind: str, way: str, jit: bool) -> Any:
    v = tf.Variable(V_START, dtype=tf.float64)
    x = tf.Variable(X_START, dtype=tf.float64)

    @tf.function(jit_compile=jit)
    def f() -> Any:
        if way == "tf.gradients":
            with AssignAwareTape(persistent=True) as tape:
                _loop_writes(v, x, kind)
                y, _ = _after_the_loop(v, x)
                grad = tf.gradients(y, [x])[0]
            return y, grad, tape.gradient(y, x)
        if way == "inner_tape":
            with AssignAwareTape():
                with AssignAwareTape() as inner:
                    _loop_writes(v, x, kind)
                    y, _ = _after_the_loop(v, x)
                grad = inner.gradient(y, x)
            return y, grad, grad
        with AssignAwareTape():  # plain_tape: a plain tape inside follows the versions too
            with tf.GradientTape() as plain:
                _loop_writes(v, x, kind)
                y, _ = _after_the_loop(v, x)
            grad = plain.gradient(y, x)
        return y, grad, grad

    y, grad, tape_grad = f()
    return float(y), float(grad), float(tape_grad), v.numpy()


def _loop_rewrite() -> Any:
    x = tf.constant(X_START, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(x)
        w = tf.constant(V_START, tf.float64)
        for e in ES:
            w = w * x * e
        y, w = _after_the_loop(w, x)
    return float(y), float(tape.gradient(y, x)), w.numpy()


@pytest.mark.parametrize("jit", [False, True], ids=["function", "xla"])
@pytest.mark.parametrize("way", ["tf.gradients", "inner_tape", "plain_tape"])
@pytest.mark.parametrize("kind", ["map_fn", "while_loop", "scan", "foldl"])
def test_a_writing_loop_differentiated_in_the_same_function(kind: str, way: str, jit: bool) -> None:
    y, grad, tape_grad, final = _loop_then_gradient(kind, way, jit)
    y_expected, grad_expected, final_expected = _loop_rewrite()
    assert y == pytest.approx(y_expected, rel=1e-9)
    assert grad == pytest.approx(grad_expected, rel=1e-9)
    assert tape_grad == pytest.approx(grad_expected, rel=1e-9)
    np.testing.assert_allclose(final, final_expected, rtol=1e-9)


# A scalar update broadcast to the written rows (as the raw scatter ops do), in
# a loop differentiated under XLA: the broadcast's shape must be a constant
# there (it was built from the variable's run-time shape: BroadcastGradientArgs
# did not compile).
SCALAR_SCATTERS: Dict[str, Any] = {
    "mul": (lambda v, u: v.scatter_mul(tf.IndexedSlices(u, tf.constant([0, 2]))), lambda w, u: w * [u, 1.0, u]),
    "update": (
        lambda v, u: v.scatter_update(tf.IndexedSlices(u, tf.constant([0, 2]))),
        lambda w, u: tf.stack([u, w[1], u]),
    ),
    "div": (lambda v, u: v.scatter_div(tf.IndexedSlices(u, tf.constant([0, 2]))), lambda w, u: w / [u, 1.0, u]),
}


@pytest.mark.parametrize("kind", sorted(SCALAR_SCATTERS))
def test_a_scalar_scatter_in_a_loop_differentiated_under_xla(kind: str) -> None:
    write, rewrite = SCALAR_SCATTERS[kind]
    v, x = tf.Variable([1.0, 2.0, 3.0]), tf.Variable(0.5)

    @tf.function(jit_compile=True)
    def f(n: Any) -> Any:
        with AssignAwareTape() as tape:
            for _ in tf.range(n):
                write(v, x * 3.0)
            y = tf.reduce_sum(tf.sin(v) * v)
        return y, tape.gradient(y, x)

    y, grad = f(tf.constant(2))
    xt = tf.constant(0.5)
    with tf.GradientTape() as oracle:
        oracle.watch(xt)
        w = tf.constant([1.0, 2.0, 3.0])
        for _ in range(2):
            w = rewrite(w, xt * 3.0)
        y_expected = tf.reduce_sum(tf.sin(w) * w)
    assert float(y) == pytest.approx(float(y_expected), rel=1e-6)
    assert float(grad) == pytest.approx(float(oracle.gradient(y_expected, xt)), rel=1e-5)
