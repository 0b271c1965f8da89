"""MirroredStrategy on two logical CPU devices: a Meta-SGD-style step run with
``strategy.run``, one task per replica, eager and compiled. Each replica's
meta-gradients must equal the single-device functional step on its task.

Logical devices must be configured before TensorFlow initialises, so the
strategy runs in a fresh process (tests/helpers/mirrored_meta_step.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import tensorflow as tf
from helpers import free_ports, helper_output
from helpers.mirrored_meta_step import TASKS, W0

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _functional(x, w0=W0, lr=0.1):
    """The Meta-SGD step on one device, written without variables: d/d lr,
    d/d w0, and the weights after the inner step."""
    w0, lr, x = tf.constant(w0), tf.constant(lr), tf.constant(x)
    with tf.GradientTape() as outer:
        outer.watch([lr, w0])
        with tf.GradientTape() as inner:
            inner.watch(w0)
            inner_loss = tf.reduce_sum((w0 * x) ** 2)
        w1 = w0 - lr * inner.gradient(inner_loss, w0)
        outer_loss = tf.reduce_sum((w1 * x - 1.0) ** 2)
    d_lr, d_w = outer.gradient(outer_loss, [lr, w0])
    return float(d_lr), d_w.numpy(), w1.numpy()


def _aggregated_step(aggregation):
    """Both tasks' Meta-SGD step on one device, their inner gradients reduced
    as ``aggregation`` reduces the replicas' writes, and the summed outer
    objective: d/d lr, d/d w0 and the weights after the step."""
    w0, lr = tf.constant(W0), tf.constant(0.1)
    with tf.GradientTape() as outer:
        outer.watch([lr, w0])
        grads = []
        for x in TASKS:
            with tf.GradientTape() as inner:
                inner.watch(w0)
                inner_loss = tf.reduce_sum((w0 * tf.constant(x)) ** 2)
            grads.append(inner.gradient(inner_loss, w0))
        reduced = {"SUM": grads[0] + grads[1], "MEAN": (grads[0] + grads[1]) / 2, "ONLY_FIRST_REPLICA": grads[0]}
        w1 = w0 - lr * reduced[aggregation]
        loss = sum(tf.reduce_sum((w1 * tf.constant(x) - 1.0) ** 2) for x in TASKS)
    d_lr, d_w = outer.gradient(loss, [lr, w0])
    return float(d_lr), d_w.numpy(), w1.numpy()


def _helper_output(module):
    """Runs ``tests/helpers/<module>`` in a fresh process; its last JSON line."""
    return helper_output(module)


def _assert_replica_grads(grads, expected, label):
    """Each replica's [d/d lr, d/d w0] against the single-device step on its task."""
    for replica, (d_lr, d_w, _) in enumerate(expected):
        got_lr, got_w = grads[replica]
        np.testing.assert_allclose(got_lr, d_lr, rtol=1e-5, err_msg=f"{label} replica {replica}")
        np.testing.assert_allclose(got_w, d_w, rtol=1e-5, err_msg=f"{label} replica {replica}")


def test_mirrored_strategy_meta_step_matches_single_device():
    result = _helper_output("mirrored_meta_step")
    expected = [_functional(x) for x in TASKS]
    for mode in ("eager", "function"):
        _assert_replica_grads(result[mode]["grads"], expected, mode)
        for replica, (_, _, w1) in enumerate(expected):
            # Each replica's write updated its own component of the variable.
            np.testing.assert_allclose(result[mode]["components"][replica], w1, rtol=1e-6)
    assert expected[0][0] != expected[1][0]  # the tasks really differ


def test_multi_worker_mirrored_strategy_on_loopback():
    """Two worker processes, TF_CONFIG on 127.0.0.1, each running the step on its
    own task; each worker's meta-gradients equal the single-device step on its
    task, and the cross-worker mean is the mean of the two."""
    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    workers = []
    try:
        for index in range(2):
            env = dict(base, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "helpers.multiworker_meta_step"],
                    cwd=ROOT / "tests",
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outputs = [w.communicate(timeout=300) for w in workers]
    finally:
        for w in workers:  # bounded: never leave a worker behind
            if w.poll() is None:
                w.kill()
                w.wait()
    expected = [_functional(x) for x in TASKS]
    results = []
    for w, (out, err) in zip(workers, outputs):
        assert w.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        results.append(result)
        index = result["task_index"]
        w1 = expected[index][2]
        for mode in ("eager", "function"):
            assert len(result[mode]["grads"]) == 1  # one local replica per worker
            _assert_replica_grads(result[mode]["grads"], [expected[index]], f"{mode} worker {index}")
            np.testing.assert_allclose(result[mode]["components"][0], w1, rtol=1e-6)
            mean = (expected[0][0] + expected[1][0]) / 2
            np.testing.assert_allclose(result[mode]["mean_d_lr"], mean, rtol=1e-5)
    # A Keras optimizer's step across the workers: each worker's meta-gradients
    # (of its own task's objective) sum to one device's of the summed
    # objective, and each worker's weights are one device's, step after step.
    from helpers.mirrored_optimizers import single_device

    for name in results[0]["keras"]:
        single = single_device(name)
        for mode in ("eager", "compiled"):
            got = [r["keras"][name][mode] for r in results]
            assert all("result" in g for g in got), (name, mode, got)
            for step, (s_lr, s_w, w1) in enumerate(single):
                label = f"{name} {mode} step {step}"
                np.testing.assert_allclose(sum(g["result"][step][0] for g in got), s_lr, rtol=1e-5, err_msg=label)
                np.testing.assert_allclose(
                    np.sum([g["result"][step][1] for g in got], axis=0), s_w, rtol=1e-5, atol=1e-6, err_msg=label
                )
                for g in got:
                    np.testing.assert_allclose(g["result"][step][2][0], w1, rtol=1e-6, err_msg=label)
    # Keras 3's LossScaleOptimizer across the workers (its update in a
    # merge_call's own call_for_each_replica): eager, the workers'
    # meta-gradients sum to the rewrite's (were first-order, d/d lr None);
    # compiled, refused with the way out.
    rewrite = results[0]["rewrite_loss_scale"]
    got = [r["loss_scale"]["eager"] for r in results]
    assert all("result" in g for g in got), got
    np.testing.assert_allclose(sum(g["result"][0] for g in got), rewrite[0], rtol=1e-5)
    np.testing.assert_allclose(np.sum([g["result"][1] for g in got], axis=0), rewrite[1], rtol=1e-5, atol=1e-6)
    for r in results:
        refused = r["loss_scale"]["compiled"]
        assert refused.get("error") == "UntrackedWriteError" and "run_functions_eagerly" in refused["message"], refused


def test_mirrored_variable_kinds_and_aggregations():
    """Per-replica writes (ON_WRITE with aggregation NONE, and ON_READ with any
    aggregation) give each replica its single-device meta-gradients. Aggregated
    writes (ON_WRITE with SUM / MEAN / ONLY_FIRST_REPLICA) give meta-gradients
    that sum to the single-device gradient of the summed objective. (Keras optimizer steps:
    test_keras_optimizer_steps_in_replica_context.)"""
    out = _helper_output("mirrored_aggregations")
    expected = [_functional(x) for x in TASKS]
    works = ["ON_WRITE/NONE"] + [f"ON_READ/{a}" for a in ("NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA")]
    for case in works:
        assert "result" in out[case], (case, out[case])
        for mode in ("eager", "function"):
            _assert_replica_grads(out[case]["result"][mode]["grads"], expected, f"{case} {mode}")
    # The same step with its write in a tf.cond branch, compiled, per replica.
    _assert_replica_grads(out["cond_write_in_replica_context"]["result"], expected, "cond")
    # Aggregated writes: the replicas' meta-gradients sum to the single-device
    # gradient of the summed objective, and every component holds its step.
    for aggregation in ("SUM", "MEAN", "ONLY_FIRST_REPLICA"):
        d_lr, d_w, w1 = _aggregated_step(aggregation)
        for mode in ("eager", "function"):
            got = out[f"ON_WRITE/{aggregation}"]
            assert "result" in got, (aggregation, got)
            grads = got["result"][mode]["grads"]
            label = f"{aggregation} {mode}"
            np.testing.assert_allclose(sum(g[0] for g in grads), d_lr, rtol=1e-5, err_msg=label)
            np.testing.assert_allclose(np.sum([g[1] for g in grads], axis=0), d_w, rtol=1e-5, err_msg=label)
            for component in got["result"][mode]["components"]:
                np.testing.assert_allclose(component, w1, rtol=1e-6, err_msg=label)
    # Written before any read: v = 1 + mean(3x) (x = 2 on both), loss = v; each
    # replica's d loss / d x is 3 (the mean all-reduce's gradient is the mean).
    assert out["unread_aggregated_write"]["result"] == {"loss": [7.0, 7.0], "grad": [3.0, 3.0]}
    # A merge_call of the user's own that updates an aggregated variable is
    # refused; with untracked_writes="cut" it goes through, warned, as a new
    # version with no gradient path: v = 1 + 6 = 7, loss = v x = 14, d loss / d x = v.
    refused = out["merge_call_aggregated_write"]
    assert refused.get("error") == "UntrackedWriteError", refused
    assert "cross-replica update" in refused["message"] and "aggregation MEAN" in refused["message"]
    for mode in ("eager", "function"):
        cut = out[f"cut_aggregated_write_{mode}"]
        assert "result" in cut, (mode, cut)
        assert cut["result"]["v"] == 7.0 and cut["result"]["loss"] == [14.0, 14.0], (mode, cut)
        assert cut["result"]["grad"] == [7.0, 7.0] and cut["result"]["warned"] >= 1, (mode, cut)
    # A value the tape recorded, summed over the replicas in a merge_call of
    # the user's own (batch_reduce_to, as tf_keras legacy optimizers sum their
    # gradients): each replica's gradient is the one TensorFlow's all_reduce
    # gives. s = 2 + 6 = 8, loss = s**2 = 64; the upstream 2 s = 16 is summed
    # over the replicas (32) and times c: d/dx = [32, 96], which sum to the
    # summed objective's 64 x = 128. To one device: refused.
    for mode in ("eager", "function"):
        reference = out[f"reduction_all_reduce_{mode}"]
        assert reference.get("result") == {"loss": [64.0, 64.0], "grad": [32.0, 96.0]}, (mode, reference)
        assert out[f"reduction_merge_call_{mode}"].get("result") == reference["result"], (mode, out)
        refused = out[f"reduction_one_device_{mode}"]
        assert refused.get("error") == "UntrackedWriteError" and "to one device" in refused["message"], (mode, refused)


def _functional_other_device():
    """The other-device programs (tests/helpers/other_device_writes.py),
    rewritten without variables: ``[d out / d lr, d out / d w]`` each."""
    from helpers.other_device_writes import LR, W0

    def grads(f):
        w, lr = tf.constant(W0), tf.constant(LR)
        with tf.GradientTape() as tape:
            tape.watch([lr, w])
            out = f(w, lr)
        return [g.numpy().tolist() for g in tape.gradient(out, [lr, w])]

    def loop(w, lr):
        for _ in range(2):
            w = w - lr * 2.0 * w
        return tf.reduce_sum(w * 3.0)

    def cond(w, lr):
        w = w - lr * w
        return tf.reduce_sum(w * 3.0 + w)

    def scatter(w, lr):
        w = tf.stack([w[0], w[0] * lr])
        return tf.reduce_sum(w * w)

    def two_writes(w, lr):
        w = w - lr * w
        w = tf.stack([w[1] * lr, w[1]])
        return tf.reduce_sum(w * w)

    step = lambda w, lr: tf.reduce_sum((w - lr * 2.0 * w) * 3.0)  # noqa: E731
    return {
        "top_level": grads(step),
        "in_cond": grads(cond),
        "in_loop": grads(loop),
        "fused_kernel": grads(step),
        "scatter": grads(scatter),
        "two_writes": grads(two_writes),
    }


def test_central_storage_strategy_meta_step_matches_one_device():
    """CentralStorageStrategy's variables are AggregatingVariables kept on one
    device: in cross-replica context, eager and compiled, the step gives the
    rewrite's meta-gradients and weights; an aggregated write in a replica's
    tape is refused by name (Known limits)."""
    from helpers.central_storage import LR, X
    from helpers.central_storage import W0 as CS_W0

    out = _helper_output("central_storage")
    assert out["type"] == "AggregatingVariable"
    d_lr, d_w, w1 = _functional(X, CS_W0, LR)
    for mode in ("eager", "function"):
        got_lr, got_w, got_w1 = out[mode]
        np.testing.assert_allclose(got_lr, d_lr, rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(got_w, d_w, rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(got_w1, w1, rtol=1e-6, err_msg=mode)
    refused = out["replica"]
    assert refused["error"] == "UntrackedWriteError", refused
    assert "cross-replica reduction" in refused["message"] and "'Variable:0'" in refused["message"], refused
    # A Keras optimizer step in a replica's tape: its update is one write of
    # the one copy, in merge_call, which no replica's tape can own. Refused,
    # before anything is written, saying what works (it said such steps work).
    for name, got in out["keras_step"].items():
        refused = got.pop("replica")
        assert isinstance(refused, dict) and refused["error"] == "UntrackedWriteError", (name, refused)
        assert refused["w"] == CS_W0, (name, refused)
        message = refused["message"]
        assert "CentralStorageStrategy" in message and "cross-replica context" in message, (name, message)
        assert "work." not in message, (name, message)
        # What it says works: the step in cross-replica context (the rewrite's).
        for mode in ("eager", "function"):
            got_lr, got_w, got_w1 = got[mode]
            np.testing.assert_allclose(got_lr, d_lr, rtol=1e-5, err_msg=f"{name} {mode}")
            np.testing.assert_allclose(got_w, d_w, rtol=1e-5, err_msg=f"{name} {mode}")
            np.testing.assert_allclose(got_w1, w1, rtol=1e-6, err_msg=f"{name} {mode}")


def test_compiled_writes_to_a_variable_on_another_device():
    """A version made in a graph is read on the variable's device, not the
    function's: compiled equals eager equals the rewrite, for a variable placed
    with tf.device and one made in OneDeviceStrategy's scope, after one write
    and after several."""
    result = _helper_output("other_device_writes")
    assert all(device.endswith("CPU:1") for device in result["placed"])
    expected = _functional_other_device()
    for placement in ("device", "one_device"):
        for name, grads in expected.items():
            for mode in ("eager", "compiled"):
                got = result[placement][f"{name}/{mode}"]
                assert not isinstance(got, str), f"{placement} {name} {mode}: {got}"
                np.testing.assert_allclose(got[0], grads[0], rtol=1e-5, err_msg=f"{placement} {name} {mode}")
                np.testing.assert_allclose(got[1], grads[1], rtol=1e-5, err_msg=f"{placement} {name} {mode}")


def test_keras_optimizer_steps_in_replica_context():
    """A Keras optimizer's apply_gradients in replica context, inside each
    replica's tape: the optimizer all-reduces the gradients (recorded on each
    replica's tape) and updates every component in a cross-replica update,
    which is a version on its own replica's tape. The replicas' meta-gradients
    sum to the single-device meta-gradient of the summed objective, and the
    components equal the single-device weights, step after step (slots and
    iteration counters carried), eager and compiled; also for trainable
    SyncOnReadVariables of every aggregation (TensorFlow updates each
    component with its replica's arguments), and for tf_keras legacy and
    tf.compat.v1.train optimizers (fused kernels; they sum the gradients in
    merge_call, and hand every replica the first replica's coefficients or
    compute them outside the replicas). Sparse legacy steps are refused
    before anything is written."""
    out = _helper_output("mirrored_optimizers")
    # Sparse (IndexedSlices) gradients, which all three families sum in
    # merge_call (TensorFlow's all_reduce gives them no gradient of its own):
    # the same rule. Keras 3's d/d table missed the second-order terms before.
    for name, got in out.pop("sparse").items():
        assert len(got["single"]) == 2 and got["single"][0] != got["single"][1]
        for mode in ("eager", "compiled"):
            assert "result" in got[mode], (name, mode, got[mode])
            for step, ((d_lr, d_table), (s_lr, s_table)) in enumerate(zip(got["single"], got[mode]["result"])):
                label = f"sparse {name} {mode} step {step}"
                np.testing.assert_allclose(s_lr, d_lr, rtol=1e-5, err_msg=label)
                np.testing.assert_allclose(s_table, d_table, rtol=1e-5, atol=1e-5, err_msg=label)
    # Each replica its own sparse SGD step (no aggregation): d sum(t) / d lr =
    # -sum(2 t[rows]) = -2 (1 + 2 + 5 + 6). Was: AttributeError inside tf_keras.
    assert out.pop("sparse_unaggregated").get("result") == [-28.0, -28.0]
    # A plain tape around each replica's AssignAwareTape follows the step too
    # (it got None: the update ran as the replica on its AssignAwareTapes only).
    for name, got in out.pop("plain_around").items():
        for mode in ("eager", "compiled"):
            assert "result" in got[mode], (name, mode, got[mode])
            np.testing.assert_allclose(
                got[mode]["result"], out[name]["single"][0][0], rtol=1e-5, err_msg=f"{name} {mode}"
            )
    legacy = [name for name in out if name.startswith(("legacy_", "v1_"))]
    assert len(legacy) == 12
    for name in (
        "SGD",
        "SGD_momentum",
        "Adam",
        "RMSprop",
        "SGD_on_read_none",
        "SGD_on_read_sum",
        "SGD_on_read_mean",
        *legacy,
    ):
        single = out[name]["single"]
        assert single[0][0] != single[1][0]  # the steps differ
        for mode in ("eager", "compiled"):
            got = out[name][mode]
            assert "result" in got, (name, mode, got)
            for step, ((d_lr, d_w, w1), (s_lr, s_w, c)) in enumerate(zip(single, got["result"])):
                label = f"{name} {mode} step {step}"
                np.testing.assert_allclose(s_lr, d_lr, rtol=1e-5, err_msg=label)
                np.testing.assert_allclose(s_w, d_w, rtol=1e-5, atol=1e-6, err_msg=label)
                for component in c:
                    np.testing.assert_allclose(component, w1, rtol=1e-6, err_msg=label)


def test_fit_under_mirrored_strategy_equals_one_device():
    """``fit`` whose train_step steps an inner Keras SGD inside the tape and a
    learned learning rate after it: under MirroredStrategy (eager and
    compiled) the learning rate and the weights after an epoch equal one
    device's on the same batches."""
    out = _helper_output("mirrored_fit")
    single = out["single"]
    assert single["lr"] != 0.05
    for mode in ("eager", "compiled"):
        got = out[mode]
        assert "error" not in got, (mode, got)
        np.testing.assert_allclose(got["lr"], single["lr"], rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(got["kernel"], single["kernel"], rtol=1e-5, err_msg=mode)


def test_hypergradient_example_under_mirrored_strategy_equals_one_device():
    """``python -m assigntape.examples.hypergradient_lr --strategy mirrored``:
    SGD-HD trained with ``fit`` under MirroredStrategy on two logical CPUs gives,
    step after step, the learning rates of ``fit`` on one device, and both
    those of the example's plain step loop on the same batches (compiled and
    eagerly)."""
    out = _helper_output("hypergradient_mirrored")
    reference = np.array(out["run"])
    assert reference[-1] > 1.5 * reference[0]  # the rate really moves
    for mode in ("compiled", "eager"):
        rates = out[mode]
        assert len(rates["mirrored"]) == len(reference), mode
        np.testing.assert_allclose(rates["one device"], reference, rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(rates["mirrored"], reference, rtol=1e-5, err_msg=mode)


def test_inner_loop_of_optimizer_steps_with_slots_in_one_tape():
    """Two optimizer steps with slots in ONE tape per replica (an inner loop),
    and a single AdamW step (its weight decay writes before the update), under
    MirroredStrategy, eager and compiled: the optimizers find their slots
    after a write (the version handle carries ``_distributed_container``, and
    ``v.op`` is the variable's own), and the replicas' meta-gradients sum to
    the single-device meta-gradient of the summed objective; for Keras SGD
    with Nesterov momentum, to the rewrite's. Were: KeyError (Keras 3),
    AttributeError (tf_keras legacy, tf.compat.v1), before any gradient."""
    out = _helper_output("mirrored_inner_loop")
    rewrite = out.pop("rewrite_SGD_momentum")
    np.testing.assert_allclose(out["SGD_momentum"]["single"][0], rewrite[0], rtol=1e-5)
    assert len(out) == 9
    for name, got in out.items():
        d_lr, d_w, w1 = got["single"]
        for mode in ("eager", "compiled"):
            assert "result" in got[mode], (name, mode, got[mode])
            s_lr, s_w, components = got[mode]["result"]
            label = f"{name} {mode}"
            np.testing.assert_allclose(s_lr, d_lr, rtol=1e-5, err_msg=label)
            np.testing.assert_allclose(s_w, d_w, rtol=1e-5, atol=1e-6, err_msg=label)
            for component in components:
                np.testing.assert_allclose(component, w1, rtol=1e-6, err_msg=label)
            if name == "SGD_momentum":  # the rewrite, not the code under test
                np.testing.assert_allclose(s_lr, rewrite[0], rtol=1e-5, err_msg=label)
                np.testing.assert_allclose(s_w, rewrite[1], rtol=1e-5, atol=1e-6, err_msg=label)
                np.testing.assert_allclose(components[0], rewrite[2], rtol=1e-6, err_msg=label)


def _hypergradient_steps(steps=3, meanwhile=lambda: None):
    """Keras SGD(momentum=0.5) steps on w = [1, 2], loss sum(w^2), each in a tape
    of its own: d sum(w) / d lr after each step. Hand derivation (g = 2w, the
    slot m a variable: its value only, from the tape's start): m' = 0.5 m -
    2 lr w, w' = w + m', so d sum(w')/d lr = -2 sum(w) = -6, then -4.8 (w =
    0.8 w0), then -3.24 (w = 0.54 w0)."""
    import keras

    from assigntape import AssignAwareTape

    w, lr = tf.Variable([1.0, 2.0]), tf.Variable(0.1)
    optimizer = keras.optimizers.SGD(learning_rate=lambda: lr * 1.0, momentum=0.5)
    optimizer.build([w])
    out = []
    for _ in range(steps):
        with AssignAwareTape() as outer:
            meanwhile()  # (the other thread's tape is open too)
            with tf.GradientTape() as inner:
                loss = tf.reduce_sum(w**2)
            optimizer.apply_gradients([(inner.gradient(loss, w), w)])
            val = tf.reduce_sum(w)
        out.append(float(outer.gradient(val, lr)))
    return out


HYPERGRADIENTS = [-6.0, -4.8, -3.24]


def test_a_plain_optimizer_step_beside_another_threads_tape_is_a_plain_step():
    """No strategy: a Keras optimizer step on the main thread's own variables
    (outside every tape here, then inside one) while another thread has a tape
    open is this thread's write, not a cross-replica update for replicas that
    do not exist. Was: UntrackedWriteError "cross-replica update ... in a
    replica"."""
    import keras
    from oracle import tape_open_in_another_thread

    with tape_open_in_another_thread():
        w = tf.Variable([1.0, 2.0])
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build([w])
        optimizer.apply_gradients([(tf.constant([1.0, 1.0]), w)])
        np.testing.assert_allclose(w.numpy(), [0.9, 1.9], rtol=1e-6)  # plain TensorFlow
        np.testing.assert_allclose(_hypergradient_steps(), HYPERGRADIENTS, rtol=1e-5)


def test_two_threads_each_with_a_hypergradient_step_on_their_own_variables():
    """Two threads, no strategy, each a Keras optimizer step inside its own
    tape: neither is taken for the other's replica. Was: UntrackedWriteError
    in one of them."""
    import threading

    results = {}
    both_open = threading.Barrier(2, timeout=60)

    def worker(k):
        try:
            results[k] = _hypergradient_steps(meanwhile=both_open.wait)
        except Exception as e:  # noqa: BLE001 - the test looks at what was raised
            results[k] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for k in range(2):
        assert not isinstance(results[k], str), results[k]
        np.testing.assert_allclose(results[k], HYPERGRADIENTS, rtol=1e-5)


def test_keras_loss_scale_optimizer_under_mirrored_strategy():
    """Keras 3's LossScaleOptimizer steps its inner optimizer through
    call_for_each_replica inside merge_call: a second set of replica threads,
    run as their replicas. Eager, its meta-gradient is the second-order one:
    SGD's equals the rewrite's, Adam's two steps in one tape equal one
    device's. Was: d/d lr None, d/d w first-order only (silently). Compiled,
    the update is made in a tf.cond built in merge_call: refused, with the
    way out."""
    out = _helper_output("mirrored_loss_scale")
    rewrite = out.pop("rewrite_SGD")
    np.testing.assert_allclose(out["SGD"]["single"][0], rewrite[0], rtol=1e-5)
    for name, expected in (("SGD", rewrite), ("Adam", out["Adam"]["single"])):
        got = out[name]["eager"]
        assert "result" in got, (name, got)
        np.testing.assert_allclose(got["result"][0], expected[0], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(got["result"][1], expected[1], rtol=1e-5, atol=1e-6, err_msg=name)
        compiled = out[name]["compiled"]
        assert compiled.get("error") == "UntrackedWriteError", (name, compiled)
        assert "LossScaleOptimizer" in compiled["message"] and "run_functions_eagerly" in compiled["message"]


def test_forward_accumulators_in_replicas():
    """A ForwardAccumulator in a replica around an all_reduce, an
    AssignAwareTape inside or around it, no write: eagerly TensorFlow's
    results, the same as with a plain tf.GradientTape. By hand: y = x0^2 +
    x1^2 summed over the replicas, each x = 2 with tangent 1, so jvp = 2*2 +
    2*2 = 8, and dy/dx = 2x times the all-reduced upstream gradient (2) = 8.
    Was: AttributeError 'ForwardAccumulator' object has no attribute
    '_tape'. Compiled, TensorFlow's forward mode gives the graph all-reduce
    no tangent (jvp 0 with a plain tape): with ours, refused. And through a
    Keras step in the replica, forward equals reverse; with the tangent
    along the data, which the all-reduced gradients depend on, the compiled
    step is refused (was: the jvp without the all-reduce's tangent)."""
    out = _helper_output("mirrored_forward")
    # A Keras step's update, made in merge_call as each replica, is recorded
    # on that replica's accumulators too: each replica's jvp along lr equals
    # its reverse d/d lr, and they sum to the rewrite's (was: jvp None).
    rewrite = out.pop("rewrite_d_lr")
    for mode, got in out.pop("keras_step").items():
        assert "result" in got, (mode, got)
        for jvp, grad in got["result"]:
            np.testing.assert_allclose(jvp, grad, rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(sum(g for _, g in got["result"]), rewrite, rtol=1e-5, err_msg=mode)
    along_data = out.pop("keras_step_data_tangent")
    assert "result" in along_data["eager"], along_data
    assert along_data["compiled"].get("error") == "ControlFlowWriteError", along_data
    for label, got in out.items():
        if label.startswith("aware") and label.endswith("compiled"):
            assert got.get("error") == "ControlFlowWriteError", (label, got)
            assert "all-reduce" in got["message"] and "eagerly" in got["message"], label
            continue
        assert "result" in got, (label, got)
        if label.endswith("eager"):
            assert got["result"] == [[8.0, 8.0], [8.0, 8.0]], (label, got)
        if label.startswith("aware"):
            assert got["result"] == out[label.replace("aware", "plain")]["result"], label


def test_watched_variables_in_replicas_are_tensorflows_list():
    """watched_variables() in each replica after an optimizer step inside the
    tapes (its update made in merge_call, as each replica), for an
    AssignAwareTape and the plain tape around it that it follows, eager and
    compiled: the MirroredVariables c, a, b, each once, in TensorFlow's order,
    the very objects a plain tf.GradientTape alone lists. Was: replica 1
    listed its components a/replica_1 and b/replica_1 as well (Keras 3's
    optimizers and LossScaleOptimizer), with their gradients again. The
    gradients w.r.t. the list, summed over the replicas, equal the
    assignment-free rewrite's. And a variable first watched through a version
    (written unrecorded, then read) keeps its place: was listed after b."""
    out = _helper_output("mirrored_watched")
    for name in ("keras_SGD_momentum", "keras_LossScale_SGD", "legacy_SGD_momentum", "v1_Momentum"):
        rewrite = out[f"{name}/rewrite"]
        modes = ("eager",) if name == "keras_LossScale_SGD" else ("eager", "compiled")
        for mode in modes:
            plain, ours = out[f"{name}/{mode}/plain"], out[f"{name}/{mode}/ours"]
            assert plain["tape"] == plain["plain"] == [[0, 1, 2]] * len(plain["tape"]), (name, mode, plain)
            assert ours["tape"] == ours["plain"] == plain["tape"], (name, mode, ours)
            summed = np.sum(ours["grads"], axis=0)
            np.testing.assert_allclose(summed, rewrite, rtol=1e-5, err_msg=f"{name} {mode}")
    for mode in ("eager", "compiled"):
        assert out[f"order/{mode}/plain"] == [[0, 1], [0, 1]], out[f"order/{mode}/plain"]
        assert out[f"order/{mode}/ours"] == out[f"order/{mode}/plain"], (mode, out[f"order/{mode}/ours"])
    assert out["resolver_is_tensorflows"]  # TensorFlow's own again once no thread acts for a replica


def test_forward_mode_through_a_merge_call_reduction_of_ones_own_is_refused():
    """An AssignAwareTape and a ForwardAccumulator (ours or TensorFlow's) in
    each replica, a merge_call of one's own summing a value the tape recorded
    (batch_reduce_to), eager and compiled: forward mode cannot follow the
    reduction made in the cross-replica context (plain TensorFlow gives a
    None jvp there), so it is refused, naming the merge_call and what to do,
    before anything is reduced; a fresh tape after works (d(2 lr)/d lr = 2).
    Was: AttributeError 'NoneType' object has no attribute 'all_reduce'."""
    out = _helper_output("mirrored_forward_merge")
    for label, got in out.items():
        assert got.get("error") == "ControlFlowWriteError", (label, got)
        message = got["message"]
        assert "merge_call" in message and "batch_reduce_to" in message, label
        assert "get_replica_context().all_reduce" in message and "tape alone" in message, label
        assert got["fresh"] == 2.0, label


def test_forward_accumulator_in_replicas_leaves_the_reverse_gradient_alone():
    """Two Keras 3 steps (SGD with momentum, Adam, LossScaleOptimizer) in each
    replica, eagerly, with an AssignAwareTape and a ForwardAccumulator (ours or
    TensorFlow's, inside the tape or around it), the steps inline or in a
    nested function: each replica's jvp along lr equals the finite
    differences of its objective, and the replicas' reverse d/d lr sum to the
    finite differences of the summed objective (semantics section 12). Was,
    with the accumulator inside the tape and the steps nested: SGD momentum's
    reverse [76.61, 153.22] (sum 229.8) instead of summing to 108.86 (the
    tape's TensorFlow nesting number, taken again when merge_call pushed it
    in the main thread, put it inside the accumulator, so the all-reduce the
    accumulator differentiated went unrecorded on it)."""
    out = _helper_output("mirrored_forward_reverse")
    for optimizer, cases in out["cases"].items():
        fd = out["fd"][optimizer]
        for label, got in cases:
            assert "result" in got, (label, got)
            jvps = [jvp for jvp, _ in got["result"]]
            np.testing.assert_allclose(jvps, fd, rtol=2e-3, err_msg=label)
            total = sum(grad for _, grad in got["result"])
            np.testing.assert_allclose(total, sum(fd), rtol=2e-3, err_msg=label)
