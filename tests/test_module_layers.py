"""The package's modules import each other in layers: no import circle, at
module level or inside a function (a function-level import of a higher
module, to dodge a circle at import time, is a circle at run time)."""

import ast
import functools
import os
import re
from typing import Dict, List, Set

import assigntape

PACKAGE = os.path.dirname(assigntape.__file__)


def _module_name(path: str) -> str:
    relative = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")]
    parts = relative.split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(tree: ast.AST, module: str, is_package: bool) -> Set[str]:
    """The package's modules ``tree`` imports at run time (not those imported
    for annotations only, under ``if TYPE_CHECKING:``)."""
    found: Set[str] = set()
    todo: List[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if _is_type_checking(node):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("assigntape"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("assigntape"):
                found.add(base)
                # ``from assigntape import _versions``: the submodule.
                found.update(f"{base}.{a.name}" for a in node.names)
        todo.extend(ast.iter_child_nodes(node))
    return found


def _graph() -> Dict[str, Set[str]]:
    sources = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                sources[_module_name(path)] = path
    graph = {}
    for module, path in sources.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        imported = _imported(tree, module, path.endswith("__init__.py"))
        # A package's ``__init__`` runs before its submodules: importing a
        # submodule is not an edge to the package (only names it defines are).
        graph[module] = {m for m in imported if m in sources and m != module and not module.startswith(m + ".")}
    return graph


def _cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """A cycle of ``graph``, or [] if there is none."""
    state: Dict[str, int] = {}
    path: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_library_modules_import_each_other_without_a_circle():
    graph = _graph()
    assert "assigntape._versions" in graph and graph["assigntape._tape"]  # the parse found the imports
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


def _floors(graph: Dict[str, Set[str]]) -> Dict[str, int]:
    """The library's modules (not the examples, the testing helpers or
    ``__main__``) by floor: 0 for a module that imports none of them, else
    one above the highest it imports."""
    library = {m: {d for d in deps if d in graph and _in_library(d)} for m, deps in graph.items() if _in_library(m)}

    @functools.lru_cache(maxsize=None)
    def floor(module: str) -> int:
        return 1 + max((floor(d) for d in library[module]), default=-1)

    return {m.replace("assigntape.", ""): floor(m) for m in library}


def _in_library(module: str) -> bool:
    # (The examples and testing subpackages are users of the library.)
    return module == "assigntape" or (
        module.count(".") == 1 and module.startswith("assigntape._") and module != "assigntape.__main__"
    )


def test_how_it_works_lists_every_module_on_its_floor():
    """docs/how-it-works.md's table of modules is drawn from the code."""
    graph = _graph()
    assert _cycle(graph) == []
    with open(os.path.join(os.path.dirname(PACKAGE), "docs", "how-it-works.md")) as f:
        text = f.read()
    table = text[text.index("## The modules") : text.index("## The path of one write")]
    listed = {m: int(floor) for floor, m in re.findall(r"^ *(\d+) +(\w+) ", table, flags=re.M)}
    assert listed == _floors(graph)


def test_the_cycle_check_finds_a_circle():
    # (The check itself: a circle through a function-level import is found.)
    tree = ast.parse("def f():\n    from assigntape import _tape\n")
    edges = _imported(tree, "assigntape._py_functions", False)
    graph = {"assigntape._py_functions": edges & {"assigntape._tape"}, "assigntape._tape": {"assigntape._py_functions"}}
    assert _cycle(graph) == ["assigntape._py_functions", "assigntape._tape", "assigntape._py_functions"]
