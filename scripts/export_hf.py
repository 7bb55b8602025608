"""Export a trained Llama as a Hugging Face `LlamaForCausalLM` folder (safetensors + config.json).

    python3 -m scripts.export_hf --checkpoint outputs/debug/checkpoint/step-400 --flavor debug \\
        --out outputs/debug/hf [--vocab-size N] [--dtype bfloat16|float32] \\
        [--bos-id 256 --eos-id 257]

--checkpoint is a DCP checkpoint folder (`<dump>/checkpoint/step-<N>/`; the folder holding the
step-<N> folders picks the latest), or a `torch.save` file of a state dict. Only the model's
tensors are read: the state dict under "model" when there is one, its keys with the `model.`
prefix of the trainer's ModelWithLoss removed.

The repo's RoPE rotates adjacent pairs (Meta's complex form) while Hugging Face's rotates halves
(rotate_half), so the rows of wq and wk are permuted exactly as Hugging Face's
convert_llama_weights_to_hf.py does; the exported model then gives the same logits.

Python: `export(state_dict, args, out_dir, dtype)` and `load_model_state(path)`.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

if not __package__:  # run as a file: the repository root (models) is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.export_hf ...")

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from models import FLAVORS, Llama, LlamaArgs  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

# Wrapper segments that torch.compile (`_orig_mod.`) and activation checkpointing
# (`_checkpoint_wrapped_module.`) may leave in parameter names; the weights are the same.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")
# Buffers derived from LlamaArgs: not weights, dropped if a state dict carries them.
_DERIVED_BUFFERS = ("rope_cache", "freqs_cis")


# ------------------------------------------------------------------------------------- loading

def load_model_state(path: str | os.PathLike) -> dict[str, Tensor]:
    """The model's tensors from a checkpoint, keyed by the Llama's own parameter names.

    path: a DCP checkpoint folder (has a `.metadata` file), a folder of `step-<N>` DCP folders
    (the largest N is read), or a `torch.save` file holding a state dict or a dict whose "model"
    entry is one. From a DCP folder only the tensors under "model" are read (not the optimizer's);
    in a checkpoint with no "model" entry, the top-level tensors (torchtitan's layout, or a bare
    model state dict).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        path = _dcp_folder(path)
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
    return _normalize_keys(tensors)


def _dcp_folder(path: Path) -> Path:
    if (path / ".metadata").is_file():
        return path
    steps = [(int(m.group(1)), p) for p in path.iterdir()
             if p.is_dir() and (m := re.fullmatch(r"step-(\d+)", p.name))
             and (p / ".metadata").is_file()]
    if not steps:
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} is a folder but not a DCP checkpoint (no .metadata file) "
            "and holds no step-<N> checkpoint folders")
    _, latest = max(steps)
    print(f"reading the latest checkpoint in {path}: {latest.name}", file=sys.stderr)
    return latest


def _load_dcp_model(path: Path) -> dict[str, Tensor]:
    """The tensors under the top-level "model" entry (the top-level ones when there is none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    try:
        metadata = reader.read_metadata()
    except Exception as e:
        raise ValueError(f"checkpoint {str(path)!r}: cannot read its DCP metadata "
                         f"({type(e).__name__}: {e})") from e
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
    # Load only the selected entries, into full-size CPU tensors (sharded saves are reassembled).
    buffers = {k: torch.empty(tensor_meta[k].size, dtype=tensor_meta[k].properties.dtype)
               for k in selected}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(buffers, storage_reader=reader, no_dist=True)
    return {selected[k]: v for k, v in buffers.items()}


def _normalize_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop ModelWithLoss's `model.` prefix and compile/checkpoint wrapper segments."""
    out = {}
    for key, value in state.items():
        for segment in _WRAPPER_SEGMENTS:
            key = key.replace(segment, "")
        out[key] = value
    if out and all(k.startswith("model.") for k in out):
        out = {k[len("model."):]: v for k, v in out.items()}
    return {k: v for k, v in out.items() if k not in _DERIVED_BUFFERS}


# ------------------------------------------------------------------------------------ checking

def _expected_shapes(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of Llama(args), read from a model built on the meta device."""
    with torch.device("meta"):
        model = Llama(args, seq_len=1)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _check(state: dict[str, Tensor], args: LlamaArgs) -> None:
    expected = _expected_shapes(args)
    optional = {"output.weight"} if args.tie_embeddings else set()
    missing = sorted(set(expected) - set(state) - optional)
    unexpected = sorted(set(state) - set(expected))
    mismatched = [(k, tuple(state[k].shape), expected[k]) for k in expected
                  if k in state and tuple(state[k].shape) != expected[k]]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_listing(unexpected)}")
    for key, got, want in mismatched[:10]:
        problems.append(f"{key}: checkpoint shape {list(got)}, flavor shape {list(want)}")
    if len(mismatched) > 10:
        problems.append(f"... and {len(mismatched) - 10} more shape mismatches")
    if problems:
        hint = _hint(state, args, mismatched, unexpected, missing)
        raise ValueError("the state dict does not match the model: " + "; ".join(problems)
                         + (f" ({hint})" if hint else ""))
    for key, value in state.items():
        if not value.is_floating_point():
            raise ValueError(f"{key}: dtype {value.dtype}, expected a floating-point tensor")
        if not torch.isfinite(value).all():
            raise ValueError(f"{key}: holds non-finite values (NaN or inf)")
    if args.tie_embeddings and "output.weight" in state and not torch.equal(
            state["output.weight"], state["tok_embeddings.weight"]):
        raise ValueError("tie_embeddings is set but output.weight differs from "
                         "tok_embeddings.weight: exporting would drop the trained output weight")


def _listing(keys: list[str], limit: int = 10) -> str:
    return ", ".join(keys[:limit]) + (f", ... ({len(keys) - limit} more)" if len(keys) > limit
                                      else "")


def _hint(state, args, mismatched, unexpected, missing) -> str:
    names = {k for k, _, _ in mismatched}
    rows = state.get("tok_embeddings.weight")
    if names and names <= {"tok_embeddings.weight", "output.weight"} and rows is not None \
            and rows.ndim == 2 and rows.shape[1] == args.dim:
        return (f"the checkpoint's vocabulary has {rows.shape[0]} rows, the flavor's "
                f"{args.vocab_size}: pass --vocab-size {rows.shape[0]}")
    layers = {int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))}
    if layers and len(layers) != args.n_layers:
        return (f"the checkpoint has {len(layers)} layers, the flavor {args.n_layers}: "
                "is --flavor right?")
    if mismatched or (missing and unexpected):
        return "is --flavor right?"
    return ""


# ----------------------------------------------------------------------------------- exporting

def permute_for_hf(w: Tensor, n_heads: int, dim1: int, dim2: int) -> Tensor:
    """Rows of a q/k projection from adjacent-pair RoPE order to rotate_half order, per head.

    Hugging Face's convert_llama_weights_to_hf.py `permute`: within each head, output row
    2i (pair i's first element) moves to i and row 2i+1 to head_dim/2 + i.
    """
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def hf_state_dict(state: dict[str, Tensor], args: LlamaArgs,
                  dtype: torch.dtype) -> dict[str, Tensor]:
    """Hugging Face LlamaForCausalLM names and layouts for a checked Llama state dict."""
    head_dim = args.head_dim

    def t(key: str) -> Tensor:
        value = state[key]
        if hasattr(value, "full_tensor"):  # a DTensor, e.g. from an FSDP model's state_dict()
            value = value.full_tensor()
        return value.detach().to(device="cpu", dtype=dtype)

    out = {"model.embed_tokens.weight": t("tok_embeddings.weight")}
    for i in range(args.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "self_attn.q_proj.weight"] = permute_for_hf(
            t(src + "attention.wq.weight"), args.n_heads, args.n_heads * head_dim, args.dim)
        out[dst + "self_attn.k_proj.weight"] = permute_for_hf(
            t(src + "attention.wk.weight"), args.n_kv_heads, args.n_kv_heads * head_dim, args.dim)
        out[dst + "self_attn.v_proj.weight"] = t(src + "attention.wv.weight")
        out[dst + "self_attn.o_proj.weight"] = t(src + "attention.wo.weight")
        out[dst + "mlp.gate_proj.weight"] = t(src + "feed_forward.w1.weight")
        out[dst + "mlp.up_proj.weight"] = t(src + "feed_forward.w3.weight")
        out[dst + "mlp.down_proj.weight"] = t(src + "feed_forward.w2.weight")
        out[dst + "input_layernorm.weight"] = t(src + "attention_norm.weight")
        out[dst + "post_attention_layernorm.weight"] = t(src + "ffn_norm.weight")
    out["model.norm.weight"] = t("norm.weight")
    if not args.tie_embeddings:
        out["lm_head.weight"] = t("output.weight")
    return {k: v.contiguous() for k, v in out.items()}  # safetensors wants contiguous


def hf_config(args: LlamaArgs, dtype: torch.dtype, bos_token_id: int | None = None,
              eos_token_id: int | None = None) -> dict:
    """config.json for LlamaForCausalLM (the classic keys, which transformers 4.x and 5.x read)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    if args.rope_scaling_factor is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(args.rope_scaling_factor),
            "low_freq_factor": float(args.rope_low_freq_factor),
            "high_freq_factor": float(args.rope_high_freq_factor),
            "original_max_position_embeddings": args.rope_original_max_pos,
        }
    return config


def export(state_dict: dict[str, Tensor], args: LlamaArgs, out_dir: str | os.PathLike,
           dtype: torch.dtype | str = torch.bfloat16, *, bos_token_id: int | None = None,
           eos_token_id: int | None = None, overwrite: bool = False) -> Path:
    """Write `state_dict` (Llama names; a `model.` prefix is dropped) as a Hugging Face folder.

    The folder is written next to out_dir under a temporary name and renamed into place, so
    out_dir is either complete or absent (or, with overwrite, the old one). Raises ValueError
    when the state dict does not fit `args` (missing, unexpected or misshapen keys).
    """
    from safetensors.torch import save_file

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {list(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype}: expected one of {list(DTYPES)}")
    state = _normalize_keys({k: v for k, v in state_dict.items() if isinstance(v, Tensor)})
    _check(state, args)

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise FileExistsError(f"output {str(out_dir)!r} already exists (pass overwrite=True / "
                                  "--overwrite to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tensors = hf_state_dict(state, args, dtype)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        config = hf_config(args, dtype, bos_token_id, eos_token_id)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700, and safetensors its file 0600
        for name in ("model.safetensors", "config.json"):
            os.chmod(tmp / name, 0o644)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ----------------------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m scripts.export_hf",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a DCP checkpoint folder (<dump>/checkpoint/step-<N>), the folder of "
                             "step-<N> folders (latest), or a torch.save state dict file")
    parser.add_argument("--flavor", required=True, choices=sorted(FLAVORS))
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="the trained vocab size when it differs from the flavor's "
                             "([model] vocab_size of the run)")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--bos-id", type=int, default=None, help="bos_token_id for config.json")
    parser.add_argument("--eos-id", type=int, default=None, help="eos_token_id for config.json")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    opts = parser.parse_args(argv)

    try:
        args = FLAVORS[opts.flavor]
        if opts.vocab_size:
            args = dataclasses.replace(args, vocab_size=opts.vocab_size)
        state = load_model_state(opts.checkpoint)
        out = export(state, args, opts.out, opts.dtype, bos_token_id=opts.bos_id,
                     eos_token_id=opts.eos_id, overwrite=opts.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 1
    n = sum(v.numel() for k, v in state.items()
            if not (args.tie_embeddings and k == "output.weight"))
    print(f"wrote {out} ({opts.flavor}, {n:,} parameters, {opts.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
