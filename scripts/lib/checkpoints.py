"""A trained model as scripts/export_hf.py, generate.py and evaluate.py read it.

A checkpoint is one of:
- a DCP step folder, `<dump_folder>/checkpoint/step-<N>/`: the trainer's. Its config.toml (the
  resolved config of the run that wrote it) gives the flavor, the vocab size, the tokenizer
  and the loss's logit options;
- the folder holding step-<N> folders: the largest N with a `.metadata` is read;
- a Hugging Face LlamaForCausalLM folder (config.json + safetensors): the model from
  config.json, the tokenizer from the folder's tokenizer.json;
- for export_hf.py also a `torch.save` file of a state dict (it needs --flavor).

From a DCP folder only the tensors under "model" are read (not the optimizer's); in a
checkpoint with no "model" entry, the top-level tensors (torchtitan's layout). Relative
tokenizer paths in config.toml are read from the current directory, as the run did.
"""

import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from components import safe_dcp
from components.checkpoint_folders import list_checkpoints, saved_tokenizer
from components.checkpoint_manifest import find_damage
from components.config.schema import JobConfig
from components.config.parse import load_config
from components.initial_load import config_special_tokens
from components.tokenizer import HFTokenizer, build_tokenizer
from models import Llama, LlamaArgs, build_rope_cache
from models import hf
from parallelisms.build import model_args

# Wrapper segments that torch.compile (`_orig_mod.`) and activation checkpointing
# (`_checkpoint_wrapped_module.`) may leave in parameter names; the weights are the same.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")
# Buffers derived from LlamaArgs: not weights, dropped if a state dict carries them.
_DERIVED_BUFFERS = ("rope_cache", "freqs_cis")


def resolve(path: str | os.PathLike) -> Path:
    """The folder to read: a DCP step folder, a Hugging Face folder or a torch.save file as
    given; for a folder of step-<N> folders, the latest."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_file() or (path / ".metadata").is_file() or hf.is_hf_folder(path):
        return path
    found = list_checkpoints(path, resumable=False)  # the trainer's rule, weights only
    if not found:
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} is a folder but not a DCP checkpoint (no .metadata file), "
            "not a Hugging Face folder (config.json + model.safetensors) and holds no step-<N> "
            "checkpoint folders")
    latest = found[max(found)]
    print(f"reading the latest checkpoint in {path}: {latest.name}", file=sys.stderr)
    return latest


# ------------------------------------------------------------------------- DCP / torch.save

RUN_RECORDS = ("config.toml", "train_state.json")  # what the tools read beside the tensors

def load_model_state(path: str | os.PathLike) -> dict[str, Tensor]:
    """The model's tensors from a DCP checkpoint (or a folder of them: the latest) or a
    torch.save file (a state dict, or a dict whose "model" entry is one), keyed by the Llama's
    own parameter names."""
    path = resolve(path)
    if path.is_dir():
        state = _load_dcp_model(path)
    else:
        try:
            try:  # mmap: tensors are read when used, so a large file is not held twice
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                state = torch.load(path, map_location="cpu", weights_only=True)  # legacy format
        except Exception as e:  # a file torch.save did not write, or one with pickled objects
            raise ValueError(f"checkpoint {str(path)!r}: not a torch.save file of tensors "
                             f"({type(e).__name__}: {e})") from e
        if not isinstance(state, dict):
            raise ValueError(f"checkpoint {str(path)!r} holds a {type(state).__name__}, "
                             "expected a state dict")
        if isinstance(state.get("model"), dict):
            state = state["model"]
    tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}
    if not tensors:
        raise ValueError(f"checkpoint {str(path)!r} holds no model tensors")
    return normalize_keys(tensors)


def _load_dcp_model(path: Path) -> dict[str, Tensor]:
    """The tensors under the top-level "model" entry (the top-level ones when there is none)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if hf.is_hf_folder(path):
        raise ValueError(f"{path} is a Hugging Face folder, not a DCP checkpoint")
    metadata = safe_dcp.read_metadata(path)  # a clear error when damaged; runs no code from it
    # DCP flattens nested dicts to dotted keys; planner_data maps each to its path of dict keys.
    paths = metadata.planner_data or {}
    tensor_meta = {k: m for k, m in metadata.state_dict_metadata.items()
                   if isinstance(m, TensorStorageMetadata)}

    def under_model(key: str) -> str | None:
        parts = paths.get(key)
        if isinstance(parts, (tuple, list)) and len(parts) >= 2 and parts[0] == "model":
            return ".".join(str(p) for p in parts[1:])
        if parts is None and key.startswith("model."):
            return key[len("model."):]
        return None

    selected = {k: name for k in tensor_meta if (name := under_model(k)) is not None}
    if not selected:
        # No "model" entry: the model's tensors are at the top level (a weights-only checkpoint,
        # or torchtitan's layout, which puts the optimizer etc. in nested entries beside them).
        selected = {k: k for k in tensor_meta
                    if not isinstance(paths.get(k), (tuple, list)) or len(paths[k]) == 1}
    # The files these entries are in, checked against the save's checksums.json when it has one.
    needed = {info.relative_path for index, info in (metadata.storage_data or {}).items()
              if index.fqn in selected}
    _refuse_damage(path, needed)
    # Load only the selected entries, into full-size CPU tensors (sharded saves are reassembled).
    buffers = {k: torch.empty(tensor_meta[k].size, dtype=tensor_meta[k].properties.dtype)
               for k in selected}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        safe_dcp.load(buffers, path, no_dist=True)
    return {selected[k]: v for k, v in buffers.items()}


def normalize_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop ModelWithLoss's `model.` prefix and compile/checkpoint wrapper segments."""
    out = {}
    for key, value in state.items():
        for segment in _WRAPPER_SEGMENTS:
            key = key.replace(segment, "")
        out[key] = value
    if out and all(k.startswith("model.") for k in out):
        out = {k[len("model."):]: v for k, v in out.items()}
    return {k: v for k, v in out.items() if k not in _DERIVED_BUFFERS}


def _refuse_damage(folder: Path, names) -> None:
    """Raise when any of these files of a step folder differs from the save's checksums.json."""
    damage = find_damage(folder, names=names)
    if damage is not None:
        raise safe_dcp.DamagedCheckpointError(f"{damage}; restore it, or read an earlier "
                                              f"checkpoint (another step-<N> folder of "
                                              f"{folder.parent})")


def run_config(folder: Path) -> JobConfig | None:
    """The config.toml of the run that wrote a step folder; None when there is none. It and
    train_state.json (the tokenizer's record) are checked against the save's checksums first:
    a config.toml changed since the save that still parsed built another model than the run's
    (its RoPE, say) without a word. The trainer checks train_state.json but not config.toml,
    which it only reads to list what a resume changes; the tools build the model from it."""
    _refuse_damage(folder, RUN_RECORDS)
    path = folder / "config.toml"
    if not path.is_file():
        return None
    try:
        return load_config(["--config", str(path)])
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def run_tokenizer(cfg: JobConfig, path: str | None = None):
    """The run's tokenizer ([tokenizer]); path replaces [tokenizer] path when given."""
    if path and cfg.tokenizer.name != "hf":
        # build_tokenizer would drop it: the run's own tokenizer, the option silently unused
        raise ValueError(f"--tokenizer {path}: the run trained with [tokenizer] name = "
                         f"{cfg.tokenizer.name!r}, which reads no file: leave --tokenizer out")
    tokenizer_path = path or cfg.tokenizer.path
    if (cfg.tokenizer.name == "hf" and tokenizer_path
            and not Path(tokenizer_path).expanduser().exists()):
        raise FileNotFoundError(f"the run's [tokenizer] path {tokenizer_path!r} does not exist from "
                                f"here ({Path.cwd()}): run from the run's directory or pass "
                                "--tokenizer PATH")
    return build_tokenizer(cfg.tokenizer.name, tokenizer_path or None,
                           cfg.tokenizer.bos_token or None, cfg.tokenizer.eos_token or None)


# ------------------------------------------------------------------------- a model to run

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    """auto: CUDA when there is a GPU, else the CPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    return torch.device("cuda" if name != "cpu" and torch.cuda.is_available() else "cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on a GPU (the trainer's forward), float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass
class LoadedModel:
    model: Llama  # eval mode, on the device asked for
    args: LlamaArgs
    tokenizer: object  # components.tokenizer's ByteTokenizer or HFTokenizer
    folder: Path  # the folder read
    config: JobConfig | None  # the run's config (DCP checkpoints)
    logit_scale: float = 1.0  # [loss] logit_scale and softcap: part of the trained logits
    softcap: float | None = None


def hf_tokenizer(folder: Path, path: str | None = None) -> HFTokenizer:
    """A Hugging Face folder's tokenizer.json, bos/eos from its config.json when it names them."""
    if path and not Path(path).is_file():
        raise FileNotFoundError(f"--tokenizer {path}: no such file")
    path = Path(path) if path else folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json: pass --tokenizer PATH")
    return HFTokenizer(path, **config_special_tokens(hf.read_config(folder), path))


def _trained_tokenizer(folder: Path, config: JobConfig | None) -> tuple[str, int, str] | None:
    """(fingerprint, vocab size, what) of the tokenizer the run trained with: recorded in the
    checkpoint's train_state.json, else (config given) the run's [tokenizer] when it is at hand;
    None when neither tells."""
    record = saved_tokenizer(folder, strict=True)
    if record is not None:
        return record["fingerprint"], record["vocab_size"], "the run's tokenizer"
    if config is None:
        return None
    try:
        run = run_tokenizer(config)
    except (OSError, ValueError):
        return None
    return run.fingerprint(), run.vocab_size, f"the run's tokenizer {config.tokenizer.path}"


def _check_vocabulary(tokenizer, path, fingerprint: str, vocab_size: int,
                      what: str = "the run's tokenizer") -> None:
    """Another vocabulary than the model's makes every id mean another token: garbage out."""
    if tokenizer.fingerprint() == fingerprint:
        return
    given = f"the tokenizer {path}" if path else "the tokenizer"
    if tokenizer.vocab_size != vocab_size:
        differs = f"has {tokenizer.vocab_size} ids, {what} had {vocab_size}"
    else:
        differs = f"has {vocab_size} ids as {what} had, but other tokens or bos/eos ids"
    raise ValueError(f"{given} {differs}: the model's ids would mean other tokens; pass the "
                     "tokenizer the model was trained with")


def checked_run_tokenizer(folder: Path, config: JobConfig, path: str | None = None):
    """The run's tokenizer (or the one at path), refused when it is not the one the checkpoint
    in folder was trained with: the run's tokenizer file may have been replaced since."""
    tokenizer = run_tokenizer(config, path)
    trained = _trained_tokenizer(folder, config if path else None)
    if trained is not None:
        _check_vocabulary(tokenizer, path or config.tokenizer.path, *trained)
    return tokenizer


def non_finite(named) -> list[str]:
    """The names of the (name, tensor) pairs whose tensor holds a NaN or an inf, found on the
    tensors' device with one host sync for all of them."""
    names, tensors = zip(*named)
    finite = torch.stack([torch.isfinite(t).all() for t in tensors]).tolist()
    return [name for name, ok in zip(names, finite) if not ok]


def _refuse_non_finite(model: Llama, folder: Path, hf_folder: bool) -> None:
    """A ValueError naming the first weight that holds a NaN or an inf (as the folder names it).
    Such weights (a run that diverged, a damaged file that no checksum covers: a Hugging Face
    folder, a checkpoint saved before checksums) make every logit NaN: sampling failed deep in
    torch.multinomial, greedy decoding and the loss gave garbage. Checked once, on the device
    and with one host sync, rather than on every generated token."""
    bad = [hf.hf_name(name) if hf_folder else name
           for name in non_finite(model.named_parameters())]
    if bad:
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise ValueError(f"{folder}: {bad[0]}{more} holds non-finite values (NaN or inf): the "
                         "model's outputs would be NaN; a run that diverged, or a damaged file")


def load_model(path: str | os.PathLike, device: torch.device, dtype: torch.dtype = torch.float32,
               seq_len: int | None = None, tokenizer_path: str | None = None) -> LoadedModel:
    """A checkpoint (DCP, a folder of them, or a Hugging Face folder) as a Llama in eval mode,
    with the tokenizer to use. seq_len: the longest sequence it will run (RoPE rows; default
    and most: the model's max_seq_len). Weights holding a NaN or an inf are refused."""
    folder = resolve(path)
    if not folder.is_dir():
        raise ValueError(f"{folder}: expected a checkpoint folder, not a file")
    config, logit_scale, softcap = None, 1.0, None
    if hf.is_hf_folder(folder):
        args = hf.args_from_hf_config(hf.read_config(folder), str(folder / hf.CONFIG))
        state = hf.load_hf_weights(folder, args)
        tokenizer = hf_tokenizer(folder, tokenizer_path)
        if tokenizer_path and (folder / "tokenizer.json").is_file():
            own = hf_tokenizer(folder)
            _check_vocabulary(tokenizer, tokenizer_path, own.fingerprint(), own.vocab_size,
                              "the folder's tokenizer.json")
    else:
        config = run_config(folder)
        if config is None:
            raise FileNotFoundError(f"{folder} has no config.toml (written with every checkpoint "
                                    "of this trainer): cannot tell the model and tokenizer")
        args = model_args(config)
        state = load_model_state(folder)
        tokenizer = checked_run_tokenizer(folder, config, tokenizer_path)
        logit_scale, softcap = config.loss.logit_scale, config.loss.softcap or None
    if tokenizer.vocab_size > args.vocab_size:
        raise ValueError(f"the tokenizer{f' {tokenizer_path}' if tokenizer_path else ''} has "
                         f"{tokenizer.vocab_size} ids, the model {args.vocab_size}: not the "
                         "model's vocabulary; pass the tokenizer it was trained with")
    seq_len = min(seq_len or args.max_seq_len, args.max_seq_len)
    with torch.device("meta"):
        model = Llama(args, seq_len=seq_len)
    model = model.to(dtype).to_empty(device=device)
    try:
        model.load_state_dict(state, strict=True)  # copies, in the model's dtype
    except RuntimeError as e:
        raise ValueError(f"{folder}: the weights do not fit the model its config describes: "
                         f"{' '.join(str(e).split())[:500]}") from e
    _refuse_non_finite(model, folder, hf.is_hf_folder(folder))
    model.rope_cache = build_rope_cache(args, seq_len, device)  # derived, not in checkpoints
    return LoadedModel(model.eval(), args, tokenizer, folder, config, logit_scale, softcap)
