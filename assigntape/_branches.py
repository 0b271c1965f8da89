"""The ``tf.cond`` branches and loop bodies being traced in an open tape's graph.

A write in a branch cannot make a version in the tape's graph (a tensor made
in a branch cannot leave it), so each branch keeps its own versions and
values (``Branch``); ``_control_flow`` makes the graph's versions from them
after the cond or loop. This module keeps, per thread, the branches by graph,
and answers where a write or a call being built now goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from assigntape._errors import ControlFlowWriteError
from assigntape._registry import _enclosing_scope, _tls, current_key
from assigntape._tf import (
    executing_eagerly,
    ops,
)

if TYPE_CHECKING:
    from assigntape._versions import Scope  # (annotations only: the store is above)


def _seed_from_around(scope: Scope) -> None:
    """A tape opened inside a cond branch or loop body of another tape's graph
    starts from the versions that body sees (the outer tape's, and the body's
    own writes): read through the variable's own handle instead, its values
    would be right and their gradient would not reach the outer tape."""
    around = branch_around(scope)
    if around is None:
        return
    outer = around.scope
    for uid in set(outer.current).union(*(b.versions for b in _chain(around))):
        handle = around.version_of_uid(uid)
        if handle is None:
            handle = outer.current[uid]
        var = outer.owners.get(id(handle))
        if var is not None:
            scope.current[uid] = handle
            scope.owners[id(handle)] = var


def _chain(branch: Optional["Branch"]) -> Iterator["Branch"]:
    """``branch`` and the bodies it is nested in, innermost first."""
    while branch is not None:
        yield branch
        branch = branch.parent


def call_context() -> Optional[Tuple[Scope, Optional["Branch"]]]:
    """For a function called now: the scope of the tape around the call, and
    the cond branch or loop body the call is in (None at the tape's level)."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes:
        return None
    scope = _enclosing_scope(scopes)
    if scope is None:
        return None
    if executing_eagerly() or scope.key is ops.get_default_graph():
        return scope, None
    return scope, _current_branch()


class Branch:
    """A ``tf.cond`` branch being traced in the graph of an open tape (or in a
    branch of such a cond: ``parent``).

    Writes in the branch cannot make versions in the tape's graph directly (a
    tensor made in the branch cannot leave it), so the branch keeps its own:
    ``versions`` maps a variable to its latest handle inside the branch, and
    ``values`` to its full value after the branch's writes, written as plain
    ops so that the cond's own gradient can differentiate it. The cond returns
    those values as extra outputs, and the graph around it makes the versions.
    """

    __slots__ = ("scope", "graph", "parent", "versions", "values", "carried", "token")

    def __init__(
        self,
        scope: Scope,
        graph: Any,
        parent: Optional["Branch"],
        carried: Optional[List[str]] = None,
        token: Any = None,
    ) -> None:
        self.scope = scope
        self.graph = graph
        self.parent = parent
        self.versions: Dict[str, Any] = {}  # unique id -> handle inside the branch
        self.values: Dict[str, Tuple[Any, Any]] = {}  # unique id -> (variable, value)
        # A loop body, not a cond branch: the variables carried as loop state, and
        # the loop's identity across the attempts to trace it.
        self.carried = carried
        self.token = token

    def version_of_uid(self, uid: str) -> Optional[Any]:
        """The latest handle written here or in an enclosing branch, if any."""
        branch: Optional[Branch] = self
        while branch is not None:
            handle = branch.versions.get(uid)
            if handle is not None:
                return handle
            branch = branch.parent
        return None

    def version_of(self, var: Any) -> Any:
        """The variable's version as this branch sees it."""
        handle = self.version_of_uid(var._unique_id)
        return self.scope.current_version(var) if handle is None else handle


def version_in(scope: Scope, branch: Optional[Branch], var: Any) -> Any:
    """The variable's version in ``branch`` (a cond branch or loop body), or at
    the tape's own level when ``branch`` is None."""
    return scope.current_version(var) if branch is None else branch.version_of(var)


def open_branch(
    scope: Scope, parent: Optional[Branch], carried: Optional[List[str]] = None, token: Any = None
) -> Branch:
    """Registers the graph being traced now as a cond branch (or, with
    ``carried``, a loop body) of ``scope``."""
    branches = getattr(_tls, "branches", None)
    if branches is None:
        branches = _tls.branches = {}
    graph = ops.get_default_graph()
    branch = branches[graph] = Branch(scope, graph, parent, carried, token)
    return branch


def close_branch(branch: Branch) -> None:
    _tls.branches.pop(branch.graph, None)


def cond_context() -> Optional[Tuple[Scope, Optional[Branch]]]:
    """For a ``tf.cond`` or loop being built now: the scope of the tape whose
    graph it is in, and the branch or loop body it is nested in (None at the
    tape's own level). None if the graph being built is neither (eager, no
    tape, or a body we do not track, such as a nested tf.function's)."""
    scopes = getattr(_tls, "scopes", None)
    if not scopes or executing_eagerly():
        return None
    graph = ops.get_default_graph()
    scope = scopes.get(graph)
    if scope is not None:
        return scope, None
    branch = _current_branch()
    return None if branch is None else (branch.scope, branch)


def _current_branch() -> Optional[Branch]:
    branches = getattr(_tls, "branches", None)
    return branches.get(ops.get_default_graph()) if branches else None


def outermost(scope: Scope) -> Scope:
    """The scope of the tape whose graph holds the outermost cond or loop
    around ``scope`` (``scope`` itself unless its tape was opened in another
    tape's body): the tape whose gradient of that cond or loop is symbolic."""
    around = branch_around(scope)
    while around is not None:
        scope = around.scope
        around = branch_around(scope)
    return scope


def branch_around(scope: Scope) -> Optional[Branch]:
    """For a tape opened inside a cond branch or loop body of another tape's
    graph: that body (its writes must leave it as the outer tape's versions
    too), else None."""
    branches = getattr(_tls, "branches", None)
    if not branches or scope.key is None:
        return None
    branch = branches.get(scope.key)
    return branch if branch is not None and branch.scope is not scope else None


def check_writable_here(scope: Scope, var: Any, op_name: str) -> Any:
    """Where a write goes: the tape's own graph (None), a cond branch or loop body
    of it (the ``Branch``), or a body it cannot leave (refused)."""
    if scope.key is current_key():
        return None
    branch = _current_branch()
    if branch is not None and branch.scope is scope:
        return branch
    raise ControlFlowWriteError(
        f"{op_name} to variable {var.name!r} inside a graph body the tape cannot "
        "follow (a tf.function called inside the tape's function, tf.switch_case, or "
        "another functional op) while an AssignAwareTape is open around it: the new "
        "version cannot leave that body. Write in the tape's own function, in "
        "tf.cond branches or tf.while_loop bodies, which the tape follows, or open "
        "the tape inside the body."
    )
