"""The package's shape: the layers contract in pyproject.toml holds, no module imports itself back
through others (a module-level import graph without cycles), and no file or function grows past
the sizes the project keeps to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tokenfuse

grimp = pytest.importorskip("grimp")
pytest.importorskip("importlinter.cli")

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 80


def test_layers_contract_holds():
    # in a subprocess: import-linter changes the process's logging set-up
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles():
    graph = grimp.build_graph("tokenfuse", cache_dir=None)
    assert _cycles(graph) == []


def test_files_and_functions_stay_short():
    """A file of the package holds at most MAX_FILE_LINES lines and a function at most
    MAX_FUNCTION_LINES (docstring included): past that, split it by what each part owns."""
    import ast

    root = Path(tokenfuse.__file__).parent
    long_files, long_functions = [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(root).as_posix()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append((name, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
                if size > MAX_FUNCTION_LINES:
                    long_functions.append((f"{name}:{node.name}", size))
    assert long_files == [] and long_functions == []
