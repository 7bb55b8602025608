"""The config written back out as TOML (a run's config.toml, --job.print_config), and the keys
whose values differ between a saved config.toml and a config.
"""

import dataclasses
import re
import tomllib

from components.config.fields import ALIASES, keys, subsections
from components.config.schema import JobConfig


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        # a TOML basic string holds no control character but tab: a multi-line description
        # would make config.toml unreadable (resume, export_hf and evaluate read it back)
        v = v.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + re.sub(r"[\x00-\x08\x0a-\x1f\x7f]",
                            lambda m: f"\\u{ord(m.group()):04x}", v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if dataclasses.is_dataclass(v):
        v = dataclasses.asdict(v)
    if isinstance(v, dict):  # an inline table: what [[data.mixture]] tables read back as
        return "{" + ", ".join(f"{key} = {toml_value(x)}" for key, x in v.items()) + "}"
    return repr(v)


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that load_config reads back (None values are left out)."""
    out = []

    def add(section, where: str) -> None:
        values = [(key, getattr(section, key)) for key in keys(section)]
        if values:  # a section holding only subsections needs no header of its own
            out.append(f"[{where}]")
            out.extend(f"{key} = {toml_value(v)}" for key, v in values if v is not None)
            out.append("")
        for name in subsections(section):
            add(getattr(section, name), f"{where}.{name}")

    for name in subsections(cfg):
        add(getattr(cfg, name), name)
    return "\n".join(out)


def config_changes(saved_toml: str, cfg: JobConfig) -> list[str]:
    """`[section] key: old -> new` for every key whose value differs between a saved config (the
    config.toml a run wrote) and cfg; "unset" stands for a key one side lacks."""
    old, new = _flat(tomllib.loads(saved_toml)), _flat(tomllib.loads(to_toml(cfg)))
    show = lambda values, key: toml_value(values[key]) if key in values else "unset"  # noqa: E731
    return [f"[{section}] {key}: {show(old, (section, key))} -> {show(new, (section, key))}"
            for section, key in dict.fromkeys([*old, *new])
            if ((section, key) in old, old.get((section, key)))
            != ((section, key) in new, new.get((section, key)))]


def _flat(tables: dict, where: str = "") -> dict:
    """{(dotted section, key): value} of parsed TOML, nested tables ([a.b.c]) included."""
    flat = {}
    for key, value in tables.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{where}.{key}" if where else key))
        else:
            flat[(where, ALIASES.get((where, key), key))] = value
    return flat
