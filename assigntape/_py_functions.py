"""``tf.py_function`` / ``tf.numpy_function`` in a graph.

Eagerly, the Python body runs there and then, in the tape's thread, and its
writes are followed like any other. Traced in a graph (a ``tf.function``, a
``tf.data`` function such as ``from_generator``'s or a ``map``'s, traced
before or under a tape), the body runs only when the graph runs, in one of
TensorFlow's threads: the tape cannot follow a write made there, and reads
after it would credit the version from before (or, for a variable the tape
had not read yet, the write would pass for another thread's and lose its
path). What the body will write is unknown while tracing, so the body is run
under a probing tape whenever a tape of ours is open (in the tape's own
graph, at every run), and a write of a differentiable variable there fails
the graph's run with ``UntrackedWriteError`` (TensorFlow reports it as its
own ``UnknownError``, the message included; the write has happened by then).
Always on: a dataset's functions are traced where it is made, often before
the first tape.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from assigntape import _versions
from assigntape._errors import UntrackedWriteError
from assigntape._tf import executing_eagerly
from assigntape._wrapping import bind

__all__ = ["py_function"]

_PARAMS = ("func", "inp", "Tout", "stateful", "use_eager_py_func", "is_grad_func", "name")


def py_function(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``script_ops._internal_py_func``, which every py_function, numpy_function
    and py_func builds through."""
    if executing_eagerly():
        return wrapped(*args, **kwargs)  # the body runs here, followed
    arguments = bind(_PARAMS, args, kwargs)
    # Traced in a tape's own graph, the graph only ever runs for that tape:
    # probe every run. Traced for an eager tape's call, the function may run
    # later with no tape about: probe only while one is open.
    found = _versions.call_context()
    arguments["func"] = _probed(arguments["func"], always=found is not None and found[0].key is not None)
    return wrapped(**arguments)


def _probed(func: Callable[..., Any], always: bool) -> Callable[..., Any]:
    name = getattr(func, "__name__", repr(func))

    @functools.wraps(func)
    def run(*args: Any) -> Any:
        from assigntape._tape import AssignAwareTape  # (the tape needs the patches, which need this)

        if not always and not _versions.any_scopes():
            return func(*args)  # no tape of ours open now: plain TensorFlow
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
        f"The Python function {name!r} of a tf.py_function / tf.numpy_function (or a "
        f"Dataset.from_generator generator) wrote {what} while an AssignAwareTape was open: "
        "traced in a graph (a tf.function's or a tf.data function's), the body runs when "
        "TensorFlow's runtime runs that graph, out of the tape's sight, so reads after it "
        "would credit the previous version, a silently wrong gradient. Make the write in the "
        "tape's own code, outside the py_function and the dataset's functions, or run the step "
        "eagerly (tf.config.run_functions_eagerly(True)), where a py_function's writes are followed."
    )
