"""What the config's keys are, for people: `python3 train.py --help` and docs/config.md.

Both are made from the config's dataclasses (components/config/schema.py): each key's type (a
Literal lists its allowed values), its default, and its docstring, the string literal below the
field (the first line is its summary). Regenerate the reference with

    python3 -m scripts.config_reference > docs/config.md
"""

import ast
import dataclasses
import functools
import inspect
import types
import typing
from typing import Literal

from components.config.schema import JobConfig
from components.config.fields import sections
from components.config.toml_out import toml_value

USAGE = """\
usage: python3 train.py [--config FILE] [--SECTION.KEY VALUE | --SECTION.KEY=VALUE ...]
       torchrun --nproc_per_node N train.py [same arguments]

--config FILE reads a TOML file of [section] tables; each --section.key VALUE then overrides one
key (whatever the order). Lists are comma-separated ("model,loss"), booleans true / false, and
"none" unsets a key that may be unset. An unknown key or a bad value is an error naming it."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} of a dataclass (fields without one are left out)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def summary(doc: str) -> str:
    """A docstring's first line: what --help shows."""
    return doc.split("\n", 1)[0]


def describe_type(annotation, where: str = "") -> str:
    """`"a" | "b"`, `int`, `float or none`, `list of str`, `[[data.mixture]] tables`..."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(toml_value(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{describe_type(inner[0], where)} or none"
    if origin is list:
        if dataclasses.is_dataclass(args[0]):
            keys = ", ".join(f.name for f in dataclasses.fields(args[0]))
            return f"[[{where}]] tables of {keys}"
        return f"list of {describe_type(args[0], where)}"
    return annotation.__name__


def keys(path: str, section) -> list[dict]:
    """Each key of a section: name, type, default (as TOML; "none" when unset) and doc."""
    hints, docs = typing.get_type_hints(type(section)), field_docs(type(section))
    out = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            continue  # a subsection, listed on its own
        out.append({"key": f.name, "type": describe_type(hints[f.name], f"{path}.{f.name}"),
                    "default": "none" if value is None else toml_value(value),
                    "doc": docs.get(f.name, "")})
    return out


def section_doc(section) -> str:
    doc = inspect.getdoc(type(section)) or ""
    return "" if doc.startswith(type(section).__name__ + "(") else doc  # dataclass's made-up one


def help_text(intro: str = "") -> str:
    """Usage, then every section and key: `key = default  type`, and its one-line doc."""
    lines = [USAGE, ""] + ([intro, ""] if intro else [])
    for path, section in sections(JobConfig()):
        doc = section_doc(section)
        lines.append(f"[{path}]" + (f"  {summary(doc)}" if doc else ""))
        for key in keys(path, section):
            lines.append(f"  {key['key']} = {key['default']}    ({key['type']})")
            if key["doc"]:
                lines.append(f"      {summary(key['doc'])}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def reference_markdown() -> str:
    """docs/config.md: every section and key, with its type, default and whole doc."""
    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    lines = ["# Config reference", "",
             "<!-- Generated from components/config/schema.py by `python3 -m scripts.config_reference > "
             "docs/config.md`; do not edit by hand (tests/test_config.py checks it is current). -->",
             "", "```", USAGE, "```", "",
             "Key names follow torchtitan v0.2 where one exists. `[checkpoint] enable` is also read "
             "under torchtitan v0.1's name, `enable_checkpoint`.", ""]
    for path, section in sections(JobConfig()):
        lines += [f"## [{path}]", ""]
        doc = section_doc(section)
        if doc:
            lines += [cell(doc), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for key in keys(path, section):
            doc = key["doc"].replace("\n\n", "\n")
            lines.append(f"| `{key['key']}` | {cell(key['type'])} | `{cell(key['default'])}` "
                         f"| {cell(doc)} |")
        lines.append("")
    return "\n".join(lines)
