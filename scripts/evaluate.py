"""Evaluate a checkpoint on a data source: loss per token and bits per byte.

    python3 -m scripts.evaluate --checkpoint outputs/debug/checkpoint \\
        [--source stdlib|PATH] [--text-field text] [--split validation] [--val-every N] \\
        [--steps N] [--batch-size N] [--seq-len N] [--device auto|cpu|cuda] \\
        [--dtype auto|float32|bfloat16] [--json FILE]

--checkpoint: a DCP step folder, the folder of a run's step-<N> folders (the latest), or a
Hugging Face folder. The data comes through the trainer's own pipeline (components/data/build.py
build_data): by default the run's [data] source (or [[data.mixture]]) and its held-out
validation split, cut into
windows of the run's seq_len, as many batches as its validation scored on each of its
data-parallel ranks' shares: at a step where the run validated, the numbers are its val_loss and
val_bpb (for a run with float8 GEMMs, [model] converters or [loss] float8, they differ slightly:
evaluate scores the weights without float8, and says so). --source takes any source the trainer
takes, its documents' text in --text-field. Loss and bits per byte are the trainer's
validation numbers (components/validation.py evaluate()): the plain cross-entropy, and bpb =
summed losses (nats) / (ln 2 x the UTF-8 bytes of the target tokens).
A split shorter than the batches asked is read again from its start; a note names it, and the
--json record says read_more_than_once.
"""

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root (models) is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.evaluate ...")

import torch  # noqa: E402

from scripts.lib import checkpoints  # noqa: E402
from scripts.lib.checkpoints import pick_device, pick_dtype  # noqa: E402
from components.config.schema import JobConfig, Training  # noqa: E402
from components.data.build import build_data  # noqa: E402
from components.data.checks import MissingTextField  # noqa: E402
from components.float8_linear import CONVERTER as FLOAT8_CONVERTER  # noqa: E402
from components.loss import ModelWithLoss, TrainingLoss  # noqa: E402
from components.validation import evaluate  # noqa: E402
from parallelisms.context_parallel import NoSharding  # noqa: E402


def data_parallel_ranks(folder: Path, cfg: JobConfig) -> int:
    """The run's data-parallel degree: its ranks (a rank-<r>.pt each in the checkpoint) over
    its tensor- and context-parallel degrees (those ranks read the same batches)."""
    world = len(list(folder.glob("rank-*.pt"))) or 1
    same_batch = (cfg.parallelism.tensor_parallel_degree
                  * cfg.parallelism.context_parallel_degree)
    return max(world // same_batch, 1)


RECORD_KEYS = {"tokens", "source", "split", "seq_len", "checkpoint"}


def check_json_target(path: Path) -> None:
    """--json replaces only an earlier record of this script, or an empty file: a run's
    metrics.jsonl or a checkpoint's train_state.json given by mistake was overwritten (the
    checkpoint then read as damaged and a resume fell back a step). What is not a regular file
    (/dev/stdout, a pipe) is written to as it is, not read."""
    if path.is_dir() or not path.parent.is_dir():
        raise ValueError(f"--json {path}: not a file in an existing folder")
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:  # a record is a few hundred bytes: a large file is not one, and is not read whole
        earlier = json.loads(path.read_text()) if path.stat().st_size < 1 << 16 else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        earlier = None
    except OSError as e:
        raise ValueError(f"--json {path}: cannot read it ({e.strerror})") from None
    if not (isinstance(earlier, dict) and RECORD_KEYS <= earlier.keys()):
        raise ValueError(f"--json {path}: exists and is not an earlier evaluate record; "
                         "pick another file")


def write_record(path: Path, record: dict) -> None:
    """A regular file whole or not at all (a temporary file renamed over it); anything else
    (/dev/stdout) written to directly."""
    text = json.dumps(record, indent=2) + "\n"
    if path.exists() and not path.is_file():
        path.write_text(text)
        return
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


def given(value: int | None, default: int) -> int:
    """An option's value, or the run's when it was not given (0 stood for that once, so that
    --steps 0 evaluated the run's 20 batches without a word)."""
    return default if value is None else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m scripts.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a DCP step folder, a run's checkpoint folder (latest) or a Hugging "
                             "Face folder")
    parser.add_argument("--source", default=None,
                        help="data source as [data] source (default: the run's)")
    parser.add_argument("--text-field", default=None,
                        help="the documents' text field (default: the run's [data] text_field, "
                             "text for a Hugging Face folder)")
    parser.add_argument("--split", default="validation",
                        help="validation (the run's held-out documents) or train, or a split "
                             "the source has")
    parser.add_argument("--val-every", type=int, default=None,
                        help="every n-th document is held out (default: the run's [data] "
                             "val_every)")
    parser.add_argument("--cache-dir", default=None, help="default: the run's [data] cache_dir")
    parser.add_argument("--steps", type=int, default=None,
                        help="batches to evaluate (default: the run's [validation] steps, 20 for "
                             "a Hugging Face folder)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="windows per batch, one share of the data (default: the run's "
                             "[training] local_batch_size on each of its data-parallel ranks' "
                             "shares, 8 for a Hugging Face folder)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per window (default: the run's [training] seq_len, 2048 "
                             "for a Hugging Face folder)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--loss-impl", default="auto", choices=["auto", "flce", "unfused"],
                        help="auto: the fused loss (on the CPU its chunked PyTorch form: "
                             "unfused logits of a long sequence would not fit)")
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json instead of the run's / the folder's")
    parser.add_argument("--json", default=None,
                        help="also write the results to this file (a new one, or an earlier "
                        "record of this script)")
    opts = parser.parse_args(argv)

    try:
        for name, least in (("steps", 1), ("batch_size", 1), ("seq_len", 1), ("val_every", 2)):
            value = getattr(opts, name)
            if value is not None and value < least:
                raise ValueError(f"--{name.replace('_', '-')} {value}: expected >= {least}")
        if opts.json:  # checked before the evaluation, which may take long
            check_json_target(Path(opts.json))
        device = pick_device(opts.device)
        loaded = checkpoints.load_model(opts.checkpoint, device, pick_dtype(opts.dtype, device),
                                        tokenizer_path=opts.tokenizer)
        cfg = loaded.config or JobConfig()  # a Hugging Face folder: the trainer's defaults
        if loaded.config is None and opts.source is None:
            raise ValueError(f"{loaded.folder} is a Hugging Face folder: pass --source")
        run = loaded.config is not None
        seq_len = given(opts.seq_len, cfg.training.seq_len if run
                        else min(2048, loaded.args.max_seq_len))
        steps = given(opts.steps, cfg.validation.steps if run else 20)
        batch_size = given(opts.batch_size, cfg.training.local_batch_size if run else 8)
        if seq_len > loaded.model.rope_cache.shape[0]:
            raise ValueError(f"--seq-len {seq_len} exceeds the model's {loaded.args.max_seq_len}")
        source = opts.source or cfg.data.source
        mixture = [] if opts.source else cfg.data.mixture  # --source alone replaces a mixture
        # what was scored, as --data.mixture spells a mixture
        scored = ",".join(f"{m.source}:{m.weight:g}" for m in mixture) or source
        data = dataclasses.replace(
            cfg.data, source=source, mixture=mixture,
            synthetic=False, val_every=given(opts.val_every, cfg.data.val_every),
            cache_dir=opts.cache_dir or cfg.data.cache_dir,
            text_field=opts.text_field or cfg.data.text_field)
        # a run on several data-parallel ranks validated each rank's share of the documents
        # (components/data/): score every share, as many batches each, as the run did
        dp = 1 if opts.batch_size is not None or not run else data_parallel_ranks(loaded.folder, cfg)
        windows = Training(seq_len=seq_len, local_batch_size=batch_size)  # validation ignores seed
        shares = [build_data(data, windows, split=opts.split, tokenizer=loaded.tokenizer,
                             dp_rank=r, dp_world=dp, max_token_id=loaded.args.vocab_size)
                  for r in range(dp)]
        batches = itertools.chain.from_iterable(itertools.islice(b, steps) for b in shares)
        # never the unfused loss by default: it holds [batch x seq_len, vocab] logits (64 GiB
        # for one sequence of 131072 tokens and a 128256-token vocabulary)
        impl = opts.loss_impl if opts.loss_impl != "auto" else "flce"
        float8 = [f"[model] converters = {cfg.model.converters}"] if (
            FLOAT8_CONVERTER in cfg.model.converters) else []
        if cfg.loss.float8 != "none":
            float8.append(f"[loss] float8 = {cfg.loss.float8!r}")
        if float8:
            print(f"evaluate: note: the run trained with {' and '.join(float8)}: this scores the "
                  "weights without float8 GEMMs, so the numbers differ slightly from the run's "
                  "val_loss and val_bpb", file=sys.stderr)
        loss = TrainingLoss(dataclasses.replace(cfg.loss, impl=impl, float8="none"))
        model = ModelWithLoss(loaded.model, loss)
        lengths = loaded.tokenizer.byte_lengths()
        token_bytes = torch.tensor(lengths + [0] * (loaded.args.vocab_size - len(lengths)))
        start = time.perf_counter()
        metrics = evaluate(model, batches, steps * dp, device, token_bytes, shard=NoSharding())
        seconds = time.perf_counter() - start
    except MissingTextField as e:  # the field is --text-field's here, not [data] text_field
        e.fix = "pass --text-field"
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 1
    tokens = steps * dp * batch_size * seq_len
    repeated = sorted({name for b in shares for name in b.read_more_than_once()})
    for b in shares:
        b.close()
    ranks = f" on each of the run's {dp} data-parallel ranks" if dp > 1 else ""
    print(" | ".join(f"{k} {v:.4f}" for k, v in metrics.items())
          + f" | {steps} batches x {batch_size} x {seq_len} tokens{ranks} of "
            f"{'mixture ' if mixture else ''}{scored} ({opts.split}) | {loaded.folder} | "
            f"{seconds:.1f} s")
    if repeated:
        print(f"evaluate: note: {', '.join(repeated)}: fewer tokens than the {tokens:,} scored, "
              "so windows were read more than once (fewer --steps would not repeat)",
              file=sys.stderr)
    if opts.json:
        record = {**metrics, "tokens": tokens, "source": scored, "split": opts.split,
                  "seq_len": seq_len, "checkpoint": str(loaded.folder),
                  "read_more_than_once": bool(repeated)}
        if mixture:
            record["mixture"] = [dataclasses.asdict(m) for m in mixture]
        write_record(Path(opts.json), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
