"""The config read from TOML and the command line, checked, and written back as TOML.

    python train.py --config configs/debug.toml --training.steps 20 --loss.impl=unfused

An unknown section or key, or a value of the wrong type, is an error that names it (and suggests
the closest valid name); nothing is ignored. The sections and their keys are
components/config/schema.py's.
"""

import contextlib
import dataclasses
import difflib
import math
import os
import re
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

from components.config.schema import ConfigError, Data, JobConfig


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


def _suggest(name: Any, valid, otherwise: Optional[str] = None) -> str:
    """" (did you mean 'x'?)" for the closest valid name; else otherwise, or the list of them."""
    if not valid:
        return ""
    close = difflib.get_close_matches(str(name), [str(v) for v in valid], n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (valid: {', '.join(map(str, valid))})" if otherwise is None else otherwise


def _subsections(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)
            if dataclasses.is_dataclass(getattr(obj, f.name))]


def _keys(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)
            if not dataclasses.is_dataclass(getattr(obj, f.name))]


def sections(obj=None, where: str = "") -> list[tuple[str, Any]]:
    """(dotted name, section) of every section that holds keys, nested ones included, in order:
    ("job", Job(...)), ..., ("quantize.linear.float8", Float8(...)); of a default JobConfig
    unless one is given."""
    obj = JobConfig() if obj is None else obj
    found = [(where, obj)] if where and _keys(obj) else []
    for name in _subsections(obj):
        found += sections(getattr(obj, name), f"{where}.{name}" if where else name)
    return found


def _section(cfg: "JobConfig", path: str):
    """The section at a dotted path: "training", or a nested one, "quantize.linear.float8"."""
    obj, parts = cfg, path.split(".")
    for i, name in enumerate(parts):
        if name in _keys(obj):
            raise ConfigError(f"[{'.'.join(parts[:i])}] {name} is a key, not a section")
        if name not in _subsections(obj):
            prefix = ".".join(parts[:i] + [""])
            raise ConfigError(f"unknown config section [{'.'.join(parts[:i + 1])}]"
                              + _suggest(prefix + name, [prefix + s for s in _subsections(obj)]))
        obj = getattr(obj, name)
    return obj


def _coerce(where: str, value: Any, annotation, from_text: bool) -> Any:
    """Check (TOML) or parse (command line) one value against its field's type."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        inner = [a for a in typing.get_args(annotation) if a is not type(None)][0]
        if value is None or (from_text and value.lower() in ("none", "null", "")):
            return None
        return _coerce(where, value, inner, from_text)
    if origin is list:
        if from_text:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = typing.get_args(annotation)[0]
        if dataclasses.is_dataclass(inner):  # "[data] mixture" -> "[[data.mixture]] #1"
            section, _, key = where.removeprefix("[").partition("] ")
            return [_coerce(f"[[{section}.{key}]] #{i}", v, inner, from_text) for i, v in enumerate(value, 1)]
        return [_coerce(f"{where}:", v, inner, from_text) for v in value]
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            # where is "[section] key", or "[section] key:" for an item of a list
            what = f"{where} {value!r} is not" if where.endswith(":") else f"{where} = {value!r}: expected"
            raise ConfigError(f"{what} one of {', '.join(map(repr, allowed))}"
                              + _suggest(value, allowed, ""))
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
                raise ConfigError(f"{where}: unknown key {key!r}" + _suggest(key, list(hints)))
            setattr(item, key, _coerce(f"{where} {key}", v, hints[key], from_text))
        return item
    where = where.removesuffix(":")  # an item of a list is named by the list
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


# Keys also accepted under an older name: (section, old name) -> the name.
ALIASES = {("checkpoint", "enable_checkpoint"): "enable",  # torchtitan v0.1's name
           ("lr_scheduler", "min_lr_ratio"): "min_lr_factor"}  # this repo's name before torchtitan's


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
    if key not in _keys(section):
        if key in _subsections(section):
            example, path = getattr(section, key), f"{where}.{key}"
            while not _keys(example):
                path += "." + _subsections(example)[0]
                example = getattr(example, _subsections(example)[0])
            raise ConfigError(f"[{where}.{key}] is a section, not a key: set its keys, e.g. "
                              f"--{path}.{_keys(example)[0]}")
        raise ConfigError(f"unknown config key [{where}] {key}" + _suggest(key, _keys(section)))
    hints = typing.get_type_hints(type(section))
    setattr(section, key, _coerce(f"[{where}] {key}", value, hints[key], from_text))


def _set_table(cfg: "JobConfig", where: str, table: dict) -> None:
    """A TOML table's keys; nested tables are subsections ([quantize.linear.float8])."""
    for key in table:
        _torchtitan_hint(where, key)
    section = _section(cfg, where)
    for (aliased, old), key in ALIASES.items():
        if aliased == where and old in table and key in table:  # else the later one won, silently
            raise ConfigError(f"[{where}] sets both {key} and its older name {old}: keep one")
    for key, value in table.items():
        if isinstance(value, dict) and key not in _keys(section):
            _set_table(cfg, f"{where}.{key}", value)
        else:
            _set(section, where, key, value, from_text=False)


POSITIVE = [("training", "local_batch_size"), ("training", "seq_len"), ("training", "steps"),
            ("training", "gradient_accumulation_steps"), ("metrics", "log_freq"),
            ("checkpoint", "interval"), ("validation", "freq"), ("validation", "steps"),
            ("profiling", "profile_freq"), ("training", "max_bad_steps"),
            ("comm", "init_timeout_seconds"), ("comm", "train_timeout_seconds")]


def check_values(cfg: JobConfig) -> None:
    """Every value against its field's type (a JobConfig built or changed in code has not been
    through the parser), then what types cannot express: ranges, and keys that must agree."""
    _check_types(cfg, "")
    if not cfg.job.dump_folder.strip():
        raise ConfigError("[job] dump_folder is empty: name the folder the run writes to")
    if cfg.checkpoint.load_step < -1:
        raise ConfigError(f"[checkpoint] load_step = {cfg.checkpoint.load_step}: must be a step "
                          ">= 0, or -1 for the latest")
    if cfg.checkpoint.load_step != -1 and not cfg.checkpoint.enable:
        # such a run neither saves nor resumes: it trained from step 1, setting the folder's
        # metrics aside, where a resume was asked for
        raise ConfigError(f"[checkpoint] load_step = {cfg.checkpoint.load_step} resumes from a "
                          "checkpoint, but [checkpoint] enable = false: set enable = true")
    for section, key in POSITIVE:
        value = getattr(getattr(cfg, section), key)
        if value < 1:
            raise ConfigError(f"[{section}] {key} = {value}: must be >= 1")
    if cfg.training.global_batch_size < 1 and cfg.training.global_batch_size != -1:
        raise ConfigError(f"[training] global_batch_size = {cfg.training.global_batch_size}: must be "
                          ">= 1, or -1 for local_batch_size x the data-parallel degree")
    if cfg.model.max_seq_len < 0:
        raise ConfigError(f"[model] max_seq_len = {cfg.model.max_seq_len}: must be >= 1, or 0 for "
                          "the flavor's")
    factor = cfg.model.rope_scaling_factor
    if factor != 0 and not (math.isfinite(factor) and factor >= 1):
        raise ConfigError(f"[model] rope_scaling_factor = {factor}: must be >= 1 (it stretches "
                          "wavelengths), or 0 for the flavor's")
    if not -(1 << 63) <= cfg.training.seed < (1 << 63) - 1:  # torch's generators take 64 bits
        raise ConfigError(f"[training] seed = {cfg.training.seed}: must be within -2**63 .. "
                          "2**63 - 2 (the validation split is seeded with seed + 1)")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"[data] num_workers = {cfg.data.num_workers}: must be >= 0")
    if cfg.data.val_every < 0 or cfg.data.val_every == 1:
        raise ConfigError(f"[data] val_every = {cfg.data.val_every}: must be 0 (none held out) "
                          "or >= 2 (every n-th document is held out; 1 would hold out all)")
    if cfg.model.vocab_size < 0:
        raise ConfigError(f"[model] vocab_size = {cfg.model.vocab_size}: must be >= 1, or 0 for "
                          "the flavor's")
    if cfg.tokenizer.name == "byte" and cfg.tokenizer.path:
        raise ConfigError(f"[tokenizer] path = {cfg.tokenizer.path!r} is set, but name = \"byte\" "
                          "reads no file: set name = \"hf\" to use it, or leave path empty")
    if math.isnan(cfg.training.max_norm):  # every comparison with it is false: no clipping
        raise ConfigError("[training] max_norm = nan: must be a number (0 or less: no clipping)")
    if cfg.checkpoint.keep_latest_k < 0:
        raise ConfigError(f"[checkpoint] keep_latest_k = {cfg.checkpoint.keep_latest_k}: must be "
                          ">= 0 (0: keep all)")
    if cfg.comm.trace_buf_size < 0:
        raise ConfigError(f"[comm] trace_buf_size = {cfg.comm.trace_buf_size}: must be >= 0 (0: no "
                          "flight recorder)")
    if "/" in cfg.comm.save_traces_file_prefix:  # NCCL would not make the folder: no record written
        raise ConfigError(f"[comm] save_traces_file_prefix = {cfg.comm.save_traces_file_prefix!r}: "
                          "a file name's start, without '/' (the folder is save_traces_folder)")
    _check_profiling_folders(cfg)
    _check_mixture(cfg.data)
    for name in cfg.model.converters:
        if cfg.model.converters.count(name) > 1:
            raise ConfigError(f"[model] converters lists {name!r} twice")
    if cfg.compile.enable and not cfg.compile.components:
        raise ConfigError("[compile] enable = true with components empty compiles nothing: list "
                          "\"model\" and/or \"loss\", or set enable = false")
    for name in cfg.compile.components:
        if cfg.compile.components.count(name) > 1:
            raise ConfigError(f"[compile] components lists {name!r} twice")
    ac = cfg.activation_checkpoint
    if not 0 <= ac.memory_budget <= 1:
        raise ConfigError(f"[activation_checkpoint] memory_budget = {ac.memory_budget}: must be "
                          "in [0, 1] (the share of a block's activation memory kept)")
    if ac.mode == "memory_budget" and not (cfg.compile.enable and "model" in cfg.compile.components):
        raise ConfigError("[activation_checkpoint] mode = \"memory_budget\" needs [compile] enable "
                          "= true with \"model\" in components (the compiler picks what to recompute)")
    float8 = cfg.quantize.linear.float8
    if float8.enable_fsdp_float8_all_gather and float8.recipe_name != "tensorwise":
        raise ConfigError("[quantize.linear.float8] enable_fsdp_float8_all_gather needs "
                          f"recipe_name = \"tensorwise\", not {float8.recipe_name!r} (torchao "
                          "all-gathers float8 weights with one scale per tensor)")
    if float8.precompute_float8_dynamic_scale_for_fsdp and not float8.enable_fsdp_float8_all_gather:
        raise ConfigError("[quantize.linear.float8] precompute_float8_dynamic_scale_for_fsdp needs "
                          "enable_fsdp_float8_all_gather = true (it precomputes that all-gather's "
                          "scales)")


def resolve_global_batch(cfg: JobConfig, dp_degree: int) -> Optional[str]:
    """[training] global_batch_size (torchtitan's key) as gradient_accumulation_steps, once the
    data-parallel degree is known: the optimizer step keeps its size on any number of GPUs. Set,
    it wins over a gradient_accumulation_steps that disagrees (a run's config.toml records the
    accumulation it resolved, and may be launched again on other GPUs): a warning line says so."""
    training = cfg.training
    wanted, local = training.global_batch_size, training.local_batch_size
    if wanted == -1:
        return None
    per_micro_step = local * dp_degree
    if wanted % per_micro_step:
        raise ConfigError(f"[training] global_batch_size = {wanted} is not a multiple of "
                          f"local_batch_size x the data-parallel degree = {local} x {dp_degree}")
    steps, given = wanted // per_micro_step, training.gradient_accumulation_steps
    training.gradient_accumulation_steps = steps
    if given in (1, steps):
        return None
    return (f"warning: [training] global_batch_size = {wanted} makes {steps} micro-batch(es) a "
            f"step at local_batch_size {local} on {dp_degree} data-parallel rank(s): "
            f"gradient_accumulation_steps = {given} is replaced by {steps}")


def _check_types(section, where: str) -> None:
    hints = typing.get_type_hints(type(section))
    for name in _keys(section):
        _coerce(f"[{where}] {name}", getattr(section, name), hints[name], from_text=False)
    for name in _subsections(section):
        _check_types(getattr(section, name), f"{where}.{name}" if where else name)


# What a run writes in its dump folder before its first profiled step (components/metrics.py,
# train.py, components/lock.py): a profiling folder of one of these names cannot be made.
RUN_FILES = ("metrics.jsonl", "config.toml", "run.lock")
PROFILING_FOLDERS = ("save_traces_folder", "save_memory_snapshot_folder")


def _check_profiling_folders(cfg: JobConfig) -> None:
    """The profiling folders are made at the first profiled step, maybe hours in: one that
    cannot be made (a file on the way) is refused when the config is read. Inside the dump
    folder only: a fresh run sets an earlier run's aside from there, and "" or "." would write
    step-<N>/ among the run's own files."""
    dump = Path(cfg.job.dump_folder).expanduser()
    for key in PROFILING_FOLDERS:
        value = getattr(cfg.profiling, key)
        parts = Path(os.path.normpath(value)).parts if value.strip() else ()  # "." has none
        if not parts or os.path.isabs(value) or parts[0] == "..":
            raise ConfigError(f"[profiling] {key} = {value!r}: must name a folder inside the "
                              f"dump folder, as a relative path (the default: "
                              f"{getattr(type(cfg.profiling), key)!r})")
        for n in range(1, len(parts) + 1):
            path = dump.joinpath(*parts[:n])
            if n == 1 and parts[0] in RUN_FILES:
                raise ConfigError(f"[profiling] {key} = {value!r}: {path} is the run's own "
                                  "file, not a folder: name another folder")
            if path.exists() and not path.is_dir():
                raise ConfigError(f"[profiling] {key} = {value!r}: {path} is a file, not a "
                                  "folder: name another folder")
    # Each writes step-<N>/ folders: in one folder they collide (a trace in step-2/ made the
    # save of step 2 fail renaming step-2.tmp onto it); and a fresh run sets an earlier run's
    # profiling folder aside whole, with whatever folder it holds.
    # (Checked whether or not profiling or checkpointing is on: the set-aside goes by the
    # folders' names, and a later run may turn either on.)
    profiling = {f"[profiling] {key}": (dump / getattr(cfg.profiling, key)).resolve()
                 for key in PROFILING_FOLDERS}
    checkpoints = (dump / cfg.checkpoint.folder).resolve()
    folders = {**profiling, "[checkpoint] folder": checkpoints}
    for key, path in profiling.items():
        for other, other_path in folders.items():
            if other != key and (path == other_path or path in other_path.parents):
                raise ConfigError(f"{key} {'is' if path == other_path else 'holds'} {other} "
                                  f"({other_path}): each writes its own step-<N>/ folders; name "
                                  "separate folders")
        if checkpoints in path.parents and path.relative_to(checkpoints).parts[0].startswith(
                "step-"):
            raise ConfigError(f"{key} ({path}) is inside a checkpoint's step folder: name a "
                              "folder outside [checkpoint] folder's step-<N>/")


def _check_mixture(data: Data) -> None:
    if data.mixture and data.source != Data.source:
        raise ConfigError(f"[data] source = {data.source!r} and [[data.mixture]] are both set: a mixture "
                          "takes the place of source, set one of them")
    seen = {}
    for i, item in enumerate(data.mixture, 1):
        where = f"[[data.mixture]] #{i}"
        if not item.source:
            raise ConfigError(f"{where}: source is empty")
        if not (math.isfinite(item.weight) and item.weight > 0):
            raise ConfigError(f"{where} ({item.source}): weight = {item.weight}: must be > 0")
        if not Path(item.source).expanduser().exists():
            raise ConfigError(f"{where}: source {item.source!r} does not exist")
        folder = Path(item.source).expanduser().resolve()  # "shards/web" = "./shards/web/"
        if folder in seen:
            raise ConfigError(f"{where}: source {item.source!r} is listed twice (as "
                              f"{seen[folder]!r} too)")
        seen[folder] = item.source


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
    if section is None or key not in _keys(section):
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
            raise ConfigError(f"--{name}: expected --section.key" + _suggest(name, ["config"]))
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
        values = [(key, getattr(section, key)) for key in _keys(section)]
        if values:  # a section holding only subsections needs no header of its own
            out.append(f"[{where}]")
            out.extend(f"{key} = {toml_value(v)}" for key, v in values if v is not None)
            out.append("")
        for name in _subsections(section):
            add(getattr(section, name), f"{where}.{name}")

    for name in _subsections(cfg):
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
