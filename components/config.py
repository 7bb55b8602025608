"""The training config: typed sections with defaults, read from TOML, overridden from the command line.

    python train.py --config configs/debug.toml --training.steps 20 --loss.impl=unfused

Key names follow torchtitan v0.2 where one exists. An unknown section or key, or a value of the
wrong type, is an error that names it (and suggests the closest valid name); nothing is ignored.
"""

import dataclasses
import difflib
import math
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class Job:
    dump_folder: str = "./outputs/debug"
    description: str = ""
    print_config: bool = True


@dataclass
class Model:
    name: str = "llama"
    flavor: str = "debug"
    vocab_size: int = 0  # 0: the flavor's; may exceed the tokenizer's (padding rows)
    sdpa_backend: str = "auto"  # CUDA attention kernel: auto | cudnn | flash | efficient | math
    # Transforms of the built model, in order; the one known: "quantize.linear.float8" (float8
    # linear layers through torchao, configured in [quantize.linear.float8]).
    converters: list[str] = field(default_factory=list)


@dataclass
class Training:
    local_batch_size: int = 8
    seq_len: int = 256
    steps: int = 100
    gradient_accumulation_steps: int = 1
    max_norm: float = 1.0
    mixed_precision_param: str = "bfloat16"  # used on CUDA; the CPU trains in float32
    mixed_precision_reduce: str = "float32"  # FSDP gradient reduce-scatter dtype (CUDA)
    device: str = "auto"  # "auto": CUDA when available, else the CPU (gloo); or "cuda" / "cpu"
    seed: int = 0
    deterministic: bool = False
    nan_policy: str = "skip"  # "skip": skip the optimizer step with a warning; "stop": exit
    max_bad_steps: int = 5  # consecutive non-finite steps that stop the run under "skip"


@dataclass
class Optimizer:
    name: str = "AdamW"
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = "auto"  # "fused" | "foreach" | "for-loop" | "auto"


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    decay_type: str = "cosine"  # "cosine" | "linear" | "wsd"
    min_lr_ratio: float = 0.1
    decay_ratio: Optional[float] = None  # wsd: the fraction of steps spent decaying


@dataclass
class MixtureSource:
    """One [[data.mixture]] table: a token shard folder and its weight."""
    source: str = ""
    weight: float = 1.0

    @classmethod
    def parse(cls, where: str, text: str) -> "MixtureSource":
        """The command line's spelling, "folder:weight" (split at the last colon)."""
        source, colon, weight = text.rpartition(":")
        try:
            if not colon:
                raise ValueError
            return cls(source.strip(), float(weight))
        except ValueError:
            raise ConfigError(f"{where}: expected folder:weight, got {text!r}") from None


@dataclass
class Data:
    # "stdlib" (embedded, offline), a local .jsonl/.json/.parquet/.txt file or folder of them, a hub
    # name, or a token shard folder made by scripts.prepare_data (read in a seeded shuffled order)
    source: str = "stdlib"
    # Token shard folders mixed by weight (each one's share of the windows; they need not sum to
    # 1), in place of source. TOML: one [[data.mixture]] table per folder, with source and weight;
    # command line: --data.mixture "shards/web:0.7,shards/code:0.3" ("" for none).
    mixture: list[MixtureSource] = field(default_factory=list)
    text_field: str = "text"
    streaming: bool = False
    synthetic: bool = False  # random tokens, for throughput runs
    # text sources: every n-th document is held out for validation (token shards hold theirs out
    # when they are prepared: prepare_data.py --val-every)
    val_every: int = 100
    # text sources: tokenizer processes per rank, running ahead of training; 0 tokenizes on the
    # training thread (fine for the byte tokenizer; a 32k BPE tokenizes ~0.5M tokens/s per core)
    num_workers: int = 2
    cache_dir: str = "~/.cache/flce-recipes"
    # A document of a local .jsonl/.json/.txt file that is not UTF-8, not a JSON object or has no
    # text: "error" stops before training and names it (file, line); "skip" leaves it out, with
    # a warning naming it and a count
    on_bad_document: str = "error"


@dataclass
class Tokenizer:
    name: str = "byte"  # "byte" (built in) | "hf" (a tokenizer.json)
    path: str = ""
    bos_token: str = ""
    eos_token: str = ""


@dataclass
class Loss:
    impl: str = "flce"  # "flce" | "unfused" | "torch_chunked"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float = 0.0  # 0: none
    logit_scale: float = 1.0
    chunk_size: int = 0  # tokens per chunk; 0: automatic
    memory_lean: bool = False
    # the loss's GEMMs in float8 (e4m3, rowwise scales; impl "flce" only): "none" | "logits" |
    # "logits+dx"; softmax statistics and gradients stay fp32, dW stays bf16 (flce/float8.py)
    float8: str = "none"
    parallel: str = "sequence"  # under tensor parallelism: "sequence" | "vocab"


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1  # -1: whatever the other degrees leave
    tensor_parallel_degree: int = 1
    # "default" (every block but the last; none when dp_shard is 1) | "always" | "never" (ZeRO-2)
    fsdp_reshard_after_forward: str = "default"


@dataclass
class Checkpoint:
    enable: bool = False  # also read as enable_checkpoint, torchtitan v0.1's name
    folder: str = "checkpoint"
    interval: int = 500
    keep_latest_k: int = 0  # 0: keep all
    load_step: int = -1  # -1: the latest
    initial_load_path: str = ""
    async_mode: str = "disabled"  # "disabled" | "async"


@dataclass
class Metrics:
    log_freq: int = 10
    enable_wandb: bool = False
    wandb_project: str = "flce"
    wandb_run_name: str = ""
    wandb_mode: str = "offline"
    enable_tensorboard: bool = False


@dataclass
class Validation:
    enable: bool = False
    freq: int = 50
    steps: int = 10


@dataclass
class ActivationCheckpoint:
    mode: str = "none"  # "none" | "full" | "selective"
    selective_ac_option: str = "2"  # selective: checkpoint every n-th block


@dataclass
class Compile:
    enable: bool = False
    components: list[str] = field(default_factory=lambda: ["model"])


@dataclass
class Profiling:
    enable_profiling: bool = False
    save_traces_folder: str = "profile_traces"
    profile_freq: int = 10


@dataclass
class Float8:
    """[quantize.linear.float8]: used when [model] converters lists "quantize.linear.float8"."""
    # "tensorwise" (one scale per tensor; the fastest) | "rowwise" (one per row) |
    # "rowwise_with_gw_hp" (rowwise, with the weight gradient's GEMM in high precision)
    recipe_name: str = "tensorwise"
    # Linear layers left in high precision: a layer is skipped when any entry is a substring of
    # its name (e.g. "layers.0.", "wk"). "output" always stays: the loss reads its weight
    # directly, it never runs as a linear layer. Layers with a dimension that is not a multiple
    # of 16 are skipped too (fp8 GEMMs need it), and named in the log.
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    # FSDP all-gathers the weights cast to float8 (half the bytes of bf16); tensorwise only.
    enable_fsdp_float8_all_gather: bool = False
    # With the float8 all-gather: every weight's scale from one all-reduce after the optimizer
    # step instead of one small all-reduce per weight at each all-gather.
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    # Emulate the float8 GEMMs in high precision (same rounding): for tests on the CPU or on GPUs
    # without fp8 (compute capability < 8.9). Slow; not for training.
    emulate: bool = False


@dataclass
class QuantizeLinear:
    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    data: Data = field(default_factory=Data)
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    loss: Loss = field(default_factory=Loss)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    profiling: Profiling = field(default_factory=Profiling)
    quantize: Quantize = field(default_factory=Quantize)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    pass


def _suggest(name: str, valid) -> str:
    if not valid:
        return ""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(valid)})"


def _subsections(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)
            if dataclasses.is_dataclass(getattr(obj, f.name))]


def _keys(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)
            if not dataclasses.is_dataclass(getattr(obj, f.name))]


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
        return [_coerce(where, v, inner, from_text) for v in value]
    if dataclasses.is_dataclass(annotation):  # a table in an array of tables: [[data.mixture]]
        if from_text:
            return annotation.parse(where, value)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__} {value!r}")
        item, hints = annotation(), typing.get_type_hints(annotation)
        for key, v in value.items():
            if key not in hints:
                raise ConfigError(f"{where}: unknown key {key!r}" + _suggest(key, list(hints)))
            setattr(item, key, _coerce(f"{where} {key}", v, hints[key], from_text))
        return item
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
ALIASES = {("checkpoint", "enable_checkpoint"): "enable"}  # torchtitan v0.1's name


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
    section = _section(cfg, where)
    for key, value in table.items():
        if isinstance(value, dict) and key not in _keys(section):
            _set_table(cfg, f"{where}.{key}", value)
        else:
            _set(section, where, key, value, from_text=False)


CHOICES = {
    ("training", "nan_policy"): ("skip", "stop"),
    ("training", "mixed_precision_param"): ("bfloat16", "float32"),
    ("training", "mixed_precision_reduce"): ("float32", "bfloat16"),
    ("training", "device"): ("auto", "cuda", "cpu"),
    ("loss", "impl"): ("flce", "unfused", "torch_chunked"),
    ("loss", "float8"): ("none", "logits", "logits+dx"),
    ("loss", "parallel"): ("sequence", "vocab"),
    ("parallelism", "fsdp_reshard_after_forward"): ("default", "always", "never"),
    ("lr_scheduler", "decay_type"): ("cosine", "linear", "wsd"),
    ("optimizer", "name"): ("AdamW",),
    ("model", "name"): ("llama",),
    ("model", "sdpa_backend"): ("auto", "cudnn", "flash", "efficient", "math"),
    ("optimizer", "implementation"): ("auto", "fused", "foreach", "for-loop"),
    ("tokenizer", "name"): ("byte", "hf"),
    ("data", "on_bad_document"): ("error", "skip"),
    ("checkpoint", "async_mode"): ("disabled", "async"),
    ("activation_checkpoint", "mode"): ("none", "full", "selective"),
    ("metrics", "wandb_mode"): ("offline", "online", "disabled"),
    ("quantize.linear.float8", "recipe_name"): ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
}
CONVERTERS = ("quantize.linear.float8",)
POSITIVE = [("training", "local_batch_size"), ("training", "seq_len"), ("training", "steps"),
            ("training", "gradient_accumulation_steps"), ("metrics", "log_freq"),
            ("checkpoint", "interval"), ("validation", "freq"), ("validation", "steps"),
            ("profiling", "profile_freq")]


def check_values(cfg: JobConfig) -> None:
    for (section, key), valid in CHOICES.items():
        value = getattr(_section(cfg, section), key)
        if value not in valid:
            raise ConfigError(f"[{section}] {key} = {value!r}: expected one of {valid}")
    for component in cfg.compile.components:
        if component not in ("model", "loss"):
            raise ConfigError(f"[compile] components: {component!r} is not one of 'model', 'loss'")
    for section, key in POSITIVE:
        value = getattr(getattr(cfg, section), key)
        if value < 1:
            raise ConfigError(f"[{section}] {key} = {value}: must be >= 1")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"[data] num_workers = {cfg.data.num_workers}: must be >= 0")
    _check_mixture(cfg.data)
    for name in cfg.model.converters:
        if name not in CONVERTERS:
            raise ConfigError(f"[model] converters: {name!r} is not a known converter"
                              + _suggest(name, CONVERTERS))
        if cfg.model.converters.count(name) > 1:
            raise ConfigError(f"[model] converters lists {name!r} twice")
    float8 = cfg.quantize.linear.float8
    if float8.enable_fsdp_float8_all_gather and float8.recipe_name != "tensorwise":
        raise ConfigError("[quantize.linear.float8] enable_fsdp_float8_all_gather needs "
                          f"recipe_name = \"tensorwise\", not {float8.recipe_name!r} (torchao "
                          "all-gathers float8 weights with one scale per tensor)")
    if float8.precompute_float8_dynamic_scale_for_fsdp and not float8.enable_fsdp_float8_all_gather:
        raise ConfigError("[quantize.linear.float8] precompute_float8_dynamic_scale_for_fsdp needs "
                          "enable_fsdp_float8_all_gather = true (it precomputes that all-gather's "
                          "scales)")


def _check_mixture(data: Data) -> None:
    if data.mixture and data.source != Data.source:
        raise ConfigError(f"[data] source = {data.source!r} and [[data.mixture]] are both set: a mixture "
                          "takes the place of source, set one of them")
    seen = set()
    for i, item in enumerate(data.mixture, 1):
        where = f"[[data.mixture]] #{i}"
        if not item.source:
            raise ConfigError(f"{where}: source is empty")
        if not (math.isfinite(item.weight) and item.weight > 0):
            raise ConfigError(f"{where} ({item.source}): weight = {item.weight}: must be > 0")
        if not Path(item.source).expanduser().exists():
            raise ConfigError(f"{where}: source {item.source!r} does not exist")
        if item.source in seen:
            raise ConfigError(f"{where}: source {item.source!r} is listed twice")
        seen.add(item.source)


def load_config(argv: Optional[list[str]] = None) -> JobConfig:
    """`--config FILE` (optional) then `--section.key value` / `--section.key=value` overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: use --config FILE or --section.key value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a value")
            value, i = argv[i + 1], i + 1
        pairs.append((name, value))
        i += 1
    cfg = JobConfig()
    for name, value in pairs:
        if name == "config":
            path = Path(value)
            if not path.is_file():
                raise ConfigError(f"--config {value}: no such file")
            with open(path, "rb") as f:
                try:
                    data = tomllib.load(f)
                except tomllib.TOMLDecodeError as e:
                    raise ConfigError(f"{value}: invalid TOML: {e}") from None
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
        _set(_section(cfg, section), section, key, value, from_text=True)
    check_values(cfg)
    return cfg


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if dataclasses.is_dataclass(v):
        v = dataclasses.asdict(v)
    if isinstance(v, dict):  # an inline table: what [[data.mixture]] tables read back as
        return "{" + ", ".join(f"{key} = {_toml_value(x)}" for key, x in v.items()) + "}"
    return repr(v)


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that load_config reads back (None values are left out)."""
    out = []

    def add(section, where: str) -> None:
        values = [(key, getattr(section, key)) for key in _keys(section)]
        if values:  # a section holding only subsections needs no header of its own
            out.append(f"[{where}]")
            out.extend(f"{key} = {_toml_value(v)}" for key, v in values if v is not None)
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
    show = lambda values, key: _toml_value(values[key]) if key in values else "unset"  # noqa: E731
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
