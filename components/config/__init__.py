"""The training config.

    schema.py    the sections (one dataclass each), their keys, types, defaults and docstrings
    fields.py    a section's keys and subsections, the keys' older names, a value against its type
    parse.py     load_config (TOML and the command line)
    checks.py    check_values (ranges, keys that must agree), resolve_global_batch
    toml_out.py  to_toml, config_changes: the config written back as TOML
    docs.py      --help and docs/config.md, made from the schema
"""
