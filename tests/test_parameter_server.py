"""ParameterServerStrategy: an in-process cluster on loopback (2 workers, 2
parameter servers, tests/helpers/parameter_server.py, a fresh process), a
Meta-SGD step scheduled on a worker through a ClusterCoordinator, with the
default (cached, aggregating) variables and with variables split in shards.
The meta-gradients and the written weights equal the single-device step's."""

from __future__ import annotations

import numpy as np
from helpers.parameter_server import LR, W0, X
from test_distribute import _functional, _helper_output


def test_parameter_server_meta_step():
    out = _helper_output("parameter_server")
    assert out["plain/kind"] != "ResourceVariable" and out["sharded/kind"] == "ShardedVariable"
    d_lr, d_w, w1 = _functional(X, W0, LR)
    for label in ("plain", "sharded"):
        got = out[f"{label}/step"]
        assert "result" in got, (label, got)
        got_lr, got_w, read_on_worker, on_ps = got["result"]
        np.testing.assert_allclose(got_lr, d_lr, rtol=1e-5, err_msg=label)
        np.testing.assert_allclose(got_w, d_w, rtol=1e-5, atol=1e-6, err_msg=label)
        np.testing.assert_allclose(read_on_worker, w1, rtol=1e-6, err_msg=label)  # the worker reads the version
        np.testing.assert_allclose(on_ps, w1, rtol=1e-6, err_msg=label)  # and the servers hold it
    # One shard written directly: w = [lr w0[:2], w0[2:]], loss = sum(w x).
    d_lr, d_shards = out["sharded/shard_write"]["result"]
    np.testing.assert_allclose(d_lr, np.dot(W0[:2], X[:2]), rtol=1e-6)
    np.testing.assert_allclose(d_shards, [LR * X[0], LR * X[1], X[2], X[3]], rtol=1e-6)
    # The whole ShardedVariable as a source: a clear error naming the fix
    # (TensorFlow's own tapes raise an AttributeError there).
    refused = out["sharded/whole_as_source"]
    assert refused.get("error") == "NotAVariableError", refused
    assert "ShardedVariable" in refused["message"] and "v.variables" in refused["message"]
