"""Programs run in fresh processes by the tests (logical devices and clusters
must be set up before TensorFlow starts), and what they share."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, List

ROOT = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> List[int]:
    """``n`` TCP ports on 127.0.0.1 that are free now."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def helper_output(module: str) -> Any:
    """Runs ``tests/helpers/<module>`` in a fresh process, with this
    checkout's ``assigntape``; its last line, as JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    done = subprocess.run(
        [sys.executable, "-m", f"helpers.{module}"],
        cwd=ROOT / "tests",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
