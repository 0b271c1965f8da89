"""What the examples share: their command line, the end of their report, and
plots, when matplotlib is there."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Callable, Dict, List, Optional

__all__ = ["parser", "number", "footer", "run_and_print", "pyplot", "save"]


def parser(name: str, doc: Optional[str], plot: Optional[str], eager_help: str) -> argparse.ArgumentParser:
    """An example's argument parser, with the options every example has:
    ``--eager``, ``--plot`` and ``--quiet``."""
    p = argparse.ArgumentParser(prog=f"python -m assigntape.examples.{name}", description=(doc or "").split("\n")[0])
    p.add_argument("--eager", action="store_true", help=eager_help)
    p.add_argument("--plot", default=plot, help="PNG path, or '' for none")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def number(value: float, spec: str, width: int = 0) -> str:
    """``value`` formatted by ``spec``, or ``diverged`` where it is not finite:
    a NaN or an infinity in a results table means the run blew up, and a reader
    should be told so in words."""
    text = format(value, spec) if math.isfinite(value) else "diverged"
    return f"{text:>{width}}"


def footer(results: Dict[str, Any]) -> List[str]:
    """The last lines of a report: the time taken, and where the plot went."""
    lines = [f"in {results['seconds']:.0f} s"]
    if results.get("plot"):
        lines.append(f"plot: {results['plot']}")
    return lines


def run_and_print(
    run: Callable[[Any], Dict[str, Any]], report: Callable[[Dict[str, Any]], str], config: Any
) -> Dict[str, Any]:
    """Runs an example's configuration and prints its report."""
    results = run(config)
    print()
    print(report(results))
    return results


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
