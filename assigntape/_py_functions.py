"""``tf.py_function`` / ``tf.numpy_function`` in the graph of a tape.

Eagerly, the Python body runs there and then, in the tape's thread, and its
writes are followed like any other. Traced in a tape's graph, the body runs
only when the graph runs, after the tape was built, in one of TensorFlow's
threads: the tape cannot follow a write made there, and reads after it
would credit the version from before. What the body will write is unknown
while tracing, so the body is run under a probing tape, and a write of a
differentiable variable there fails the graph's run with
``UntrackedWriteError`` (TensorFlow reports it as its own ``UnknownError``,
the message included; the write has happened by then).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from assigntape import _versions
from assigntape._errors import UntrackedWriteError
from assigntape._wrapping import bind

__all__ = ["py_function"]

_PARAMS = ("func", "inp", "Tout", "stateful", "use_eager_py_func", "is_grad_func", "name")


def py_function(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``script_ops._internal_py_func``, which every py_function, numpy_function
    and py_func builds through."""
    found = _versions.call_context()
    if found is None or found[0].key is None:
        return wrapped(*args, **kwargs)  # eager: the body runs here, followed
    arguments = bind(_PARAMS, args, kwargs)
    arguments["func"] = _probed(arguments["func"])
    return wrapped(**arguments)


def _probed(func: Callable[..., Any]) -> Callable[..., Any]:
    name = getattr(func, "__name__", repr(func))

    @functools.wraps(func)
    def run(*args: Any) -> Any:
        from assigntape._tape import AssignAwareTape  # (the tape needs the patches, which need this)

        with AssignAwareTape(persistent=True, watch_accessed_variables=False) as probe:
            result = func(*args)
        written = sorted(probe.history().variables)
        # A closed persistent tape holds the patches while it lives, and the
        # error's traceback (which TensorFlow may keep) holds this frame.
        del probe
        if written:
            raise UntrackedWriteError(
                f"The Python function {name!r} of a tf.py_function / tf.numpy_function wrote "
                f"variable(s) {', '.join(written)} while the graph of a tf.function ran, and an "
                "AssignAwareTape was open where that graph was traced: the body runs only when "
                "the graph runs, out of the tape's sight, so reads after it would credit the "
                "previous version, a silently wrong gradient. Make the write in the tape's own "
                "code, outside the py_function, or run the step eagerly "
                "(tf.config.run_functions_eagerly(True)), where a py_function's writes are followed."
            )
        return result

    return run
