"""A signal's handler (Ctrl-C's ``KeyboardInterrupt``) never raises inside
the ``_handle`` descriptor, which TensorFlow's C++ fast path calls and which
must not raise (``assigntape/_signals.py``): it runs once the main thread has
left it, and the next tape is right.

(TensorFlow itself can die with SIGSEGV when a ``KeyboardInterrupt`` lands in
its own Python code called from its C++, with no assigntape imported; that is
not tested here. What is: the window assigntape's descriptor adds.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import tensorflow as tf

from assigntape import AssignAwareTape, _patches, uninstall

# Each of a tape step's first N calls of the descriptor in turn gets the
# signal at its first instruction (a trace function raises it on the
# descriptor's "call" event; Python runs the handler at the next instruction,
# inside the descriptor, called from C++).
_AT_THE_DESCRIPTOR = """
    import os, sys, signal, time, faulthandler
    faulthandler.enable()
    import tensorflow as tf
    from assigntape import AssignAwareTape
    try:
        from assigntape import _serving as where
    except ImportError:
        from assigntape import _versions as where
    GET = where.HandleDescriptor.__get__.__code__
    v = tf.Variable([1.5, -0.5]); x = tf.Variable(0.7)
    armed = [0]

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code is GET and armed[0]:
            armed[0] -= 1
            if armed[0] == 0:
                signal.raise_signal(signal.SIGINT)  # the default handler: KeyboardInterrupt
        return None

    interrupted = 0
    for n in range(1, 31):
        v.assign([1.5, -0.5])
        try:
            armed[0] = n
            sys.settrace(tracer)
            try:
                with AssignAwareTape() as t:
                    v.assign(v * x)
                    y = tf.reduce_sum(v * v)
                t.gradient(y, x)
                time.sleep(0.05)  # a signal sent again arrives by now
            finally:
                sys.settrace(None)
        except KeyboardInterrupt:
            interrupted += 1
    with AssignAwareTape() as t:
        v.assign([1.5, -0.5])
        v.assign(v * x)
        y = tf.reduce_sum(v * v)
    # The rewrite: y = x^2 (1.5^2 + 0.5^2) = 2.5 x^2, dy/dx = 5 x = 3.5.
    print("INTERRUPTED", interrupted, "NEXT", float(t.gradient(y, x)), flush=True)
"""


def test_a_signal_at_the_descriptors_first_instruction_waits_for_it_to_return():
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_AT_THE_DESCRIPTOR)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"the process died ({done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}"
    words = done.stdout.split()
    interrupted, grad = int(words[words.index("INTERRUPTED") + 1]), float(words[words.index("NEXT") + 1])
    assert interrupted >= 10, done.stdout  # each signal delivered (later), not lost
    assert abs(grad - 3.5) < 1e-5, done.stdout


def test_handlers_are_seen_as_set_and_put_back_by_uninstall():
    def mine(signum, frame):  # pragma: no cover - never called
        pass

    with AssignAwareTape():
        pass
    assert _patches.installed()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGUSR1, mine)
    try:
        assert signal.getsignal(signal.SIGUSR1) is mine
        assert signal.signal(signal.SIGUSR1, mine) is mine
        uninstall()
        # TensorFlow's and Python's own again: nothing of assigntape's left.
        assert signal.getsignal(signal.SIGUSR1) is mine and signal.getsignal.__module__ in ("signal", "_signal")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGUSR1, previous)
    v = tf.Variable(2.0)
    with AssignAwareTape() as tape:  # installed again
        v.assign(v * 3.0)
        y = v * v
    assert float(tape.gradient(y, v)) == 36.0  # y = 9 v0^2: 18 v0
