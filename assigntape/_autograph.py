"""Keep AutoGraph out of assigntape's own code.

AutoGraph converts every Python function a ``tf.function`` calls unless the
function's module matches one of its do-not-convert rules, which cover
TensorFlow and Keras but not us. Converted, the tape's methods would be re-read
from source, rewritten and re-run on every trace: slower, and exposed to
AutoGraph's limits (it rewrites ``if`` on Python values, descriptors and
generators). The library has no tensor-dependent Python control flow to convert,
so it asks to be called as it is, like TensorFlow's own modules.
"""

from __future__ import annotations

from assigntape._tf import config, config_lib

__all__ = ["exclude"]

# The private modules only: the examples are user code, and convert as such.
_MODULES = (
    "assigntape._tape",
    "assigntape._diagnostics",
    "assigntape._patches",
    "assigntape._versions",
    # The version store's neighbours: the handle descriptor and the refusals run in user code's traces.
    "assigntape._registry",
    "assigntape._resolve",
    "assigntape._branches",
    "assigntape._refusals",
    "assigntape._resuming",
    "assigntape._threads",
    "assigntape._serving",
    "assigntape._rules",
    # ``ops.convert_to_tensor`` while a tape is open (user code in a
    # tf.function calls it as TensorFlow's, which AutoGraph leaves alone).
    "assigntape._short_paths",
)


def exclude() -> None:
    """Prepends do-not-convert rules for our modules (once)."""
    present = {getattr(rule, "_prefix", None) for rule in config.CONVERSION_RULES}
    rules = tuple(config_lib.DoNotConvert(m) for m in _MODULES if m not in present)
    config.CONVERSION_RULES = rules + tuple(config.CONVERSION_RULES)
