"""The config read from TOML and the command line.

    python train.py --config configs/debug.toml --training.steps 20 --loss.impl=unfused

An unknown section or key, or a value of the wrong type, is an error that names it (and suggests
the closest valid name); nothing is ignored. The sections and their keys are
components/config/schema.py's; the values are checked by components/config/checks.py, and
written back as TOML by components/config/toml_out.py.
"""

import contextlib
import os
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any, Optional

from components.config.checks import check_values
from components.config.fields import ALIASES, coerce, keys, sections, subsections, suggest
from components.config.schema import ConfigError, JobConfig
from components.config.toml_out import to_toml


@contextlib.contextmanager
def config_checks():
    """The errors raised inside are the config's fault (a missing tokenizer file, a flavor too
    small for the tokenizer, a warmup longer than ...): they keep their types for callers, and
    the command line shows them as one line (exit 2) like a ConfigError."""
    try:
        yield
    except (ValueError, OSError, ImportError) as e:
        e.from_config = True
        raise


def is_config_error(error: BaseException) -> bool:
    return isinstance(error, ConfigError) or getattr(error, "from_config", False)


def refusal_line(error: BaseException) -> Optional[str]:
    """The one line for an error the user caused, shown without a traceback (exit status 2):
    "config error: ..." for the config, "error: ..." for other refusals (their classes set
    user_error: a dump folder in use, data that cannot be read); None for anything else."""
    if is_config_error(error):
        return "config error: " + " ".join(str(error).split())
    if getattr(error, "user_error", False):
        return "error: " + " ".join(str(error).split())
    return None


def _section(cfg: "JobConfig", path: str):
    """The section at a dotted path: "training", or a nested one, "quantize.linear.float8"."""
    obj, parts = cfg, path.split(".")
    for i, name in enumerate(parts):
        if name in keys(obj):
            raise ConfigError(f"[{'.'.join(parts[:i])}] {name} is a key, not a section")
        if name not in subsections(obj):
            prefix = ".".join(parts[:i] + [""])
            raise ConfigError(f"unknown config section [{'.'.join(parts[:i + 1])}]"
                              + suggest(prefix + name, [prefix + s for s in subsections(obj)]))
        obj = getattr(obj, name)
    return obj


# torchtitan's keys whose setting lives under another name here: named in the error, since the
# close-match suggestion cannot find a key in another section.
TORCHTITAN_ELSEWHERE = {
    ("training", "dataset"): "[data] source", ("training", "dataset_path"): "[data] source",
    ("training", "batch_size"): "[training] local_batch_size",  # v0.1
    ("training", "compile"): "[compile] enable",  # v0.1
    ("debug", "seed"): "[training] seed", ("debug", "deterministic"): "[training] deterministic",
    ("model", "hf_assets_path"): "[tokenizer] path", ("model", "tokenizer_path"): "[tokenizer] path",
    ("parallelism", "disable_loss_parallel"): "[loss] parallel",
}


def _torchtitan_hint(where: str, key: str) -> None:
    """Called before the section is looked up: [debug] is no section here."""
    here = TORCHTITAN_ELSEWHERE.get((where, key))
    if here is not None:
        raise ConfigError(f"unknown config key [{where}] {key}: torchtitan's [{where}] {key} is "
                          f"{here} here")


def _set(section, where: str, key: str, value: Any, from_text: bool) -> None:
    key = ALIASES.get((where, key), key)
    if key not in keys(section):
        if key in subsections(section):
            example, path = getattr(section, key), f"{where}.{key}"
            while not keys(example):
                path += "." + subsections(example)[0]
                example = getattr(example, subsections(example)[0])
            raise ConfigError(f"[{where}.{key}] is a section, not a key: set its keys, e.g. "
                              f"--{path}.{keys(example)[0]}")
        raise ConfigError(f"unknown config key [{where}] {key}" + suggest(key, keys(section)))
    hints = typing.get_type_hints(type(section))
    setattr(section, key, coerce(f"[{where}] {key}", value, hints[key], from_text))


def _set_table(cfg: "JobConfig", where: str, table: dict) -> None:
    """A TOML table's keys; nested tables are subsections ([quantize.linear.float8])."""
    for key in table:
        _torchtitan_hint(where, key)
    section = _section(cfg, where)
    for (aliased, old), key in ALIASES.items():
        if aliased == where and old in table and key in table:  # else the later one won, silently
            raise ConfigError(f"[{where}] sets both {key} and its older name {old}: keep one")
    for key, value in table.items():
        if isinstance(value, dict) and key not in keys(section):
            _set_table(cfg, f"{where}.{key}", value)
        else:
            _set(section, where, key, value, from_text=False)


HELP = ("-h", "--help")


def _argv_pairs(argv: list[str]) -> list[tuple[str, Optional[str]]]:
    """(name, value) of each `--name value` / `--name=value`; ("help", None) for -h / --help."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in HELP:
            pairs.append(("help", None))
            i += 1
            continue
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: use --config FILE or --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a value")
            value, i = argv[i + 1], i + 1
            if _key_type(value) is not None:  # `--checkpoint.enable --job.dump_folder X`
                hint = (f"write {arg} true or false" if _key_type(arg) is bool
                        else f"a value that starts with -- goes as {arg}=VALUE")
                raise ConfigError(f"{arg} needs a value: the next argument, {value}, is another "
                                  f"flag ({hint})")
        pairs.append((name, value))
        i += 1
    return pairs


def _key_type(arg: str):
    """The type of the key a command-line argument names (`--section.key`, `--config`: str), or
    None when it names none."""
    name = arg.removeprefix("--").partition("=")[0] if arg.startswith("--") else ""
    if name == "config":
        return str
    where, _, key = name.rpartition(".")
    section = dict(sections()).get(where)
    key = ALIASES.get((where, key), key)
    if section is None or key not in keys(section):
        return None
    return typing.get_type_hints(type(section))[key]


def wants_help(argv: list[str]) -> bool:
    """Whether argv asks for -h / --help in place of a key (a value "-h" is a value)."""
    try:
        return ("help", None) in _argv_pairs(argv)
    except ConfigError:  # a malformed command line asking for help still gets it
        return any(arg in HELP for arg in argv)


def check_config_not_overwritten(argv: list[str], cfg: JobConfig) -> None:
    """A ConfigError when a --config file is the <dump_folder>/config.toml the run will write
    its resolved config over, unless it is such a resolved config already (the trainer's own,
    which writing again loses nothing): a hand-written one would lose its comments and keep
    this run's command-line overrides, which its next use would then take silently."""
    written = (Path(cfg.job.dump_folder) / "config.toml").resolve()
    for name, value in _argv_pairs(argv):
        path = Path(value or "").expanduser()
        if name != "config" or path.resolve() != written:
            continue
        if path.read_text(encoding="utf-8") != to_toml(load_config(["--config", str(path)])):
            raise ConfigError(f"--config {value} is {written}, which this run writes its resolved "
                              "config to ([job] dump_folder): copy it elsewhere (configs/) or "
                              "set another dump folder")


def load_config(argv: Optional[list[str]] = None) -> JobConfig:
    """`--config FILE` (optional) then `--section.key value` / `--section.key=value` overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs = _argv_pairs(argv)
    if ("help", None) in pairs:  # train.py answers it before it gets here (components/config/docs.py)
        raise ConfigError("-h / --help lists the config keys: python3 train.py --help")
    cfg = JobConfig()
    for name, value in pairs:
        if name == "config":
            path = Path(value).expanduser()
            if path.is_dir():  # e.g. a run's dump folder: its config.toml is what was meant
                raise ConfigError(f"--config {value}: a folder, not a TOML file"
                                  + (f" (did you mean {path / 'config.toml'}?)"
                                     if (path / "config.toml").is_file() else ""))
            if not path.is_file():
                raise ConfigError(f"--config {value}: no such file")
            try:
                data = tomllib.loads(path.read_bytes().decode("utf-8"))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"{value}: invalid TOML: {e}") from None
            except OSError as e:
                raise ConfigError(f"--config {value}: cannot read it: {e.strerror}") from None
            for section, values in data.items():
                if not isinstance(values, dict):
                    raise ConfigError(f"{value}: top-level key {section!r} must be a [section]")
                _set_table(cfg, section, values)
    for name, value in pairs:
        if name == "config":
            continue
        section, dot, key = name.rpartition(".")  # the section may be nested: a.b.c.key
        if not dot:
            raise ConfigError(f"--{name}: expected --section.key" + suggest(name, ["config"]))
        _torchtitan_hint(section, key)
        _set(_section(cfg, section), section, key, value, from_text=True)
    check_values(cfg)
    _expand_home(cfg)
    return cfg


# Keys that name a file or folder: a leading ~ is the home folder, as in a shell (TOML files and
# `--key=~/x` arguments never see a shell's expansion).
PATH_KEYS = (("job", "dump_folder"), ("checkpoint", "folder"), ("checkpoint", "initial_load_path"),
             ("tokenizer", "path"), ("data", "source"), ("data", "cache_dir"))


def _expand_home(cfg: JobConfig) -> None:
    for section, key in PATH_KEYS:
        values = getattr(cfg, section)
        setattr(values, key, os.path.expanduser(getattr(values, key)))
    for part in cfg.data.mixture:
        part.source = os.path.expanduser(part.source)
