#!/usr/bin/env python3
"""Tokenize a corpus once into token shards that the trainer memory-maps (`[data] source = OUT`).

    python3 -m scripts.prepare_data --source data/raw/ "more/*.jsonl" --tokenizer tokenizer.json \\
        --out shards/web [--workers 16] [--val-every 100] [--text-field text]
    python3 -m scripts.prepare_data --hf-dataset HuggingFaceFW/fineweb-edu --hf-subset sample-10BT \\
        --hf-streaming --tokenizer tokenizer.json --out shards/fineweb-edu

--source takes .jsonl/.json/.parquet/.txt files (a .txt file: one document per paragraph; the
text ones also compressed: .gz, .bz2, .xz), folders of them and globs (other files there are
named and left out); --hf-dataset a Hugging Face dataset (a hub name, a local folder of
data files, or one saved with save_to_disk), read whole (--hf-streaming: file by file, without
a local copy). Documents are framed [bos] + tokens + [eos] and tokenized by --workers processes.
Every --val-every-th document (by a hash of its text) goes to the validation split; 0: none.
A source folder laid out in splits (train/, validation/, test/, or train.jsonl, ...) keeps its
own: its validation files are the validation split, its test split is left out; so does a
--hf-dataset with a validation split (its --hf-split whole is then the train split).

The same command again resumes a killed run (finished units are kept) and does nothing on a
finished folder; a folder begun with another tokenizer or other settings is refused. The format
is documented in components/data/shards.py; the trainer refuses shards of another tokenizer.
"""

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root (components) is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.prepare_data ...")

from components.data.checks import ON_BAD_DOCUMENT, MissingTextField  # noqa: E402
from components.data.document_reader import KINDS, some_files  # noqa: E402
from components.data.shards import ShardFormatError  # noqa: E402
from components.tokenizer import build_tokenizer  # noqa: E402
from scripts.lib.prepare_shards import (Plan, PrepareError, file_units,  # noqa: E402
                                        hf_rows_or_files, hf_units, layout_splits, listing,
                                        load_hf, local_files, prepare, settings_for,
                                        tokenizer_record, usable_cpus)


# What the tokenizer's errors call its settings here (the trainer's are its config keys).
OPTIONS = {"name": "--tokenizer", "path": "--tokenizer", "bos_token": "--bos-token",
           "eos_token": "--eos-token"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m scripts.prepare_data", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--source", nargs="+", metavar="PATH", help="files, folders or globs")
    where.add_argument("--hf-dataset", metavar="NAME", help="a Hugging Face dataset")
    parser.add_argument("--hf-subset", default=None, help="the dataset's configuration (subset)")
    parser.add_argument("--hf-split", default="train", help="its split (default: train)")
    parser.add_argument("--hf-streaming", action="store_true",
                        help="read the dataset file by file, without a local copy (one unit per file)")
    parser.add_argument("--tokenizer", required=True, metavar="PATH|byte",
                        help='a tokenizer.json (or a folder holding one), or "byte" for the built-in '
                             'byte tokenizer')
    parser.add_argument("--bos-token", default="", help="the tokenizer's bos token (default: found)")
    parser.add_argument("--eos-token", default="", help="the tokenizer's eos token (default: found)")
    # "~/shards" quoted (or after "--out=") reaches us unexpanded, and was a folder named "~"
    parser.add_argument("--out", required=True, type=lambda text: Path(text).expanduser(),
                        help="the shard folder")
    parser.add_argument("--text-field", default="text", help="the documents' text field (default: text)")
    parser.add_argument("--val-every", type=int, default=100,
                        help="hold out 1 in this many documents for validation; 0: none (default: 100)")
    parser.add_argument("--on-bad-document", choices=ON_BAD_DOCUMENT, default="error",
                        help="a document that is not UTF-8, not JSON or has no text (none, or an empty "
                             "or whitespace-only one, as the trainer's [data] on_bad_document): stop, "
                             "naming it, or skip it, counting it (default: error)")
    parser.add_argument("--workers", type=int, default=usable_cpus(),
                        help="tokenizer processes (default: this machine's CPUs)")
    parser.add_argument("--unit-mb", type=float, default=256,
                        help="input per unit of work, in MiB: a unit is one shard per split, and what a "
                             "killed run redoes (default: 256)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.val_every < 0 or args.workers < 1 or args.unit_mb <= 0:
        parser.error("--val-every must be >= 0, --workers >= 1 and --unit-mb > 0")
    if args.val_every == 1:  # the trainer refuses it too ([data] val_every)
        parser.error("--val-every 1 would hold out every document, leaving none to train on: "
                     "0 (none) or 2 and more")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    try:
        name = "byte" if args.tokenizer == "byte" else "hf"
        tokenizer = build_tokenizer(name, None if name == "byte" else args.tokenizer, args.bos_token,
                                    args.eos_token, options=OPTIONS)
        record = tokenizer_record(tokenizer, name, None if name == "byte" else args.tokenizer)
        unit_bytes = int(args.unit_mb * 2**20)
        dataset, files = None, None
        if args.source:
            others = []
            paths = local_files(args.source, out=args.out, left_out=others)
            if others:
                print(f"prepare_data: leaving out {len(others)} file(s) of other kinds than "
                      f"{KINDS}: {some_files(others)}", file=sys.stderr)
            fixed, left_out = layout_splits(args.source, paths)
            if left_out:
                print(f"prepare_data: leaving out {len(left_out)} file(s) of a split other than train "
                      f"and validation (e.g. {left_out[0]})", file=sys.stderr)
                dropped = set(left_out)
                paths = [p for p in paths if p not in dropped]
            files = listing(paths)
            units = [u for number, path in enumerate(paths)
                     for u in file_units(number, path, unit_bytes, fixed.get(path, ""))]
            source = {"files": files}
        else:
            dataset = load_hf(args.hf_dataset, args.hf_subset, args.hf_split, args.hf_streaming)
            units = hf_units(dataset, unit_bytes)
            source = {"hf_dataset": args.hf_dataset, "subset": args.hf_subset, "split": args.hf_split,
                      "streaming": args.hf_streaming,
                      "rows_or_files": hf_rows_or_files(dataset.get("train", dataset.get("")))}
            if "validation" in dataset:
                source["validation_rows_or_files"] = hf_rows_or_files(dataset["validation"])
                print(f"prepare_data: the validation shards are {args.hf_dataset}'s own validation "
                      f"split, the train shards its {args.hf_split} split whole", file=sys.stderr)
            elif args.val_every:
                print(f"prepare_data: the validation shards are 1 in {args.val_every} documents of "
                      f"{args.hf_dataset}'s {args.hf_split} split, by a hash of their text (no "
                      "validation split of its own is used)", file=sys.stderr)
        settings = settings_for(record, args.text_field, args.val_every, args.on_bad_document, unit_bytes,
                                source)
        index = prepare(args.out, Plan(units, settings, files, dataset), tokenizer, args.workers,
                        progress_bar=not args.no_progress)
    except (PrepareError, ShardFormatError, ValueError, FileNotFoundError, MissingTextField) as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nprepare_data.py: interrupted; the same command resumes ({args.out} keeps the finished "
              f"units)", file=sys.stderr)
        return 130
    train, validation = index["splits"]["train"], index["splits"]["validation"]
    print(f"{args.out}: train {train['tokens']:,} tokens in {train['documents']:,} documents, validation "
          f"{validation['tokens']:,} tokens in {validation['documents']:,}; {index['dtype']}, "
          f"{time.time() - started:.1f} s")
    if index["skipped_documents"]:
        print(f"skipped {index['skipped_documents']} bad document(s), the first: "
              + "; ".join(index["skipped_named"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
