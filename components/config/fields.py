"""A config section's fields, as the parser, the checks and the TOML writer walk them: which are
keys and which subsections, every section of a config, the older names some keys are also read
under, and one value checked against (or parsed as) its field's type.
"""

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Optional

from components.config.schema import ConfigError, JobConfig


def suggest(name: Any, valid, otherwise: Optional[str] = None) -> str:
    """" (did you mean 'x'?)" for the closest valid name; else otherwise, or the list of them."""
    if not valid:
        return ""
    close = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (valid: {', '.join(map(str, valid))})" if otherwise is None else otherwise


def subsections(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)
            if dataclasses.is_dataclass(getattr(obj, f.name))]


def keys(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)
            if not dataclasses.is_dataclass(getattr(obj, f.name))]


def sections(obj=None, where: str = "") -> list[tuple[str, Any]]:
    """(dotted name, section) of every section that holds keys, nested ones included, in order:
    ("job", Job(...)), ..., ("quantize.linear.float8", Float8(...)); of a default JobConfig
    unless one is given."""
    obj = JobConfig() if obj is None else obj
    found = [(where, obj)] if where and keys(obj) else []
    for name in subsections(obj):
        found += sections(getattr(obj, name), f"{where}.{name}" if where else name)
    return found


def coerce(where: str, value: Any, annotation, from_text: bool) -> Any:
    """Check (TOML) or parse (command line) one value against its field's type."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        inner = [a for a in typing.get_args(annotation) if a is not type(None)][0]
        if value is None or (from_text and value.lower() in ("none", "null", "")):
            return None
        return coerce(where, value, inner, from_text)
    if origin is list:
        if from_text:
            if value.strip().startswith("["):  # '["wk", "wq"]' split at commas: '["wk"', '"wq"]'
                raise ConfigError(f"{where} = {value!r}: a list on the command line is "
                                  "comma-separated (a,b), without TOML's brackets and quotes; "
                                  "an empty value (--section.key=) is the empty list")
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = typing.get_args(annotation)[0]
        if dataclasses.is_dataclass(inner):  # "[data] mixture" -> "[[data.mixture]] #1"
            section, _, key = where.removeprefix("[").partition("] ")
            return [coerce(f"[[{section}.{key}]] #{i}", v, inner, from_text)
                    for i, v in enumerate(value, 1)]
        return [coerce(f"{where}:", v, inner, from_text) for v in value]
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            # where is "[section] key", or "[section] key:" for an item of a list
            what = f"{where} {value!r} is not" if where.endswith(":") else f"{where} = {value!r}: expected"
            raise ConfigError(f"{what} one of {', '.join(map(repr, allowed))}"
                              + suggest(value, allowed, ""))
        return value
    if dataclasses.is_dataclass(annotation):  # a table in an array of tables: [[data.mixture]]
        if from_text:
            return annotation.parse(where, value)
        if isinstance(value, annotation):  # built in code: check its values the same way
            value = dataclasses.asdict(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__} {value!r}")
        item, hints = annotation(), typing.get_type_hints(annotation)
        for key, v in value.items():
            if key not in hints:
                raise ConfigError(f"{where}: unknown key {key!r}" + suggest(key, list(hints)))
            setattr(item, key, coerce(f"{where} {key}", v, hints[key], from_text))
        return item
    where = where.removesuffix(":")  # an item of a list is named by the list
    if annotation is str and isinstance(value, str):
        _check_text(where, value)
    if from_text:
        try:
            if annotation is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return value.lower() in ("true", "1")
            return annotation(value)
        except ValueError:
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}") from None
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {annotation.__name__}, got "
                          f"{type(value).__name__} {value!r}")
    return value


def _check_text(where: str, value: str) -> None:
    """A string no file name, log or config.toml can hold is refused here, naming its key: a NUL
    (TOML spells it "\\u0000"), or a command-line byte outside UTF-8, which reaches Python as a
    lone surrogate and made the run fail writing config.toml, after setting the folder's
    earlier metrics aside."""
    if "\x00" in value:
        raise ConfigError(f"{where} = {value!r}: holds a NUL character, which no path or name may")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{where} = {value!r}: not UTF-8 text (a byte the command line or the "
                          "environment gave in another encoding?)") from None


# Keys also accepted under an older name: (section, old name) -> the name.
ALIASES = {("checkpoint", "enable_checkpoint"): "enable",  # torchtitan v0.1's name
           ("lr_scheduler", "min_lr_ratio"): "min_lr_factor"}  # this repo's name before torchtitan's
