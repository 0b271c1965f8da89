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
