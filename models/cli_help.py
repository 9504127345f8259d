"""The `--help` text of a typed config: the attribute docstrings of a dataclass (`field_docs`),
read from its source, which the trainers' flags (`mtpkit.train.config`) and the bench's method
options (`mtpkit.eval.specs`) print."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from pathlib import Path


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal right after `name: type = default`) of `cls` and
    of the dataclasses it extends (a subclass's own text wins)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


@functools.cache
def _own_field_docs(cls) -> dict[str, str]:
    node = _class_node(cls)
    if node is None:
        return {}
    docs = {}
    for stmt, nxt in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _class_node(cls) -> ast.ClassDef | None:
    """`cls`'s definition in its module's syntax tree (each module file parsed once), found by its
    qualified name; a class defined inside a function is read with inspect.getsource instead."""
    if "<locals>" in cls.__qualname__:
        try:
            return ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        except (OSError, TypeError):
            return None
    try:
        filename = inspect.getsourcefile(cls)
    except TypeError:
        return None
    body = _module_tree(filename).body if filename else []
    node = None
    for name in cls.__qualname__.split("."):
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == name), None)
        if node is None:
            return None
        body = node.body
    return node


@functools.cache
def _module_tree(filename: str) -> ast.Module:
    try:
        return ast.parse(Path(filename).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return ast.Module(body=[], type_ignores=[])
