"""The checks of a config's values once read (or built in code): each against its field's type,
then ranges and keys that must agree; and [training] global_batch_size resolved once the
data-parallel degree is known.
"""

import math
import os
import typing
from pathlib import Path
from typing import Optional

from components.config.fields import coerce, keys, subsections
from components.config.schema import ConfigError, Data, JobConfig


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
    # "" is the current folder to Path: every data file under it read, or the caches written there
    if not cfg.data.source.strip():
        raise ConfigError(f"[data] source is empty: name a file, folder or dataset (the default: "
                          f"{Data.source!r})")
    if not cfg.data.cache_dir.strip():
        raise ConfigError(f"[data] cache_dir is empty: name the folder the data caches go to "
                          f"(the default: {Data.cache_dir!r})")
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
    _check_checkpoint_folder(cfg)
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
    for name in keys(section):
        coerce(f"[{where}] {name}", getattr(section, name), hints[name], from_text=False)
    for name in subsections(section):
        _check_types(getattr(section, name), f"{where}.{name}" if where else name)


# What a run writes in its dump folder before its first profiled step or save (components/
# metrics.py, train.py, components/lock.py): a profiling or checkpoint folder of one of these
# names cannot be made.
RUN_FILES = ("metrics.jsonl", "config.toml", "run.lock")
TENSORBOARD_FOLDER = "tb"  # components/metrics.py's; a fresh run sets an earlier run's aside
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
        # inside TensorBoard's folder (tb/plugins/profile, where its profile plugin looks) a
        # later fresh run set tb/ aside first and then failed to find the traces' folder in it
        taken = _taken(dump, dump / value, (*RUN_FILES, TENSORBOARD_FOLDER))
        if taken is not None:
            what = ("TensorBoard's folder, which a fresh run sets aside whole"
                    if taken.name == TENSORBOARD_FOLDER else "the run's own file, not a folder")
            raise ConfigError(f"[profiling] {key} = {value!r}: {taken} is {what}: name another "
                              "folder")
        for n in range(1, len(parts) + 1):
            path = dump.joinpath(*parts[:n])
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


def _taken(dump: Path, folder: Path, names) -> Optional[Path]:
    """dump / the first of names that folder is or lies in (compared resolved), else None."""
    resolved = folder.resolve()
    for name in names:
        taken = dump / name
        if resolved == taken.resolve() or taken.resolve() in resolved.parents:
            return taken
    return None


def _check_checkpoint_folder(cfg: JobConfig) -> None:
    """The checkpoint folder is made at the first save: at a run's own file it failed there,
    after every step before it (a NotADirectoryError's traceback); and inside the TensorBoard
    folder it went aside with that folder when a later fresh run set an earlier run's outputs
    aside, and the run after that started again from step 1."""
    dump = Path(cfg.job.dump_folder).expanduser().resolve()
    taken = _taken(dump, dump / Path(cfg.checkpoint.folder).expanduser(),
                   (*RUN_FILES, TENSORBOARD_FOLDER))
    if taken is not None:
        what = "TensorBoard's folder" if taken.name == TENSORBOARD_FOLDER else "the run's own file"
        raise ConfigError(f"[checkpoint] folder = {cfg.checkpoint.folder!r}: {taken} is "
                          f"{what}: name another folder")


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
