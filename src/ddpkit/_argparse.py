"""The argument parser every ``ddpkit`` command uses, and flags made from a config dataclass.

The commands of :mod:`ddpkit.cli` and ``ddpkit bench`` (:mod:`ddpkit.bench.plan`) build their
parsers from :class:`Parser`. It needs only :mod:`ddpkit.errors`, so it lives with the base
modules: ``bench`` sits below ``cli`` and must not import it.

:func:`add_fields` writes a command's flags from a dataclass, one per field, with the field's
docstring (the string literal under it, as torchtitan's and tyro's configs write them) as the
help text, so a setting is described once::

    @dataclass
    class Config:
        epochs: int = 5
        \"\"\"Passes over the training set.\"\"\"

    parser = Parser(prog="ddpkit train")
    add_fields(parser, Config)      # --epochs EPOCHS  Passes over the training set. (default 5)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from ddpkit.errors import UsageError


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line, without the usage block.

    The error is raised as :class:`~ddpkit.errors.UsageError`, so the CLI prints it as
    ``ddpkit COMMAND: error: ...`` and exits 2, like argparse, and code calling a command
    in-process (tests) can catch it.
    """

    def error(self, message: str) -> NoReturn:
        """Raise ``message`` as a :class:`~ddpkit.errors.UsageError` naming ``PROG --help``."""
        raise UsageError(f"{message} (see '{self.prog} --help')")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring of each field of dataclass ``cls``: the string literal right under it.

    Python keeps no such docstring at run time, so it is read from the class's source with
    :mod:`ast` (how tyro and simple-parsing read them). Indentation is cleaned as for any
    docstring; fields without one are left out.
    """
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def add_fields(
    parser: argparse.ArgumentParser, cls: type, *, skip: Iterable[str] = (), aliases: Mapping[str, str] | None = None
) -> None:
    """Add one flag per field of dataclass ``cls`` to ``parser``, in the fields' order.

    ``--name-with-dashes`` stores into ``name``, converted to the field's type (``X | None``:
    ``X``); a ``bool`` field that defaults to False is a ``store_true`` switch, and a ``bool | None``
    field (None: decided later, e.g. by the model) is a ``--name``/``--no-name`` pair. A field without a default is a required
    flag. The help is the field's docstring, followed by ``(default X)`` where the default says
    something. A parser made with ``argument_default=argparse.SUPPRESS`` leaves a flag that was
    not given out of the namespace, so the dataclass (or a config file) keeps its value.
    ``aliases`` maps earlier names to fields: each is a flag too (``--no-`` pair included), left
    out of the help, whose line names it.

    Raises:
        TypeError: a field has no docstring, a type with no flag (a container), or is a bool
            that defaults to True (a switch could not turn it off; make it ``bool | None``).
    """
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    keep = not parser.argument_default == argparse.SUPPRESS
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        if field.name not in docs:
            raise TypeError(f"{cls.__name__}.{field.name} has no docstring to be the help of its flag")
        kind = _flag_type(hints[field.name], f"{cls.__name__}.{field.name}")
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        options: dict[str, Any] = {"dest": field.name, "help": _help(docs[field.name], field.default)}
        if kind is bool:
            if field.default is None:
                options["action"] = argparse.BooleanOptionalAction
            elif field.default is False:
                options["action"] = "store_true"
            else:
                raise TypeError(
                    f"{cls.__name__}.{field.name}: a switch needs the default False (or None "
                    "for a --flag/--no-flag pair)"
                )
        elif kind is not str:  # argparse's own default type: strings as given
            options["type"] = kind
        if required:
            options["required"] = True
        elif keep and kind is not bool:
            options["default"] = field.default
        earlier = [old for old, name in (aliases or {}).items() if name == field.name]
        if earlier:
            pairs = options.get("action") is argparse.BooleanOptionalAction
            names = [
                name for old in earlier for name in ([_flag(old), "--no-" + _flag(old)[2:]] if pairs else [_flag(old)])
            ]
            options["help"] += " (also " + ", ".join(names) + ")"
        parser.add_argument(_flag(field.name), **options)
        for old in earlier:
            parser.add_argument(_flag(old), **{**options, "help": argparse.SUPPRESS, "required": False})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag_type(hint: Any, name: str) -> type:
    """``int``, ``float``, ``str`` or ``bool`` of a field's type, ``None`` of an optional one dropped."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = kinds[0] if len(kinds) == 1 else None
    if hint not in (int, float, str, bool):
        raise TypeError(f"{name}: a flag takes int, float, str or bool, not {hint!r}")
    return hint


def _help(doc: str, default: Any) -> str:
    """The docstring on one line (``%`` escaped for argparse), with the default where it says something."""
    text = " ".join(doc.split()).replace("%", "%%")
    if default is dataclasses.MISSING or default is None or isinstance(default, bool):
        return text
    return f"{text} (default {default})"
