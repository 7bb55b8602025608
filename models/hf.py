"""This Llama <-> Hugging Face `LlamaForCausalLM`: parameter names and layouts, config.json, and
folders of safetensors files (one file, or shards with a `model.safetensors.index.json`).

The layouts differ in one place: this repo's RoPE rotates adjacent pairs of each head's
dimensions (Meta's complex form), transformers' rotates the two halves (rotate_half). So the
rows of wq and wk are permuted per head on the way out, as transformers'
convert_llama_weights_to_hf.py does, and permuted back on the way in; every other tensor keeps
its values and only changes its name. Both directions are exact (a permutation of rows).

safetensors is imported where it is used, so building a model needs no extra package.
"""

import json
import math
import os
from pathlib import Path

import torch
from torch import Tensor

from models.args import LlamaArgs

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

# (this Llama's name, transformers' name) per block; wq/wk are permuted as well as renamed
_BLOCK_NAMES = (
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
)
_BLOCK_TO_HF = dict(_BLOCK_NAMES)
_TOP_TO_HF = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


# ---------------------------------------------------------------------------------- RoPE rows

def permute_to_hf(w: Tensor, n_heads: int) -> Tensor:
    """Rows of a q/k projection from adjacent-pair order to rotate_half order, per head: row 2i
    (pair i's first element) moves to i and row 2i+1 to head_dim/2 + i (transformers'
    convert_llama_weights_to_hf.py `permute`)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: Tensor, n_heads: int) -> Tensor:
    """The inverse of permute_to_hf: rotate_half order back to adjacent pairs."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# ---------------------------------------------------------------------------------- state dicts

def to_hf(state: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """transformers' names and layouts for a Llama state dict (this Llama's names, all keys
    present). A tied model gets no lm_head.weight, as transformers saves one."""
    out = {}
    for key in _names(args) + ([] if args.tie_embeddings else ["output.weight"]):
        value = state[key]
        if key.endswith("attention.wq.weight"):
            value = permute_to_hf(value, args.n_heads)
        elif key.endswith("attention.wk.weight"):
            value = permute_to_hf(value, args.n_kv_heads)
        out[hf_name(key)] = value
    return out


def from_hf(state: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """This Llama's names and layouts for a LlamaForCausalLM state dict whose shapes fit `args`
    (check_hf_state first). Without an lm_head.weight (tied embeddings) the output projection
    is the embedding table."""
    out = {}
    for key in _names(args):
        value = state[hf_name(key)]
        if key.endswith("attention.wq.weight"):
            value = permute_from_hf(value, args.n_heads)
        elif key.endswith("attention.wk.weight"):
            value = permute_from_hf(value, args.n_kv_heads)
        out[key] = value
    # tied: an lm_head.weight the folder may hold equals the embedding (check_hf_state)
    out["output.weight"] = (out["tok_embeddings.weight"] if args.tie_embeddings
                            else state[hf_name("output.weight")])
    return out


def _names(args: LlamaArgs) -> list[str]:
    """This Llama's tensor names, in order, but output.weight (absent where it is tied)."""
    return ["tok_embeddings.weight", *(f"layers.{i}.{name}" for i in range(args.n_layers)
                                       for name, _ in _BLOCK_NAMES), "norm.weight"]


def hf_name(key: str) -> str:
    """transformers' name of one of this Llama's tensors (to_hf's renaming); key itself for a
    name it does not know."""
    layer, _, name = key.removeprefix("layers.").partition(".")
    if key.startswith("layers.") and layer.isdigit() and name in _BLOCK_TO_HF:
        return f"model.layers.{layer}.{_BLOCK_TO_HF[name]}"
    return _TOP_TO_HF.get(key, key)


def hf_shapes(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """transformers' parameter names and shapes for a model of `args`."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    block = {"self_attn.q_proj.weight": (q, args.dim), "self_attn.k_proj.weight": (kv, args.dim),
             "self_attn.v_proj.weight": (kv, args.dim), "self_attn.o_proj.weight": (args.dim, q),
             "mlp.gate_proj.weight": (args.ffn_dim, args.dim),
             "mlp.up_proj.weight": (args.ffn_dim, args.dim),
             "mlp.down_proj.weight": (args.dim, args.ffn_dim),
             "input_layernorm.weight": (args.dim,),
             "post_attention_layernorm.weight": (args.dim,)}
    shapes = {"model.embed_tokens.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in block.items()})
    shapes["model.norm.weight"] = (args.dim,)
    if not args.tie_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, args.dim)
    return shapes


def check_hf_state(state: dict[str, Tensor], args: LlamaArgs, where: str) -> None:
    """A one-line error naming what does not fit: missing or misshapen keys, non-float dtypes.
    Extra keys are refused too (a model with more layers than config.json says, or biases),
    except a tied model's redundant lm_head.weight."""
    expected = hf_shapes(args)
    problems = []
    missing = [k for k in expected if k not in state]
    if missing:
        problems.append(f"missing {len(missing)} tensors ({', '.join(missing[:3])}"
                        + (", ..." if len(missing) > 3 else "") + ")")
    extra = [k for k in state if k not in expected
             and not (k == "lm_head.weight" and args.tie_embeddings)]
    if extra:
        problems.append(f"unexpected tensors ({', '.join(sorted(extra)[:3])}"
                        + (", ..." if len(extra) > 3 else "") + ")")
    for key, shape in expected.items():
        if key in state and tuple(state[key].shape) != shape:
            problems.append(f"{key} has shape {list(state[key].shape)}, config.json implies "
                            f"{list(shape)}")
            break
    for key, value in state.items():
        if not value.is_floating_point():
            problems.append(f"{key} has dtype {value.dtype}, expected a floating-point type")
            break
    head, embedding = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if (args.tie_embeddings and not problems and head is not None and embedding is not None
            and not torch.equal(head, embedding.to(head.dtype))):
        # transformers 4 ties them (the embedding wins), transformers 5 unties them (the head
        # wins): a folder that two versions read as two models is refused, not guessed at
        problems.append("lm_head.weight differs from model.embed_tokens.weight though config.json "
                        "ties them (tie_word_embeddings): set tie_word_embeddings false to load "
                        "it untied, or drop lm_head.weight to tie")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


# ---------------------------------------------------------------------------------- config.json

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


def args_from_hf_config(config: dict, where: str = CONFIG) -> LlamaArgs:
    """LlamaArgs of a LlamaForCausalLM config.json (transformers 4's rope_theta / rope_scaling
    keys or 5's rope_parameters). Features this Llama lacks are refused by name."""
    def get(key, default=None):
        if key not in config and default is None:
            raise ValueError(f"{where}: no {key!r}")
        return config.get(key, default)

    def count(key, *value):  # value: given, else config.json's
        value = value[0] if value else get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}: {key} = {value!r}, expected a positive integer")
        return value

    def number(table, key, name, default=None):
        value = table.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: {name} = {value!r}, expected a number")
        return float(value)

    def table(key):
        value = config.get(key) or {}
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {key} = {value!r}, expected an object")
        return value

    if config.get("model_type", "llama") != "llama":
        raise ValueError(f"{where}: model_type {config['model_type']!r}, expected 'llama' "
                         "(a LlamaForCausalLM)")
    unsupported = [f"{key} = {config[key]!r}" for key, fine in
                   (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
                   if config.get(key, fine) != fine]
    dim, n_heads = count("hidden_size"), count("num_attention_heads")
    if config.get("head_dim") not in (None, dim // n_heads):
        unsupported.append(f"head_dim = {config['head_dim']} (not hidden_size / "
                           "num_attention_heads)")
    rope = table("rope_parameters")
    if "rope_theta" in rope and isinstance(rope.get("rope_theta"), (int, float)):
        theta = number(rope, "rope_theta", "rope_parameters.rope_theta")
    else:
        theta = number(config, "rope_theta", "rope_theta", 10000.0)
    scaling = table("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        unsupported.append(f"rope type {rope_type!r} (this Llama has the default and 'llama3')")
    if unsupported:
        raise ValueError(f"{where}: not supported by this Llama: {'; '.join(unsupported)}")
    llama3 = {}
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in scaling]
        if missing:
            raise ValueError(f"{where}: llama3 rope scaling without {', '.join(missing)}")
        name = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
        original = "original_max_position_embeddings"
        llama3 = dict(
            rope_scaling_factor=number(scaling, "factor", f"{name}.factor"),
            rope_low_freq_factor=number(scaling, "low_freq_factor", f"{name}.low_freq_factor"),
            rope_high_freq_factor=number(scaling, "high_freq_factor", f"{name}.high_freq_factor"),
            rope_original_max_pos=count(f"{name}.{original}", scaling[original]))
    values = dict(
        dim=dim, n_layers=count("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=count("num_key_value_heads", config.get("num_key_value_heads") or n_heads),
        vocab_size=count("vocab_size"), ffn_dim=count("intermediate_size"),
        max_seq_len=count("max_position_embeddings", config.get("max_position_embeddings", 2048)),
        norm_eps=number(config, "rms_norm_eps", "rms_norm_eps", 1e-6), rope_theta=theta,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), **llama3)
    try:
        return LlamaArgs(**values)
    except ValueError as e:  # values that do not go together (heads that do not divide, ...)
        raise ValueError(f"{where}: {e}") from None


def read_config(folder: str | os.PathLike) -> dict:
    path = Path(folder) / CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder}: no {CONFIG} (not a Hugging Face model "
                                "folder)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: holds a JSON {type(config).__name__}, expected an object of "
                         "settings")
    return config


# ---------------------------------------------------------------------------------- folders

def is_hf_folder(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / CONFIG).is_file() and ((path / SINGLE_FILE).is_file()
                                          or (path / INDEX).is_file())


def read_safetensors(folder: str | os.PathLike) -> dict[str, Tensor]:
    """Every tensor of a folder's model.safetensors, or of the shards its index names."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    # the single file first, as transformers looks (an index beside it is a stale leftover)
    if (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    elif (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text()).get("weight_map")
        except (ValueError, AttributeError) as e:  # cut short, not JSON, or not an object
            raise ValueError(f"{folder / INDEX}: damaged, not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{folder / INDEX}: no weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:  # file names in the folder: an index must not reach outside it
            if not isinstance(name, str) or name != Path(name).name or name in ("", ".", ".."):
                raise ValueError(f"{folder / INDEX}: names {name!r}, not a file name in the "
                                 "folder; not reading outside it")
    else:
        raise FileNotFoundError(f"{folder}: neither {SINGLE_FILE} nor {INDEX}")
    tensors = {}
    for name in files:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}: {INDEX} names {name}, which is missing")
        try:
            with safe_open(folder / name, framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except SafetensorError as e:  # "header too large", "incomplete metadata", ...
            raise ValueError(f"{folder / name}: damaged, not a readable safetensors file ({e}); "
                             "write the folder again (scripts/export_hf.py) or take another "
                             "copy") from None
    return tensors


def compare_args(model: LlamaArgs, hf: LlamaArgs) -> list[str]:
    """What would make a model of `model` compute something else than the folder's weights:
    the shapes, norm eps and RoPE. The vocabulary may grow (padding rows), the context length
    differ, and tied embeddings untie (the output starts as a copy of the embedding)."""
    differ = []
    fields = ["dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "norm_eps", "rope_theta",
              "rope_scaling_factor"]
    if model.rope_scaling_factor is not None:
        fields += ["rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_pos"]
    for name in fields:
        ours, theirs = getattr(model, name), getattr(hf, name)
        if ours != theirs and not (isinstance(ours, float) and isinstance(theirs, float)
                                   and math.isclose(ours, theirs, rel_tol=1e-9)):
            fix = (f" (set [model] rope_scaling_factor = {theirs})"
                   if name == "rope_scaling_factor" and theirs is not None else "")
            differ.append(f"{name} {ours} vs {theirs}{fix}")
    if hf.vocab_size > model.vocab_size:
        differ.append(f"vocab_size {model.vocab_size} vs {hf.vocab_size} (set [model] "
                      f"vocab_size = {hf.vocab_size})")
    if model.tie_embeddings and not hf.tie_embeddings:
        differ.append("tie_embeddings true vs false (the folder's lm_head would be lost)")
    return differ


def load_hf_weights(folder: str | os.PathLike, args: LlamaArgs) -> dict[str, Tensor]:
    """A LlamaForCausalLM folder's weights as a state dict of Llama(args), in the files' dtype.

    The folder's config.json must describe the same model as `args` (compare_args), except that
    args may have a larger vocabulary: the extra rows of the embedding and the output are the
    mean of the folder's rows (as transformers' resize_token_embeddings starts new tokens), so
    ids the tokenizer never produces get an unremarkable logit."""
    folder = Path(folder)
    hf_args = args_from_hf_config(read_config(folder), str(folder / CONFIG))
    differ = compare_args(args, hf_args)
    if differ:
        raise ValueError(f"{folder} holds another model than [model] configures (this run vs "
                         f"the folder's config.json): {'; '.join(differ)}")
    hf_state = read_safetensors(folder)
    check_hf_state(hf_state, hf_args, str(folder))
    state = from_hf(hf_state, hf_args)
    extra = args.vocab_size - hf_args.vocab_size
    for key in ("tok_embeddings.weight", "output.weight"):
        if extra:
            rows = state[key]
            mean = rows.float().mean(dim=0, keepdim=True).to(rows.dtype)
            state[key] = torch.cat([rows, mean.expand(extra, -1)])
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


def save_hf_folder(tensors: dict[str, Tensor], config: dict, folder: str | os.PathLike,
                   max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write tensors (transformers' names) and config.json into an existing folder: one
    model.safetensors, or model-0000i-of-0000n.safetensors shards of at most max_shard_bytes
    each (a larger tensor gets a shard of its own) with model.safetensors.index.json, as
    save_pretrained does. Returns the names of the files written."""
    from safetensors.torch import save_file

    folder = Path(folder)
    shards, size = [[]], 0
    for key, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, keys in zip(names, shards):
        # contiguous: safetensors writes a tensor's storage as it is laid out
        save_file({k: tensors[k].contiguous() for k in keys}, str(folder / name),
                  metadata={"format": "pt"})
    written = list(names)
    if len(shards) > 1:
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        written.append(INDEX)
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return written + [CONFIG]
