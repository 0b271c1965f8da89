"""Rule 9 for a recorder entered again, of every kind: another thread's write
to a variable the recorder read in an earlier entry, made after the re-entry
and before it reads the variable again, is refused, as in its first entry (an
AssignAwareTape entered again already refused it). Allowed, the recorder
credited the variable's start version with a value it did not read: the
rewrite's u at entry was overwritten by a write this thread did not make
(dy/du None, jvp 0), while ours said 2.0 (x)."""

from __future__ import annotations

import threading
from typing import Any, List

import pytest
import tensorflow as tf

import assigntape
from assigntape import AssignAwareTape, UntrackedWriteError


def _write_from_another_thread(var: Any, value: float) -> List[BaseException]:
    errors: List[BaseException] = []

    def run() -> None:
        try:
            var.assign(value)
        except BaseException as error:  # noqa: B036 - reported to the test's thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return errors


def _recorder(kind: str, u: Any, x: Any, v: Any) -> Any:
    """A recorder of ``kind`` that read u in its first entry (beside a tape of
    ours, for the plain kinds), closed since."""
    r: Any
    if kind == "forward":
        r = assigntape.ForwardAccumulator(u, tf.constant(1.0))
        with r:
            _ = u * x
        return r
    r = tf.GradientTape(persistent=True) if kind == "plain" else tf.autodiff.ForwardAccumulator(u, tf.constant(1.0))
    with r:
        with AssignAwareTape():
            _ = u * x
            v.assign(3.0 * x)
    return r


@pytest.mark.parametrize("kind", ["forward", "plain", "tf_accumulator"])
def test_another_threads_write_after_a_reentry_is_refused(kind: str) -> None:
    x, u, v = tf.Variable(2.0), tf.Variable(1.0), tf.Variable(1.0)
    r = _recorder(kind, u, x, v)
    with r:
        errors = _write_from_another_thread(u, 7.0)
        _ = u * x
    assert len(errors) == 1 and isinstance(errors[0], UntrackedWriteError), errors
    assert float(u.numpy()) == 1.0  # a refused write leaves the variable as it was
