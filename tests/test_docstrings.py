"""Every public definition of ddpkit has a docstring; a public function of more than three
parameters documents them in a Google-style ``Args:`` section (issue 26)."""

from __future__ import annotations

import ast

from helpers import ROOT

SRC = ROOT / "src" / "ddpkit"


def _public(name: str) -> bool:
    return not name.startswith("_")


def _definitions(tree: ast.Module, module: str):
    """(where, node) of every public class, function and method, skipping private scopes."""

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _public(node.name):
                if any(
                    isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter")
                    for d in getattr(node, "decorator_list", [])
                ):
                    continue
                yield f"{prefix}{node.name}", node
                if isinstance(node, ast.ClassDef):
                    yield from walk(node.body, f"{prefix}{node.name}.")

    yield from walk(tree.body, f"{module}:")


def _parameters(node: ast.FunctionDef) -> list[str]:
    args = node.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return [n for n in names if n not in ("self", "cls")]


def _walk_modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if any(p.startswith("_") and p != "__init__" for p in parts):
            continue  # private modules: _torch, _files, ...
        yield ".".join(("ddpkit",) + parts), ast.parse(path.read_text())


def test_every_public_definition_has_a_docstring():
    missing = [
        where
        for module, tree in _walk_modules()
        for where, node in _definitions(tree, module)
        if ast.get_docstring(node) is None
    ]
    assert not missing, f"{len(missing)} public definitions without a docstring: {missing}"


def test_public_functions_of_more_than_three_parameters_document_them():
    missing = [
        where
        for module, tree in _walk_modules()
        for where, node in _definitions(tree, module)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and len(_parameters(node)) > 3
        and "Args:" not in (ast.get_docstring(node) or "")
    ]
    assert not missing, f"{len(missing)} public functions of more than three parameters without Args: {missing}"
