"""Diagnostics: why a gradient is missing (``explain``) and what wrote what (``history``).

Both read what the tape already keeps: the versions of each variable and the
``WriteRecord`` of the write that made each one. ``explain`` asks for the
gradient with respect to *every* version of every variable source in one
backward pass; where the chain
of versions breaks tells which write, and of what kind, cut the start-of-tape
value off from the target.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import wrapt

from assigntape import _registry, _resolve, _versions
from assigntape._record import Record, WriteRecord
from assigntape._tf import UnconnectedGradients, context, nest, pywrap_tfe

if TYPE_CHECKING:  # pragma: no cover
    from assigntape._tape import AssignAwareTape

__all__ = [
    "Reason",
    "SourceReport",
    "Explanation",
    "VersionRecord",
    "History",
    "explain",
    "history",
    "leave_tensorflow",
]


class Reason:
    """The reasons ``explain`` gives, as the ``reason`` codes of its reports."""

    OK = "ok"
    NEVER_TOUCHED = "never_touched"
    OVERWRITTEN = "overwritten_before_read"
    NON_DIFFERENTIABLE = "non_differentiable"
    STOP_RECORDING = "stop_recording"
    CUT = "cut"
    LEFT_TENSORFLOW = "left_tensorflow"
    NOT_WATCHED = "not_watched"
    ZERO = "zero"


class SourceReport(NamedTuple):
    """What ``explain`` found for one source."""

    name: str  # the variable's name, or the tensor's place in ``sources``
    status: str  # "ok", "none" (no gradient) or "zero" (all zeros)
    reason: str  # one of the ``Reason`` codes
    message: str  # a sentence for people

    def __str__(self) -> str:
        if self.status == "ok":
            return f"{self.name}: has a gradient"
        kind = "None" if self.status == "none" else "zero"
        return f"{self.name}: gradient is {kind} [{self.reason}]\n    {self.message}"


class Explanation:
    """The report of ``AssignAwareTape.explain``: one ``SourceReport`` per source.

    Attributes:
      gradients: the gradients, in the structure of ``sources``, as ``gradient``
        returns them (so a non-persistent tape need not be asked twice).
      reports: one ``SourceReport`` per flattened source, in order.
    """

    def __init__(self, gradients: Any, reports: List[SourceReport]) -> None:
        self.gradients = gradients
        self.reports = reports

    @property
    def missing(self) -> List[SourceReport]:
        """The reports of sources whose gradient is None or zero."""
        return [r for r in self.reports if r.status != "ok"]

    def __str__(self) -> str:
        if not self.missing:
            return "Every source has a gradient."
        return "\n".join(str(r) for r in self.reports)

    def __repr__(self) -> str:
        return f"<Explanation: {len(self.missing)} of {len(self.reports)} sources without a gradient>"


class VersionRecord(NamedTuple):
    """One version of a variable in ``History``."""

    number: int  # 0 for the start of the tape, then one more per write
    op: Optional[str]  # the op that made it; None for the start-of-tape version
    cut: bool  # made by a cut write: no gradient flows through it
    recorded: bool  # False when made under stop_recording
    handle: Any  # the version's handle tensor (a source or target for gradient)

    def describe(self) -> str:
        if self.op is None:
            return "start of tape"
        notes = [self.op]
        if self.cut:
            notes.append("cut: no gradient path")
        if not self.recorded:
            notes.append("under stop_recording: no gradient path")
        return ", ".join(notes)


class History:
    """The versions of every variable the tape wrote, and the op behind each.

    ``str(history)`` is a text listing; ``to_dot()`` is Graphviz DOT source.

    Attributes:
      variables: ``{variable name: [VersionRecord, ...]}``, oldest first, for
        each variable written while the tape was open.
    """

    def __init__(self, variables: Dict[str, List[VersionRecord]]) -> None:
        self.variables = variables

    def __str__(self) -> str:
        if not self.variables:
            return "No variable was written on this tape."
        lines = []
        for name, records in self.variables.items():
            lines.append(f"{name}: {len(records)} versions")
            lines += [f"  v{r.number}: {r.describe()}" for r in records]
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz DOT: one chain of version nodes per variable, edges labelled
        with the op that made the next version (dashed where no gradient flows).
        Render with ``dot -Tpng``."""
        lines = ["digraph history {", "  rankdir=LR;", '  node [shape=box, fontname="monospace"];']
        for n, (name, records) in enumerate(self.variables.items()):
            lines.append(f"  subgraph cluster_{n} {{")
            lines.append(f"    label={_dot_quote(name)};")
            for r in records:
                lines.append(f"    v{n}_{r.number} [label={_dot_quote(f'{name} v{r.number}')}];")
            for prev, r in zip(records, records[1:]):
                style = "" if r.recorded and not r.cut else ", style=dashed"
                lines.append(f"    v{n}_{prev.number} -> v{n}_{r.number} [label={_dot_quote(r.describe())}{style}];")
            lines.append("  }")
        lines.append("}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<History: {len(self.variables)} variables written>"


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def variable_name(var: Any, given: Any) -> str:
    """A Keras variable's path (``dense/kernel``), else the tf.Variable's name."""
    path = getattr(given, "path", None)
    return path if isinstance(path, str) else var.name


def history(record: Record) -> History:
    variables: Dict[str, List[VersionRecord]] = {}
    for uid, versions in record.versions.items():
        var = record.owners[id(versions[0])]
        writes: List[Optional[WriteRecord]] = [None, *record.writes[uid]]
        name = var.name
        if name in variables:  # Keras layers' variables share short names
            name = f"{name} ({uid})"
        variables[name] = [
            VersionRecord(
                i,
                None if w is None else w.op,
                False if w is None else w.cut,
                True if w is None else w.recorded,
                handle,
            )
            for i, (handle, w) in enumerate(zip(versions, writes))
        ]
    return History(variables)


def _all_zero(g: Any) -> bool:
    if not context.executing_eagerly() or isinstance(g, tf.IndexedSlices):
        # Symbolic values have no numbers yet; only a missing gradient is seen.
        return False
    return not np.any(np.asarray(g))


def explain(tape: "AssignAwareTape", record: Record, target: Any, sources: Any, as_variable: Any) -> Explanation:
    """``tape.explain``: the gradients by ``tape``, the reasons from its ``record``."""
    flat = nest.flatten(sources)
    paths = [p for p, _ in nest.flatten_with_joined_string_paths(sources)]
    variables = [as_variable(s) for s in flat]
    # One backward pass: each variable source expands to all its versions.
    expanded: List[Any] = []
    spans = []
    for s, var in zip(flat, variables):
        start = len(expanded)
        expanded += list(record.versions_of(var, _versions.canonical_handle(var))) if var is not None else [s]
        spans.append((start, len(expanded)))
    grads = tape.gradient(target, expanded, unconnected_gradients=UnconnectedGradients.NONE)
    reports = []
    for s, path, var, (lo, hi) in zip(flat, paths, variables, spans):
        per_version = grads[lo:hi]
        g0 = per_version[0]
        if var is None:
            name = f"sources[{path}]" if path else "sources"
            reports.append(_explain_tensor(record, name, g0))
        else:
            watched = any(_resolve.resolve(w) is var for w in tape.watched_variables())
            reports.append(_explain_variable(record, watched, variable_name(var, s), var, per_version))
    first = [grads[lo] for lo, _ in spans]
    return Explanation(nest.pack_sequence_as(sources, first), reports)


_ZERO_MESSAGE = (
    "a path to the target exists, but every derivative along it is zero here (a "
    "ReLU below zero, tf.sign, a clipped or saturated value, a multiplication by "
    "zero). Check the values, not the wiring."
)


def _escapes(record: Record) -> str:
    places = list(dict.fromkeys(record.escapes))
    shown = ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else "")
    return (
        f"a value recorded on the tape left TensorFlow (.numpy(), float(), int(), bool()) at "
        f"{shown}; whatever is computed from it in NumPy or Python carries no "
        "gradient. Keep the computation in TensorFlow ops."
    )


def _explain_tensor(record: Record, name: str, g: Any) -> SourceReport:
    if g is not None:
        if _all_zero(g):
            return SourceReport(name, "zero", Reason.ZERO, _ZERO_MESSAGE)
        return SourceReport(name, "ok", Reason.OK, "")
    if record.escapes:
        return SourceReport(name, "none", Reason.LEFT_TENSORFLOW, _escapes(record))
    return SourceReport(
        name,
        "none",
        Reason.NOT_WATCHED,
        "no recorded path leads from this tensor to the target. A tensor is tracked "
        "only if it was passed to tape.watch() (or computed, on the tape, from "
        "something watched) before it was used; check too that the target is "
        "computed from it by ops with gradients.",
    )


def _explain_variable(record: Record, watched: bool, name: str, var: Any, per_version: Sequence[Any]) -> SourceReport:
    g0 = per_version[0]
    if g0 is not None:
        if _all_zero(g0):
            return SourceReport(name, "zero", Reason.ZERO, _ZERO_MESSAGE)
        return SourceReport(name, "ok", Reason.OK, "")
    if not (var.dtype.is_floating or var.dtype.is_complex):
        return SourceReport(
            name,
            "none",
            Reason.NON_DIFFERENTIABLE,
            f"its dtype is {var.dtype.name}, which carries no gradient. Make it a "
            "floating-point variable, or cast a float value where it is used.",
        )
    writes: List[WriteRecord] = record.writes.get(var._unique_id, [])
    # The first later version the target does depend on: the write that made it
    # is where the start-of-tape value was cut off.
    reached = next((k for k in range(1, len(per_version)) if per_version[k] is not None), None)
    if reached is not None:
        write = writes[reached - 1]
        where = f"write {reached} of {len(writes)} ({write.op}, which made version {reached})"
        if write.cut:
            return SourceReport(
                name,
                "none",
                Reason.CUT,
                f"{where} was cut by AssignAwareTape(untracked_writes='cut'): the tape "
                "could not differentiate that op, so no gradient flows through it. Write "
                "with tracked ops (assign, assign_add/sub, scatter, slice, Keras 3 "
                "optimizers) to keep the path.",
            )
        if not write.recorded:
            return SourceReport(
                name,
                "none",
                Reason.STOP_RECORDING,
                f"{where} ran under stop_recording(), so no gradient flows through it. "
                "Make the write outside the stop_recording() block to keep the path.",
            )
        return SourceReport(
            name,
            "none",
            Reason.OVERWRITTEN,
            f"it was overwritten by {where} before any read that reaches the target, "
            "so its start-of-tape value does not matter. Its gradient as of a later "
            f"version: tape.gradient(target, tape.versions(variable)[{reached}]).",
        )
    if not writes and not watched:
        return SourceReport(
            name,
            "none",
            Reason.NEVER_TOUCHED,
            "it was never read or written while the tape was recording (reads under "
            "stop_recording() are not recorded, and with watch_accessed_variables="
            "False only tape.watch()ed variables are). Check that the target is "
            "computed from it inside the `with` block.",
        )
    if record.escapes:
        return SourceReport(name, "none", Reason.LEFT_TENSORFLOW, _escapes(record))
    touched = f"it was written {len(writes)} times on the tape" if writes else "it was read on the tape"
    return SourceReport(
        name,
        "none",
        Reason.NON_DIFFERENTIABLE,
        f"{touched}, but no path with gradients leads from any of its versions to "
        "the target: the values went through an op or dtype that has no gradient "
        "(tf.cast to an integer, tf.round, argmax, comparisons, tf.stop_gradient), "
        "or did not reach the target at all.",
    )


# -- the patch behind left_tensorflow -----------------------------------------


def leave_tensorflow(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """``EagerTensor._numpy`` (behind ``.numpy()``, ``float()``, ``np.asarray``).

    A value the tape records that leaves TensorFlow carries no gradient from
    then on. Note where it left, so that ``explain()`` can name the place.
    """
    scope = _registry.eager_scope()
    if scope is not None and pywrap_tfe.TFE_Py_TapeSetShouldRecordBackprop([instance]):
        where = _caller()
        for r in scope.records:
            r.note_escape(where)
    return wrapped(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _library_dirs() -> Tuple[str, ...]:
    import keras
    import numpy

    dirs = [os.path.dirname(m.__file__ or "") for m in (tf, keras, numpy, wrapt)]
    dirs.append(os.path.dirname(__file__) + os.sep + "_")  # our private modules
    # tensorflow's own modules live beside the tf package (tensorflow/python/...).
    return tuple(d for d in dirs if d)


def _caller() -> str:
    """``file:line`` of the innermost frame outside TensorFlow, Keras and us."""
    skip = _library_dirs()
    frame: Any = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
