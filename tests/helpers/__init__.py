"""Programs run in fresh processes by the tests (logical devices and clusters
must be set up before TensorFlow starts), and what they share."""

from __future__ import annotations

import socket
from typing import List


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
