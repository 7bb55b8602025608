"""The training config: typed sections with defaults, read from TOML, overridden from the command line.

    python train.py --config configs/debug.toml --training.steps 20 --loss.impl=unfused

Key names follow torchtitan v0.2 where one exists. An unknown section or key, or a value of the
wrong type, is an error that names it (and suggests the closest valid name); nothing is ignored.
"""

import dataclasses
import difflib
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
class Data:
    source: str = "stdlib"  # "stdlib" (embedded, offline), a local file/dir, or a hub name
    text_field: str = "text"
    streaming: bool = False
    synthetic: bool = False  # random tokens, for throughput runs
    val_every: int = 100  # every n-th document is held out for validation
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
    enable_checkpoint: bool = False
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    pass


def _suggest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(valid)})"


def _section_fields(section: str):
    sections = {f.name: f for f in dataclasses.fields(JobConfig)}
    if section not in sections:
        raise ConfigError(f"unknown config section [{section}]" + _suggest(section, sections))
    return {f.name: f for f in dataclasses.fields(sections[section].default_factory)}


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
        return [_coerce(where, v, typing.get_args(annotation)[0], from_text) for v in value]
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


def _set(cfg: JobConfig, section: str, key: str, value: Any, from_text: bool) -> None:
    fields = _section_fields(section)
    if key not in fields:
        raise ConfigError(f"unknown config key [{section}] {key}" + _suggest(key, fields))
    hints = typing.get_type_hints(type(getattr(cfg, section)))
    setattr(getattr(cfg, section), key,
            _coerce(f"[{section}] {key}", value, hints[key], from_text))


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
}
POSITIVE = [("training", "local_batch_size"), ("training", "seq_len"), ("training", "steps"),
            ("training", "gradient_accumulation_steps"), ("metrics", "log_freq"),
            ("checkpoint", "interval"), ("validation", "freq"), ("validation", "steps"),
            ("profiling", "profile_freq")]


def check_values(cfg: JobConfig) -> None:
    for (section, key), valid in CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in valid:
            raise ConfigError(f"[{section}] {key} = {value!r}: expected one of {valid}")
    for component in cfg.compile.components:
        if component not in ("model", "loss"):
            raise ConfigError(f"[compile] components: {component!r} is not one of 'model', 'loss'")
    for section, key in POSITIVE:
        value = getattr(getattr(cfg, section), key)
        if value < 1:
            raise ConfigError(f"[{section}] {key} = {value}: must be >= 1")


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
                _section_fields(section)
                for key, v in values.items():
                    _set(cfg, section, key, v, from_text=False)
    for name, value in pairs:
        if name == "config":
            continue
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(f"--{name}: expected --section.key" + _suggest(name, ["config"]))
        _set(cfg, section, key, value, from_text=True)
    check_values(cfg)
    return cfg


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that load_config reads back (None values are left out)."""
    out = []
    for section, values in cfg.to_dict().items():
        out.append(f"[{section}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        out.append("")
    return "\n".join(out)


def config_changes(saved_toml: str, cfg: JobConfig) -> list[str]:
    """`[section] key: old -> new` for every key whose value differs between a saved config (the
    config.toml a run wrote) and cfg; "unset" stands for a key one side lacks."""
    old, new = tomllib.loads(saved_toml), tomllib.loads(to_toml(cfg))
    show = lambda values, key: _toml_value(values[key]) if key in values else "unset"  # noqa: E731
    changes = []
    for section in dict.fromkeys([*old, *new]):
        before, after = old.get(section, {}), new.get(section, {})
        for key in dict.fromkeys([*before, *after]):
            if (key in before, before.get(key)) != (key in after, after.get(key)):
                changes.append(f"[{section}] {key}: {show(before, key)} -> {show(after, key)}")
    return changes
