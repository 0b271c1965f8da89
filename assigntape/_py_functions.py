"""``tf.py_function`` / ``tf.numpy_function`` in a graph traced under a tape.

Eagerly, the Python body runs there and then, in the tape's thread, and its
writes are followed like any other. Traced in a graph while a tape is open in
the tracing thread (the tape's own graph, or a ``tf.function`` an eager tape
calls), the body runs only when the graph runs, in one of TensorFlow's
threads: the tape cannot follow a write made there, and reads after it would
credit the version from before (or, for a variable the tape had not read
yet, the write would pass for another thread's and lose its path). What the
body will write is unknown while tracing, so the body is run under a probing
tape, and a write of a differentiable variable there, while a tape of ours is
open, fails the graph's run with ``UntrackedWriteError`` (TensorFlow reports
it as its own ``UnknownError``, the message included; the write has happened
by then).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from assigntape import _functions, _versions
from assigntape._errors import UntrackedWriteError
from assigntape._tf import executing_eagerly, ops
from assigntape._wrapping import bind

__all__ = ["py_function"]

_PARAMS = ("func", "inp", "Tout", "stateful", "use_eager_py_func", "is_grad_func", "name")


def py_function(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``script_ops._internal_py_func``, which every py_function, numpy_function
    and py_func builds through."""
    if executing_eagerly() or not getattr(_versions._tls, "scopes", None):
        return wrapped(*args, **kwargs)  # eager: the body runs here, followed; or no tape about
    arguments = bind(_PARAMS, args, kwargs)
    # Traced in a tape's own graph, the graph only ever runs for that tape:
    # probe every run. Traced for an eager tape's call, the function may run
    # later with no tape about: probe only while it runs for a thread with a
    # tape open (``_functions.running_under_tape``), not for another thread's.
    found = _versions.call_context()
    always = found is not None and found[0].key is not None
    arguments["func"] = _probed(arguments["func"], always, ops.get_default_graph())
    return wrapped(**arguments)


def _probed(func: Callable[..., Any], always: bool, graph: Any) -> Callable[..., Any]:
    name = getattr(func, "__name__", repr(func))

    @functools.wraps(func)
    def run(*args: Any) -> Any:
        from assigntape._tape import AssignAwareTape  # (the tape needs the patches, which need this)

        if not always and not _functions.running_under_tape(graph):
            # Not called from a thread with a tape open (another thread's
            # tape is not this call's): plain TensorFlow.
            return func(*args)
        try:
            with AssignAwareTape(persistent=True, watch_accessed_variables=False) as probe:
                result = func(*args)
        except UntrackedWriteError as error:
            # The other-thread rule saw it first (the body runs in one of
            # TensorFlow's threads): say where the write really comes from.
            raise UntrackedWriteError(f"{_refusal(name, 'a variable')} ({error})") from None
        written = sorted(probe.history().variables)
        # A closed persistent tape holds the patches while it lives, and the
        # error's traceback (which TensorFlow may keep) holds this frame.
        del probe
        if written:
            raise UntrackedWriteError(_refusal(name, f"variable(s) {', '.join(written)}"))
        return result

    return run


def _refusal(name: str, what: str) -> str:
    return (
        f"The Python function {name!r} of a tf.py_function / tf.numpy_function wrote {what} "
        "while the graph of a tf.function ran, and a tape was open where that graph was traced: "
        "the body runs only when the graph runs, out of the tape's sight, so reads after it "
        "would credit the previous version, a silently wrong gradient. Make the write in the "
        "tape's own code, outside the py_function, or run the step eagerly "
        "(tf.config.run_functions_eagerly(True)), where a py_function's writes are followed."
    )
