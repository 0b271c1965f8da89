"""What the examples share: plots, when matplotlib is there."""

from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["pyplot", "save"]


def pyplot() -> Optional[Any]:
    """``matplotlib.pyplot`` on a file-only backend, or None (with a note) without it."""
    try:
        import matplotlib
    except ImportError:
        print('(no plot: matplotlib is not installed; pip install "assigntape[examples]")')
        return None
    # No screen is needed, or wanted, to write a PNG.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str) -> str:
    """Writes ``fig`` to ``path`` as PNG, closes it, and returns the absolute path."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return os.path.abspath(path)
