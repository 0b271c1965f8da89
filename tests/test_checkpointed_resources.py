"""A checkpointed step's resources: a variable's, or made in the step with its seed.

The re-run in the backward pass must compute what the first run did. A
stateful op on a resource that no variable holds and that was made before the
step (a queue, a lookup table, an iterator) sees a state the step changed; a
resource made in the step that draws a random seed (a shuffle, a
RandomShuffleQueue, with no seed) draws another. Each is refused up front
(``RecomputeError`` naming the op), before the gradient, so that a queue's
dequeue cannot wait forever in the re-run; a seed counted from the global seed
(another each call) is caught by the re-run check, whose fingerprint sees an
order. A seeded shuffle made in the step is exact: the loop's gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from oracle import assert_grads_close, modes, run

from assigntape import AssignAwareTape, RecomputeError, checkpointed

DATA = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]


@modes
def test_dequeue_from_a_queue_made_before_the_step_is_refused(mode):
    """(f01, f02) The queue holds one batch: the re-run's dequeue would wait
    forever on the emptied queue. Refused at the step's call; were the
    refusal missing, the queue is closed before the gradient, so that the
    test fails (OutOfRangeError) instead of hanging."""
    w = tf.Variable([1.0, 2.0])
    q = tf.queue.FIFOQueue(10, tf.float32, shapes=[2])

    def step():
        w.assign(w * q.dequeue())

    def program():
        q.enqueue(tf.constant([3.0, 4.0]))
        with AssignAwareTape() as tape:
            checkpointed(step)()
            y = tf.reduce_sum(w)
        q.close()
        return tape.gradient(y, w)

    with pytest.raises(RecomputeError, match=r"checkpointed\(step\) ran the op QueueDequeueV2.*made before the step"):
        run(mode, program)


@modes
def test_lookup_table_made_before_the_step_is_refused(mode):
    """(f01) The step reads and updates a MutableHashTable made before it:
    the re-run would read the updated entry (dy/dv 3 instead of the loop's 2)."""
    v = tf.Variable(0.0)
    table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, default_value=0.0)
    key = tf.constant([0], tf.int64)

    def step():
        c = table.lookup(tf.constant(0, tf.int64))
        table.insert(key, tf.reshape(c + 1.0, [1]))
        v.assign(v * c)

    def program():
        table.insert(key, tf.constant([2.0]))
        with AssignAwareTape() as tape:
            checkpointed(step)()
            y = v + 0.0
        return tape.gradient(y, v)

    with pytest.raises(RecomputeError, match="LookupTableFindV2.*made before the step"):
        run(mode, program)


def _shuffled_program(wrap, seed, queue=False):
    """w (ones) <- w * (a batch of DATA shuffled in the step: by a dataset's
    shuffle, or a RandomShuffleQueue); y = sum(w DATA). Equal elements of w:
    the written value is a permutation of the first run's if the re-run
    shuffles otherwise (all of sum, sum |.| and sum of squares kept).
    Returns dy/dw0 = DATA * batch and w."""
    w = tf.Variable(tf.ones([8]))
    data = tf.constant(DATA)

    def shuffled():
        if queue:
            q = tf.queue.RandomShuffleQueue(8, 0, tf.float32, shapes=[], seed=seed)
            q.enqueue_many(data)
            return q.dequeue_many(8)
        return next(iter(tf.data.Dataset.from_tensors(data).unbatch().shuffle(8, seed=seed).batch(8)))

    def step():
        w.assign(w * shuffled())

    def program():
        with AssignAwareTape() as tape:
            (checkpointed(step) if wrap else step)()
            y = tf.reduce_sum(w * data)
        return tape.gradient(y, w), tf.identity(w)

    return program


@modes
def test_unseeded_shuffle_made_in_the_step_is_refused(mode):
    """(f03) No op seed and no global seed: TensorFlow draws one for the
    shuffle's seed generator, another in the re-run."""
    tf.random.set_seed(None)
    with pytest.raises(RecomputeError, match=r"ShuffleDatasetV3.*no seed.*shuffle\(n, seed=1\)"):
        run(mode, _shuffled_program(True, None))


@modes
def test_shuffle_seeded_from_the_global_seed_is_caught_by_the_rerun_check(mode):
    """(f03 as found) A global seed and no op seed: the op seed is counted
    (another each call and each trace), so the re-run shuffles otherwise;
    only an order-sensitive fingerprint sees the permuted write. Eagerly a
    RecomputeError; compiled the re-run's assertion."""
    tf.random.set_seed(1)
    try:
        with pytest.raises((RecomputeError, tf.errors.InvalidArgumentError), match="re-run in the backward pass"):
            run(mode, _shuffled_program(True, None))
    finally:
        tf.random.set_seed(None)


@modes
def test_shuffle_with_an_op_seed_made_in_the_step_is_the_loops(mode):
    """A shuffle given its seed is made again alike by the re-run: exact.
    (Oracle: the loop; and dy/dw0 = DATA * batch with batch = w after.)"""
    got = run(mode, _shuffled_program(True, 3))
    expected = run(mode, _shuffled_program(False, 3))
    assert_grads_close(got, expected, rtol=0, atol=0)
    np.testing.assert_array_equal(got[0].numpy(), np.array(DATA) * got[1].numpy())


@modes
def test_unseeded_random_shuffle_queue_made_in_the_step_is_refused(mode):
    """(f03b) A RandomShuffleQueue made in the step with no seed dequeues
    another order in the re-run."""
    tf.random.set_seed(None)
    with pytest.raises(RecomputeError, match="RandomShuffleQueueV2.*no seed"):
        run(mode, _shuffled_program(True, None, queue=True))


def test_fingerprints_see_a_permutation():
    """The re-run check's fingerprint of a permutation of the same values
    differs (it was three permutation-invariant sums)."""
    from assigntape._segment_op import fingerprints

    x = tf.constant(DATA)
    first, second = fingerprints([], [x, tf.reverse(x, [0])])
    assert not np.allclose(first.numpy(), second.numpy(), rtol=1e-6, atol=0)


@modes
@pytest.mark.parametrize("where", ["called function", "cond branch"])
def test_iterator_made_before_the_step_read_in_a_called_function_or_branch_is_refused(mode, where):
    """(f12, f12b) next(it) of an iterator made before the step, inside a
    tf.function the step calls or a tf.cond branch it builds: the re-run
    would take the next batch (a silently different gradient, a skipped
    batch). Refused at the call or cond op, which takes the iterator."""
    if where == "cond branch" and mode == "eager":
        pytest.skip("an eager tf.cond runs one branch as Python: next(it) directly in the step, refused before")
    ds = tf.data.Dataset.from_tensor_slices(tf.constant([[1.0, 2.0], [4.0, 3.0], [2.0, 1.0]]))
    it = iter(ds)
    get_batch = tf.function(lambda: next(it))
    w = tf.Variable(tf.ones([2]))

    def step():
        if where == "called function":
            batch = get_batch()
        else:
            batch = tf.cond(tf.reduce_sum(w) > 0.0, lambda: next(it), lambda: tf.zeros([2]))
        w.assign(w * batch)

    def program():
        with AssignAwareTape() as tape:
            checkpointed(step)()
            y = tf.reduce_sum(w)
        return tape.gradient(y, w)

    with pytest.raises(RecomputeError, match="on a resource made before the step"):
        run(mode, program)
