"""The training config.

    schema.py  the sections (one dataclass each), their keys, types, defaults and docstrings
    parse.py   load_config (TOML and the command line), the checks, to_toml, config_changes
    docs.py    --help and docs/config.md, made from the schema
"""
