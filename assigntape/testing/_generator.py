"""The hypothesis strategy behind ``strategies.programs``."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple

from hypothesis import strategies as st

from assigntape.testing._program import Program
from assigntape.testing._vocabulary import (
    BINARY,
    BROADCASTING,
    FULL_WRITES,
    ORDERED,
    PARTIAL_WRITES,
    READ_PATHS,
    SHAPES,
    UNARY,
    XLA_MISSING,
)

__all__ = ["generate"]


@st.composite
def generate(
    draw: Callable[[Any], Any],
    max_variables: int,
    max_steps: int,
    dtypes: Sequence[str],
    writes: Sequence[str],
    compiled: Any,
    events: bool,
    function_writes: bool,
    keras_variables: bool,
    stopped_writes: bool,
) -> Program:
    import tensorflow as tf

    full = [k for k in FULL_WRITES if k in writes]
    partial = [k for k in PARTIAL_WRITES if k in writes]
    if compiled == "xla":
        partial = [k for k in partial if k not in XLA_MISSING]
    n_vars = draw(st.integers(1, max_variables))
    shapes = tuple(draw(st.sampled_from(SHAPES)) for _ in range(n_vars))
    names = tuple(draw(st.sampled_from(list(dtypes))) for _ in range(n_vars))
    complex_ = [tf.as_dtype(d).is_complex for d in names]
    keras = tuple(keras_variables and not c and draw(st.integers(0, 3)) == 0 for c in complex_)
    n_params = draw(st.integers(0, 2))
    statements: List[Tuple[Any, ...]] = []
    n_temps = 0
    opened = paused = plain_inner = False

    def operand() -> Tuple[str, int, int]:
        kinds = ["var"] + (["temp"] if n_temps else []) + (["param"] if n_params else [])
        kind = draw(st.sampled_from(kinds))
        count = {"var": n_vars, "temp": n_temps, "param": n_params}[kind]
        return (kind, draw(st.integers(0, count - 1)), draw(st.integers(0, READ_PATHS - 1)))

    kinds_of_statement = ["read"]
    if full:
        kinds_of_statement += ["write", "write", "write_const"] + (["write_stopped"] if stopped_writes else [])
    if partial:
        kinds_of_statement += ["partial", "partial"]
    if events:
        kinds_of_statement += ["event"]
    if function_writes and full:
        # Eagerly, cut; called in the tape's compiled function, followed.
        kinds_of_statement += ["fn_write_inline" if compiled else "fn_write"]
    for _ in range(draw(st.integers(1, max_steps))):
        what = draw(st.sampled_from(kinds_of_statement))
        if what == "partial":
            i = draw(st.integers(0, n_vars - 1))
            # A scalar has no part to write (nor a complex variable an ordered
            # kind): a read in its place keeps every program's steps >= 1.
            allowed = [k for k in partial if shapes[i] and not (complex_[i] and k in ORDERED)]
            if not allowed:
                what = "read"
        if what == "event":
            # A paused tape can only be resumed; with a plain inner tape open the
            # AssignAwareTape stays open (alone, a plain tape follows no writes).
            if paused:
                choices = ["resume"]
            else:
                choices = ["reset"] + ([] if plain_inner else ["pause"]) + ([] if opened else ["inner"])
            event = draw(st.sampled_from(choices))
            flag = draw(st.booleans())  # for "inner": ours (True) or plain
            opened |= event == "inner"
            plain_inner |= event == "inner" and not flag
            paused = event == "pause"
            statements.append(("event", event, flag))
        elif what == "partial":
            kind = draw(st.sampled_from(allowed))
            n = shapes[i][0]
            if kind == "slice":
                start = draw(st.integers(0, n - 1))
                rows = tuple(range(start, draw(st.integers(start + 1, n))))
            else:
                rows = tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)))
            shapes_ok = ["", "scalar"] + (["row"] if kind == "slice" and len(shapes[i]) == 2 else [])
            # XLA's slice write does not broadcast.
            broadcasts = kind in BROADCASTING and not (compiled == "xla" and kind == "slice")
            broadcast = draw(st.sampled_from(shapes_ok)) if broadcasts else ""
            statements.append(
                (
                    "partial",
                    i,
                    kind,
                    rows,
                    operand(),
                    operand(),
                    draw(st.sampled_from(BINARY)),
                    draw(st.sampled_from(sorted(UNARY))),
                    broadcast,
                )
            )
        elif what == "read":
            statements.append(("read", operand(), draw(st.sampled_from(sorted(UNARY)))))
            n_temps += 1
        elif what == "write_const":
            statements.append(("write_const", draw(st.integers(0, n_vars - 1)), draw(st.sampled_from(full))))
        else:
            statements.append(
                (
                    what,
                    draw(st.integers(0, n_vars - 1)),
                    draw(st.sampled_from(full)),
                    operand(),
                    operand(),
                    draw(st.sampled_from(BINARY)),
                    draw(st.sampled_from(sorted(UNARY))),
                )
            )
    if paused:  # the loss is computed on the tape: enter it again at the end
        statements.append(("event", "resume", False))
    return Program(shapes, names, n_params, tuple(statements), draw(st.integers(0, 2**31)), keras)
