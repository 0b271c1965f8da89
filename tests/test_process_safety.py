"""The process never crashes, and an interrupted tape does not corrupt it.

* Nothing of the library that TensorFlow's C++ code calls raises (the
  ``_handle`` descriptor, looked up by the eager fast path): a refused read
  there fails the op cleanly with the library's error. The programs run in a
  subprocess, so that a crash fails the test instead of killing pytest.
* An exception landing anywhere in a tape's ``__enter__`` / ``__exit__``
  (a ``KeyboardInterrupt`` from a signal handler) leaves the global state as
  it was before the call (a sweep over every line executed, ``sys.settrace``).
* A forked child is not bound by tapes of threads that do not exist in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(source: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True, timeout=timeout, env=env
    )


def _lines(out: str, prefix: str) -> List[str]:
    return [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]


# A variable made before assigntape's first tape (so no tape can name its
# handle), written through that handle inside a tape, then read by ops whose
# eager fast path reads ``v._handle`` in C++ (and, for comparison, by Python
# paths): each read must raise UntrackedWriteError, and the process go on.
_UNNAMED_READS = """
    import sys
    import numpy as np
    import tensorflow as tf
    from assigntape import AssignAwareTape, UntrackedWriteError, uninstall

    READS = {
        "relu": lambda c: tf.nn.relu(c),
        "einsum": lambda c: tf.einsum("ij,jk->ik", c, c),
        "concat": lambda c: tf.concat([c, c], 0),
        "matvec": lambda c: tf.linalg.matvec(c, [1.0, 2.0]),
        "reduce_sum": lambda c: tf.reduce_sum(c),
        "gather": lambda c: tf.gather(c, [1, 0]),
        "stack": lambda c: tf.stack([c, c]),
        "bias_add": lambda c: tf.nn.bias_add(c, [1.0, 2.0]),
        "matmul": lambda c: tf.matmul(c, c),
        "square": lambda c: tf.square(c),
        "operator": lambda c: c * 2.0,
        "handle": lambda c: tf.raw_ops.ReadVariableOp(resource=c.handle, dtype=tf.float32),
        "function": lambda c: tf.function(lambda: tf.nn.relu(c))(),
    }
    for name, read in READS.items():
        for mode in ("eager", "function"):
            uninstall()
            x = tf.Variable(2.0)
            c = tf.Variable([[1.5, 2.0], [1.0, 3.0]], name="made_before_" + name)
            handle = c.handle

            def program():
                with AssignAwareTape() as tape:
                    tf.raw_ops.AssignVariableOp(resource=handle, value=x * tf.ones([2, 2]))
                    y = read(c)
                return tape.gradient(y, x)

            try:
                program() if mode == "eager" else tf.function(program)()
                print(f"CASE {name} {mode} no error", flush=True)
            except UntrackedWriteError as e:
                ok = f"made_before_{name}" in str(e) and "could name" in str(e)
                print(f"CASE {name} {mode} {'refused' if ok else 'unclear: ' + str(e)[:200]}", flush=True)
            except Exception as e:
                print(f"CASE {name} {mode} other error {type(e).__name__}: {str(e)[:200]}", flush=True)
            # The tape closed cleanly: the next one differentiates through a
            # write (the rewrite: y = (3a)^2, dy/da = 18a = 36), and nothing
            # is left open.
            a, w = tf.Variable(2.0), tf.Variable(0.0)
            with AssignAwareTape() as tape:
                w.assign(3.0 * a)
                y = w * w
            grad = float(tape.gradient(y, a))
            uninstall()
            print(f"AFTER {name} {mode} {grad} {w.handle is w.__dict__['_handle']}", flush=True)
    print("DONE", flush=True)
"""


def test_a_refused_read_in_tensorflows_fast_path_raises_and_does_not_crash():
    done = _run_python(_UNNAMED_READS)
    assert done.returncode == 0, f"the process died ({done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}"
    cases = _lines(done.stdout, "CASE ")
    assert len(cases) == 26 and "DONE" in done.stdout, done.stdout
    assert all(line.endswith(" refused") for line in cases), cases
    after = _lines(done.stdout, "AFTER ")
    assert all(line.endswith(" 36.0 True") for line in after), after


# Another thread has tapes open (ours, a plain tape around it, one of ours
# closed inside it, an accumulator) that read and wrote ``v``, when the main
# thread forks. In the child, which has only the forking thread: a write of
# ``v`` outside every tape is plain TensorFlow, a tape differentiates through
# a write as the rewrite does, and uninstall() succeeds. The child reports by
# its exit code (a bit per failed check) and its output.
_FORK = """
    import os, sys, threading, time
    import tensorflow as tf
    from assigntape import AssignAwareTape, uninstall

    v = tf.Variable(1.0)
    opened, finish = threading.Event(), threading.Event()

    def worker():
        with tf.autodiff.ForwardAccumulator(v, tf.constant(1.0)):
            with tf.GradientTape() as outer:
                with AssignAwareTape() as closed:
                    v.assign(v * 2.0)
                with AssignAwareTape() as tape:
                    y = v * 3.0
                    opened.set()
                    finish.wait()

    thread = threading.Thread(target=worker)
    thread.start()
    opened.wait()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            v.assign(5.0)
            if float(v.read_value()) != 5.0:
                code |= 1
        except Exception as e:
            print("CHILD write:", type(e).__name__, e, flush=True)
            code |= 1
        try:
            a, w = tf.Variable(2.0), tf.Variable(0.0)
            with AssignAwareTape() as tape:
                w.assign(3.0 * a)
                v.assign(w + 1.0)
                y = w * v
            # The rewrite: w = 3a, v = w + 1, y = w v: dy/da = 3 (v + w) = 3 (13) = 39.
            if float(tape.gradient(y, a)) != 39.0:
                code |= 2
            del tape
        except Exception as e:
            print("CHILD tape:", type(e).__name__, e, flush=True)
            code |= 2
        try:
            uninstall()
        except Exception as e:
            print("CHILD uninstall:", type(e).__name__, e, flush=True)
            code |= 4
        os._exit(code)
    deadline = time.monotonic() + 240
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            done, status = os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    print("CHILD EXIT", os.waitstatus_to_exitcode(status), flush=True)
    # The parent is unaffected: its thread's tapes close as usual.
    finish.set()
    thread.join()
    uninstall()
    print("PARENT OK", flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
def test_a_forked_child_is_not_bound_by_tapes_of_threads_it_does_not_have():
    done = _run_python(_FORK)
    assert done.returncode == 0, f"{done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "CHILD EXIT 0" in done.stdout and "PARENT OK" in done.stdout, done.stdout
