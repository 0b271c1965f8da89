"""Shared test set-up: quiet TensorFlow, hypothesis profiles, eager/compiled modes."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hypothesis import HealthCheck, settings  # noqa: E402

# "ci" is bounded for the 2-core CI machine and derandomized so that a run is
# reproducible; "thorough" explores more and at random:
#   HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_programs.py
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402
from tensorflow.python.ops import variable_scope  # noqa: E402


@pytest.fixture(autouse=True)
def _no_tensorflow_state_left() -> object:
    """Every test leaves TensorFlow's process-wide state as it found it.

    An error raised inside a TensorFlow builder that sets state and puts it
    back only on success (``tf.map_fn``'s caching device on the variable
    scope) once broke every later strategy scope in the run, far from the
    test that left it. Here the test that leaves it fails, and the state is
    put back so that the tests after it are not affected.
    """
    yield
    left = []
    scope = variable_scope.get_variable_scope()
    if scope.caching_device is not None:
        left.append(f"the variable scope's caching device ({scope.caching_device!r})")
        scope._caching_device = None  # (set_caching_device refuses eagerly)
    if not context.executing_eagerly():
        left.append("a graph as the default (eager execution off)")
    callbacks = context.context().op_callbacks
    if callbacks:
        left.append(f"op callbacks ({callbacks!r})")
        for callback in list(callbacks):
            context.context().remove_op_callback(callback)
    if tf.distribute.has_strategy():
        left.append(f"a strategy scope ({tf.distribute.get_strategy()!r})")
    assert not left, "the test left TensorFlow's state changed: " + "; ".join(left)
