"""Export a trained Llama as a Hugging Face `LlamaForCausalLM` folder, ready for transformers.

    python3 -m scripts.export_hf --checkpoint outputs/debug/checkpoint --out outputs/debug/hf \\
        [--dtype bfloat16|float32|float16] [--max-shard-size 5GB] [--overwrite]

--checkpoint is a DCP checkpoint folder (`<dump>/checkpoint/step-<N>/`; the folder holding the
step-<N> folders picks the latest). The run's config.toml in it says the flavor, the vocab size
and the tokenizer, so nothing else is needed; for a checkpoint without one (a `torch.save` file
of a state dict, torchtitan's) pass --flavor and --vocab-size.

The folder gets the weights in --dtype, bfloat16 by default (float32 keeps them exactly as
trained; safetensors, shards with an index above --max-shard-size), config.json and
generation_config.json with the tokenizer's bos/eos ids, and the tokenizer: the run's
tokenizer.json (with its tokenizer_config.json and special_tokens_map.json when they sit beside
it), or for the built-in byte tokenizer an equivalent tokenizer.json, framing text as training
did (bos first, in transformers too), its truncation and padding off as in training. The q/k rows
are permuted for transformers' RoPE layout (models/hf.py); the exported model gives the same
logits (tests/test_export_hf.py). A run with [loss] logit_scale or softcap is refused:
LlamaForCausalLM has neither. export_hf.json marks the folder as this tool's (the checkpoint it
came from, when): --overwrite replaces only such a folder, or an empty one.

Python: `export(state_dict, args, out_dir, dtype, ...)`; scripts/lib/checkpoints.py reads the
checkpoints.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root (models) is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.export_hf ...")

import tokenizers  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from components.tokenizer import (ByteTokenizer, HFTokenizer, byte_tokenizer_json,  # noqa: E402
                                  encode_whole, with_training_framing)
from models import FLAVORS, Llama, LlamaArgs  # noqa: E402
from models import hf  # noqa: E402
from parallelisms.build import model_args  # noqa: E402
from scripts.lib import checkpoints  # noqa: E402

DTYPES = hf.DTYPES
# Written into every exported folder: --overwrite replaces only folders holding it.
MARKER = "export_hf.json"
_TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# Every name an export writes (weights as models/hf.py names them, the tokenizer's files, the
# marker): --overwrite replaces a folder holding nothing else.
_EXPORTED = re.compile(r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map"
                       r"|export_hf)\.json|model(-\d{5,}-of-\d{5,})?\.safetensors"
                       r"|model\.safetensors\.index\.json")


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
    if bad := checkpoints.non_finite(state.items()):
        raise ValueError(f"{bad[0]}: holds non-finite values (NaN or inf)")
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

def tokenizer_files(tokenizer, max_len: int) -> dict[str, bytes]:
    """The files that make a folder's tokenizer, framing text as training did (bos first;
    components/tokenizer.py with_training_framing): the byte tokenizer as a tokenizer.json that
    encodes to the same ids, or an HF tokenizer's tokenizer.json with that post-processor, and
    its tokenizer_config.json / special_tokens_map.json when they sit beside it, naming the bos
    and eos that training used."""
    files = {}
    if isinstance(tokenizer, ByteTokenizer):
        files["tokenizer.json"] = byte_tokenizer_json().encode()
        names = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                 "pad_token": "<|pad|>"}
    else:
        names = {"bos_token": tokenizer.id_to_token(tokenizer.bos_id),
                 "eos_token": tokenizer.id_to_token(tokenizer.eos_id)}
        # with the truncation and padding training had off (a file saved with them on would
        # make transformers cut and pad every text), said in one line where they were on
        source = tokenizers.Tokenizer.from_file(str(tokenizer.path))
        turned_off = encode_whole(source)
        if turned_off:
            print(f"export_hf: {tokenizer.path} sets {' and '.join(turned_off)}: off in the "
                  "exported tokenizer.json, as in training", file=sys.stderr)
        files["tokenizer.json"] = with_training_framing(
            source.to_str(), names["bos_token"], names["eos_token"]).encode()
        for name in _TOKENIZER_SIDE_FILES:
            if (tokenizer.path.parent / name).is_file():
                files[name] = _with_specials((tokenizer.path.parent / name).read_bytes(), names,
                                             tokenizer_config=name == "tokenizer_config.json")
    if "tokenizer_config.json" not in files:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **names,
                  "model_max_length": max_len, "clean_up_tokenization_spaces": False,
                  "split_special_tokens": True}
        files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    return files


def _with_specials(content: bytes, names: dict[str, str], tokenizer_config: bool = False) -> bytes:
    """A tokenizer_config.json / special_tokens_map.json naming training's bos and eos, and
    without add_bos_token / add_eos_token: with either set, transformers 5 rebuilds the
    post-processor from them (no separator between a pair's texts, and no bos unless
    add_bos_token is true) instead of using tokenizer.json's. A tokenizer_config.json gets
    split_special_tokens: special tokens' names in a text are text, as in training (HFTokenizer).
    Unparsable files are copied."""
    try:
        values = json.loads(content)
    except ValueError:
        return content
    if not isinstance(values, dict):
        return content
    for key, token in names.items():
        if key in values:
            value = values[key]
            values[key] = {**value, "content": token} if isinstance(value, dict) else token
    for key in ("add_bos_token", "add_eos_token"):
        values.pop(key, None)
    if tokenizer_config:
        values["split_special_tokens"] = True
    return (json.dumps(values, indent=2, ensure_ascii=False) + "\n").encode()


def export(state_dict: dict[str, Tensor], args: LlamaArgs, out_dir: str | os.PathLike,
           dtype: torch.dtype | str = torch.bfloat16, *, bos_token_id: int | None = None,
           eos_token_id: int | None = None, overwrite: bool = False,
           extra_files: dict[str, bytes] | None = None,
           max_shard_bytes: int = 5 * 2**30, source: str | None = None) -> Path:
    """Write `state_dict` (Llama names; a `model.` prefix is dropped) as a Hugging Face folder,
    with extra_files (name -> content, e.g. tokenizer_files()) beside the weights.

    The folder is written next to out_dir under a temporary name and renamed into place, so
    out_dir is either complete or absent (or, with overwrite, the old one). It gets MARKER
    (naming `source`, the checkpoint): overwrite replaces only an empty folder or one holding
    it, an earlier export, and raises FileExistsError for anything else. Raises ValueError
    when the state dict does not fit `args` (missing, unexpected or misshapen keys).
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {list(DTYPES)}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype {dtype}: expected one of {list(DTYPES)}")
    state = checkpoints.normalize_keys({k: v for k, v in state_dict.items()
                                        if isinstance(v, Tensor)})
    _check(state, args)

    out_dir = Path(out_dir)
    _check_replaceable(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tensors = hf.to_hf({k: _full_cpu(v, dtype) for k, v in state.items()}, args)
        written = hf.save_hf_folder(tensors, hf.hf_config(args, dtype, bos_token_id, eos_token_id),
                                    tmp, max_shard_bytes)
        del tensors
        generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
        marker = {"written_by": "scripts/export_hf.py", "source": source,
                  "created": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        files = {"generation_config.json": (json.dumps(generation, indent=2) + "\n").encode(),
                 **(extra_files or {}), MARKER: (json.dumps(marker, indent=2) + "\n").encode()}
        for name, content in files.items():
            (tmp / name).write_bytes(content)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700, and safetensors its files 0600
        for name in [*written, *files]:
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


def _check_replaceable(out_dir: Path, overwrite: bool) -> None:
    """out_dir may be written when it is absent or empty, and replaced (overwrite) only when it
    is an earlier export: --out naming a run's dump folder or another checkpoint by mistake must
    not delete it."""
    if not out_dir.exists() and not out_dir.is_symlink():
        above = next((d for d in out_dir.parents if d.exists()), None)
        if above is not None and not above.is_dir():
            raise FileExistsError(f"output {str(out_dir)!r}: {str(above)!r} is a file, not a "
                                  "folder; pick another --out")
        return
    if not out_dir.is_dir() or out_dir.is_symlink():
        raise FileExistsError(f"output {str(out_dir)!r} exists and is not a folder: not replacing "
                              "it; pick another --out")
    held = sorted(p.name for p in out_dir.iterdir())
    if not held:
        return
    if not overwrite:
        raise FileExistsError(f"output {str(out_dir)!r} already exists (pass overwrite=True / "
                              "--overwrite to replace it)")
    foreign = [name for name in held if not _EXPORTED.fullmatch(name)]
    if MARKER not in held or foreign:
        # a run's dump folder may be an earlier export that a run trained on (initial_load_path)
        # and wrote its checkpoints, metrics and lock into: replacing it would delete them
        listed = foreign if MARKER in held else held
        shown = ", ".join(listed[:8]) + (f", ... ({len(listed)} in all)" if len(listed) > 8 else "")
        why = f"besides an export ({MARKER})" if MARKER in held else f"and no {MARKER}"
        raise FileExistsError(f"output {str(out_dir)!r} holds {shown}, {why}: not written by this "
                              "tool alone, so --overwrite does not replace it; remove it yourself or "
                              "pick another --out")


def _full_cpu(value: Tensor, dtype: torch.dtype) -> Tensor:
    if hasattr(value, "full_tensor"):  # a DTensor, e.g. from an FSDP model's state_dict()
        value = value.full_tensor()
    return value.detach().to(device="cpu", dtype=dtype)


def parse_size(text: str) -> int:
    """"5GB", "500MB", "2GiB", "1000" (bytes) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"size {text!r}: expected e.g. 5GB, 500MB or 2GiB")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    size = int(float(number) * base ** " KMGT".index(unit.upper() or " "))
    if size < 1:
        raise ValueError(f"size {text!r}: expected at least one byte")
    return size


# ----------------------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m scripts.export_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a DCP checkpoint folder (<dump>/checkpoint/step-<N>), the folder of "
                             "step-<N> folders (latest), or a torch.save state dict file")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                        help="the weights' dtype in the folder (default: bfloat16; float32 keeps "
                             "them as trained)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors file; more weights go into shards + an index")
    parser.add_argument("--flavor", choices=sorted(FLAVORS),
                        help="the model, for a checkpoint without the run's config.toml (else "
                             "read from it, with the run's [model] settings; another flavor than "
                             "the run's is refused)")
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="with --flavor: the trained vocab size when it differs from the "
                             "flavor's ([model] vocab_size of the run)")
    parser.add_argument("--tokenizer", default=None,
                        help="the tokenizer.json to ship (default: the run's [tokenizer])")
    parser.add_argument("--bos-id", type=int, default=None,
                        help="bos_token_id for config.json (default: the tokenizer's)")
    parser.add_argument("--eos-id", type=int, default=None,
                        help="eos_token_id for config.json (default: the tokenizer's)")
    parser.add_argument("--overwrite", action="store_true",
                        help=f"replace an existing --out: an earlier export (it holds {MARKER}) "
                             "or an empty folder, nothing else")
    opts = parser.parse_args(argv)

    try:
        folder = checkpoints.resolve(opts.checkpoint)
        if hf.is_hf_folder(folder):
            raise ValueError(f"{folder} is a Hugging Face folder already: export_hf converts a "
                             "DCP checkpoint or a torch.save file")
        out = Path(opts.out).resolve()
        if out == folder.resolve() or out in folder.resolve().parents:
            # --overwrite would replace it: the run's checkpoints (or whole dump folder) gone
            raise ValueError(f"--out {opts.out} holds the checkpoint being exported "
                             f"({folder}): write the folder elsewhere")
        _check_replaceable(out, opts.overwrite)  # before reading the checkpoint, maybe for long
        cfg = checkpoints.run_config(folder) if folder.is_dir() else None
        if cfg is not None:
            # the run's model, with its [model] max_seq_len and rope_scaling_factor, which the
            # bare flavor lacks: another flavor is refused, not exported as the run's weights
            if opts.flavor and opts.flavor != cfg.model.flavor:
                raise ValueError(f"--flavor {opts.flavor}: {folder / 'config.toml'} says [model] "
                                 f"flavor = {cfg.model.flavor!r}; leave --flavor out to export "
                                 "the run's model")
            args = model_args(cfg)
            if opts.vocab_size:
                args = dataclasses.replace(args, vocab_size=opts.vocab_size)
        elif opts.flavor:
            args = FLAVORS[opts.flavor]
            args = dataclasses.replace(args, vocab_size=opts.vocab_size or args.vocab_size)
        else:
            raise ValueError(f"{folder} has no config.toml (the trainer writes one into every "
                             "checkpoint): pass --flavor (and --vocab-size)")
        if cfg is not None and (cfg.loss.logit_scale != 1.0 or cfg.loss.softcap):
            raise ValueError(f"the run trained with [loss] logit_scale = {cfg.loss.logit_scale}, "
                             f"softcap = {cfg.loss.softcap}: LlamaForCausalLM has neither, so the "
                             "exported model would give other logits")
        tokenizer = None
        if cfg is not None:
            tokenizer = checkpoints.checked_run_tokenizer(folder, cfg, opts.tokenizer)
        elif opts.tokenizer:
            tokenizer = HFTokenizer(opts.tokenizer)
        else:
            print("export_hf: warning: no tokenizer (no config.toml, no --tokenizer): the folder "
                  "gets none", file=sys.stderr)
        bos = opts.bos_id if opts.bos_id is not None else getattr(tokenizer, "bos_id", None)
        eos = opts.eos_id if opts.eos_id is not None else getattr(tokenizer, "eos_id", None)
        for role, given in (("bos", opts.bos_id), ("eos", opts.eos_id)):
            if given is not None and not 0 <= given < args.vocab_size:
                raise ValueError(f"--{role}-id {given}: not a token id of the model (0 to "
                                 f"{args.vocab_size - 1})")
        max_shard_bytes = parse_size(opts.max_shard_size)
        extra = tokenizer_files(tokenizer, args.max_seq_len) if tokenizer is not None else {}
        state = checkpoints.load_model_state(folder)
        out = export(state, args, opts.out, opts.dtype, bos_token_id=bos, eos_token_id=eos,
                     overwrite=opts.overwrite, extra_files=extra,
                     max_shard_bytes=max_shard_bytes, source=str(folder))
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"export_hf: error: {e}", file=sys.stderr)
        return 1
    n = sum(v.numel() for k, v in state.items()
            if not (args.tie_embeddings and k == "output.weight"))
    flavor = opts.flavor or (cfg.model.flavor if cfg else "?")
    print(f"wrote {out} ({flavor}, {n:,} parameters, {opts.dtype}, bos {bos}, eos {eos})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
