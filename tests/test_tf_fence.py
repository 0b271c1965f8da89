"""TensorFlow's internals stay behind one fence (``assigntape/_tf.py``), and
an unsupported TensorFlow is named at import."""

from __future__ import annotations

import ast
import pathlib

import pytest

from assigntape import _tf

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "assigntape"


def _tensorflow_python_imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tensorflow.python"):
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tensorflow.python"):
                    yield node.lineno, alias.name


def test_only_the_fence_imports_tensorflow_internals():
    found = [
        f"{path.relative_to(PACKAGE)}:{line} {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_tf.py"
        for line, module in _tensorflow_python_imports(path)
    ]
    assert found == [], "import these through assigntape._tf: " + ", ".join(found)


def test_the_fence_lists_a_use_for_every_private_attribute_and_they_all_exist():
    assert len(_tf.PRIVATE) >= 20
    for owner, name, purpose in _tf.PRIVATE:
        assert purpose.strip(), name
        assert hasattr(owner, name), name


def test_a_missing_internal_is_one_clear_import_error(monkeypatch):
    class Moved:
        pass

    monkeypatch.setattr(_tf, "PRIVATE", [*_tf.PRIVATE, (Moved, "_gone", "a test")])
    with pytest.raises(
        ImportError, match=r"supports TensorFlow 2\.16 to 2\.21; TensorFlow 2\.\d+\.\d+ lacks Moved\._gone"
    ):
        _tf._check()
