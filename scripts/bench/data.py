#!/usr/bin/env python3
"""The data loaders alone, without a model: tokens/s per rank from token shards and from text (a
32k BPE tokenizer, 0..N tokenizer worker processes), against what one H200 consumes training the
llama_150m flavor, and the time a loop consuming at that rate waits for data.

    python3 -m scripts.bench.data --out benchmarks/data_loader_cpu [--workers 0,1,2] \\
        [--corpus FILE_OR_FOLDER] [--tokenizer tokenizer.json] [--seq-len 2048 --batch 8] \\
        [--compare-libraries]

Without --corpus the embedded corpus (this Python's standard library sources) is copied --copies
times; without --tokenizer a 32,768-token byte-level BPE is trained on it. The H200's rate is
estimated from llama_150m's training FLOPs per token (the trainer's MFU formula, the tokenizer's
vocabulary) at 50% MFU of 989 TFLOP/s. --compare-libraries also times litdata's optimize +
StreamingDataset and datatrove's tokenizer + DatatroveFolderDataset on the same corpus (each when
installed) and checks whether their windows depend on the data-parallel layout. Writes OUT.json
and OUT.md (machine, versions, date, command, commit).
"""

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root (components) is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.data ...")

import numpy as np  # noqa: E402

from components.config.schema import Data, MixtureSource, Training  # noqa: E402
from components.data.build import build_data  # noqa: E402
from components.data.sources import embedded_corpus  # noqa: E402
from components.data.shard_batches import ShardBatches  # noqa: E402  (the libraries' comparison)
from components.data.shards import TokenShards  # noqa: E402
from components.tokenizer import build_tokenizer  # noqa: E402
from models import FLAVORS, flops_per_token  # noqa: E402
from scripts.lib.prepare_shards import (Plan, file_units, listing, local_files, prepare,  # noqa: E402
                                        settings_for, tokenizer_record, usable_cpus)
from scripts.lib.report import provenance, warning_lines, write_report  # noqa: E402
from scripts.lib.run_folders import claim_folder  # noqa: E402

H200_BF16_PEAK = 989e12
MFU = 0.5
SHARD_TARGET = 20  # shards must deliver this many times what one GPU consumes


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m scripts.bench.data", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--out", required=True, help="OUT.json and OUT.md are written")
    parser.add_argument("--corpus", nargs="+", help="files/folders (default: the embedded corpus)")
    parser.add_argument("--copies", type=int, default=4, help="copies of the embedded corpus (default 4)")
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: a 32k BPE trained here)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="local batch size (default 8)")
    parser.add_argument("--workers", default="0,1,2", help="text loader num_workers to try (default 0,1,2)")
    parser.add_argument("--prepare-workers", type=int, default=usable_cpus())
    parser.add_argument("--seconds", type=float, default=8.0, help="per measurement (default 8)")
    parser.add_argument("--compare-libraries", action="store_true")
    parser.add_argument("--work-dir", help="keep the corpus and shards here (default: a temporary "
                        "folder); a folder this script did not make is refused, since a rerun "
                        "clears the shards and caches inside it")
    return parser.parse_args(argv)


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for name in ("torch", "numpy", "tokenizers", "datasets", "pyarrow", "litdata", "datatrove"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu, "cpus_usable": usable_cpus(), "load_average": os.getloadavg(),
            **versions, **provenance()}


def make_corpus(work: Path, copies: int) -> list[Path]:
    """The embedded corpus, copied; each copy's documents get a suffix, so none repeats."""
    lines = embedded_corpus(work / "cache").read_text(encoding="utf-8").splitlines()
    files = []
    for k in range(copies):
        path = work / "corpus" / f"part{k}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps({"text": json.loads(line)["text"] + f"\n# copy {k}\n"}) + "\n")
        files.append(path)
    return files


def train_bpe(files: list[Path], path: Path, vocab_size: int = 32768) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (json.loads(line)["text"] for line in open(files[0], encoding="utf-8"))
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))


def h200_rate(vocab_size: int, seq_len: int) -> dict:
    args = dataclasses.replace(FLAVORS["llama_150m"], vocab_size=vocab_size)
    flops = flops_per_token(args, seq_len)
    return {"flavor": "llama_150m", "vocab_size": vocab_size, "seq_len": seq_len, "flops_per_token": flops,
            "mfu": MFU, "peak_flops": H200_BF16_PEAK, "tokens_per_s": MFU * H200_BF16_PEAK / flops}


def timed(batches, seconds: float, skip: int = 1) -> dict:
    """Tokens/s of next(batches) after `skip` batches (start-up), for about `seconds`."""
    for _ in range(skip):
        next(batches)
    tokens, count, start = 0, 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 3:
        inputs, _ = next(batches)
        tokens += inputs.numel()
        count += 1
    return {"tokens_per_s": tokens / elapsed, "batches": count, "seconds": elapsed}


def consuming_at(batches, rate: float, steps: int) -> dict:
    """A loop that takes a batch, then 'trains' on it for batch tokens / rate seconds (sleeping,
    as a GPU-bound trainer's host thread waits): the share of its time spent waiting for data."""
    next(batches)
    wait = busy = longest = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        inputs, _ = next(batches)
        waited = time.perf_counter() - start
        wait, longest = wait + waited, max(longest, waited)
        step = inputs.numel() / rate
        time.sleep(step)
        busy += step
    return {"steps": steps, "rate": rate, "data_wait_share": wait / (wait + busy), "wait_s": wait,
            "max_wait_s": longest}


def main(argv=None) -> int:
    args = parse_args(argv)
    meta = machine()
    if args.work_dir:
        try:  # a rerun deletes work/shards and the libraries' outputs: never a user's own folder
            work = claim_folder(args.work_dir)
        except FileExistsError as e:
            sys.exit(f"error: --work-dir: {e}")
    else:
        work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    files = local_files(args.corpus) if args.corpus else make_corpus(work, args.copies)
    tokenizer_path = Path(args.tokenizer) if args.tokenizer else work / "tokenizer.json"
    if not args.tokenizer and not tokenizer_path.is_file():
        train_bpe(files, tokenizer_path)
    tokenizer = build_tokenizer("hf", str(tokenizer_path))
    result = {"corpus_bytes": sum(f.stat().st_size for f in files), "tokenizer_vocab": tokenizer.vocab_size,
              "seq_len": args.seq_len, "local_batch_size": args.batch}
    rate = h200_rate(tokenizer.vocab_size, args.seq_len)
    result["h200_llama_150m"] = rate

    shards = work / "shards"
    shutil.rmtree(shards, ignore_errors=True)
    start = time.perf_counter()
    record = tokenizer_record(tokenizer, "hf", str(tokenizer_path))
    units = [u for n, p in enumerate(files) for u in file_units(n, p, 64 * 2**20)]
    settings = settings_for(record, "text", 100, "error", 64 * 2**20, {"files": listing(files)})
    index = prepare(shards, Plan(units, settings, listing(files)), tokenizer, args.prepare_workers,
                    progress_bar=False, log=lambda _: None)
    seconds = time.perf_counter() - start
    total = index["splits"]["train"]["tokens"] + index["splits"]["validation"]["tokens"]
    result["prepare"] = {"workers": args.prepare_workers, "seconds": seconds, "tokens": total,
                         "tokens_per_s": total / seconds}

    def shard_loader(mixture=(), **kwargs):
        data = Data(source=str(shards), mixture=[MixtureSource(str(shards), w) for w in mixture])
        return build_data(data, Training(seq_len=args.seq_len, local_batch_size=args.batch),
                          split="train", tokenizer=tokenizer, **kwargs)

    def text_loader(workers: int):
        data = Data(source=str(files[0]), num_workers=workers, cache_dir=str(work / "cache"))
        return build_data(data, Training(seq_len=args.seq_len, local_batch_size=args.batch),
                          split="train", tokenizer=tokenizer)

    loaders = {"shards": lambda: shard_loader(),
               "shards, mixture of 2": lambda: shard_loader(mixture=(0.7, 0.3)),
               "shards, rank 3 of 8": lambda: shard_loader(dp_rank=3, dp_world=8)}
    workers = [int(w) for w in args.workers.split(",")]
    loaders.update({f"text, num_workers={w}": (lambda w=w: text_loader(w)) for w in workers})
    result["loaders"], result["consumed_at_h200_rate"] = {}, {}
    steps = max(20, int(args.seconds * rate["tokens_per_s"] / (args.seq_len * args.batch)))
    for name, make in loaders.items():
        loader = make()
        result["loaders"][name] = timed(loader, args.seconds, skip=2)
        loader.close()
        if name in ("shards", f"text, num_workers={max(workers)}"):
            loader = make()
            result["consumed_at_h200_rate"][name] = consuming_at(loader, rate["tokens_per_s"], steps)
            loader.close()
    if args.compare_libraries:
        result["libraries"] = compare_libraries(work, files, tokenizer_path, tokenizer, args)

    meta["load_average_end"] = os.getloadavg()
    markdown = report(meta, result, args)
    write_report(args.out, {"meta": meta, "result": result}, markdown)
    print(markdown)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(meta: dict, result: dict, args) -> str:
    rate = result["h200_llama_150m"]
    lines = [*warning_lines(meta), f"CPU: {meta['cpu']} ({meta['cpus_usable']} usable, load average {meta['load_average'][0]:.1f} "
             f"at the start, {meta['load_average_end'][0]:.1f} at the end) · Python {meta['python']} · torch {meta.get('torch')} · numpy {meta.get('numpy')} · "
             f"tokenizers {meta.get('tokenizers')} · datasets {meta.get('datasets')}"
             + "".join(f" · {n} {meta[n]}" for n in ("litdata", "datatrove") if n in meta)
             + f" · {meta['date']} · "
             f"commit {meta['git']}", f"Command: `{meta['command']}`", "",
             f"Corpus: {result['corpus_bytes'] / 2**20:.1f} MiB of JSON lines; tokenizer: byte-level BPE, "
             f"{result['tokenizer_vocab']:,} tokens; windows of seq_len {result['seq_len']} + 1, local batch "
             f"{result['local_batch_size']}.", "",
             f"One H200 training llama_150m (vocab {rate['vocab_size']:,}, seq {rate['seq_len']}) consumes "
             f"about **{rate['tokens_per_s']:,.0f} tokens/s**: {rate['flops_per_token'] / 1e9:.3f} GFLOP per token "
             f"(6 x non-embedding parameters + attention, the trainer's MFU formula) at {rate['mfu']:.0%} MFU of "
             f"{rate['peak_flops'] / 1e12:.0f} TFLOP/s. Shard target: {SHARD_TARGET}x that = "
             f"{SHARD_TARGET * rate['tokens_per_s']:,.0f} tokens/s per rank.", "",
             "| loader (one rank) | tokens/s | x one H200's need | batches timed |", "|---|---|---|---|"]
    for name, r in result["loaders"].items():
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / rate['tokens_per_s']:.1f} | "
                     f"{r['batches']} |")
    p = result["prepare"]
    lines += ["", f"prepare_data ({p['workers']} worker processes): {p['tokens']:,} tokens in {p['seconds']:.1f} s, "
              f"{p['tokens_per_s']:,.0f} tokens/s.", "",
              "A loop taking batches at the H200's rate (sleeping for each batch's share of a step, as a "
              "GPU-bound trainer's host thread waits), the share of its time spent waiting for data "
              "(what train.py logs as data_wait):", "", "| loader | steps | waiting | wait, max per step |",
              "|---|---|---|---|"]
    for name, c in result["consumed_at_h200_rate"].items():
        lines.append(f"| {name} | {c['steps']} | **{c['data_wait_share']:.3%}** | {c['max_wait_s'] * 1e3:.2f} ms |")
    if "libraries" in result:
        lines += ["", "Libraries on the same corpus and tokenizer (same worker count; windows read in a "
                  "shuffled order (this repo: batches of --batch windows; the others one window at a time; "
                  "`datasets`: a slice of its memory-mapped values, no loader); 'layout-independent': 2 ranks of batch 2 read the windows "
                  "of 1 rank of batch 4):", "",
                  "| library | tokenize s | tokens | token bytes on disk | read tokens/s | layout-independent |",
                  "|---|---|---|---|---|---|"]
        for name, r in result["libraries"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error']} | | | | |")
                continue
            size = f"{r['bytes_on_disk'] / 2**20:.1f} MiB" if "bytes_on_disk" in r else "-"
            lines.append(f"| {name} | {r.get('prepare_s', float('nan')):.1f} | {r.get('tokens', 0):,} | {size} | "
                         f"{r.get('read_tokens_per_s', float('nan')):,.0f} | {r.get('layout_independent', '-')} |")
    return "\n".join(lines) + "\n"


def compare_libraries(work: Path, files: list[Path], tokenizer_path: Path, tokenizer, args) -> dict:
    """This repo's shards against litdata and datatrove, each only when installed."""
    out = {}
    workers = args.prepare_workers
    start = time.perf_counter()
    shards = work / "shards-again"
    shutil.rmtree(shards, ignore_errors=True)
    record = tokenizer_record(tokenizer, "hf", str(tokenizer_path))
    units = [u for n, p in enumerate(files) for u in file_units(n, p, 64 * 2**20)]
    settings = settings_for(record, "text", 100, "error", 64 * 2**20, {"files": listing(files)})
    index = prepare(shards, Plan(units, settings, listing(files)), tokenizer, workers,
                    progress_bar=False, log=lambda _: None)
    ours = {"prepare_s": time.perf_counter() - start,
            "tokens": index["splits"]["train"]["tokens"] + index["splits"]["validation"]["tokens"]}
    ours["read_tokens_per_s"] = timed(ShardBatches([TokenShards(shards)], [1.0], args.seq_len, args.batch, 0),
                                      args.seconds / 2)["tokens_per_s"]
    one = [tuple(r) for r in next(ShardBatches([TokenShards(shards)], [1.0], 64, 4, 0))[0].tolist()]
    two = [tuple(r) for rank in (0, 1) for r in next(ShardBatches([TokenShards(shards)], [1.0], 64, 2, 0, rank, 2))[0].tolist()]
    ours["layout_independent"] = one == two
    out["this repo (numpy .npy shards)"] = ours
    ours["bytes_on_disk"] = sum(f.stat().st_size for f in shards.rglob("*.npy"))
    for name, run in (("datasets (Arrow, map)", _datasets_arrow), ("litdata", _litdata), ("datatrove", _datatrove)):
        try:
            out[name] = run(work, files, tokenizer_path, tokenizer, workers, args)
        except ImportError:
            continue
        except Exception as e:  # a library's failure is a result, not the end of the benchmark
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _datasets_tokenize(batch: dict) -> dict:
    from components.tokenizer import build_tokenizer as build
    tokenizer = build("hf", os.environ["BENCH_TOKENIZER"])
    return {"ids": [[tokenizer.bos_id, *ids, tokenizer.eos_id] for ids in tokenizer.encode_batch(batch["text"])]}


def _datasets_arrow(work, files, tokenizer_path, tokenizer, workers, args) -> dict:
    """`datasets`' own route: map() over the documents into Arrow files of token lists."""
    import datasets

    cache = work / "datasets-cache"
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["BENCH_TOKENIZER"] = str(tokenizer_path)
    start = time.perf_counter()
    documents = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train",
                                      cache_dir=str(cache))
    tokenized = documents.map(_datasets_tokenize, batched=True, num_proc=workers, remove_columns=["text"])
    result = {"prepare_s": time.perf_counter() - start}
    column = tokenized.data.column("ids")
    result["tokens"] = int(sum(len(chunk.values) for chunk in column.chunks))
    values = np.frombuffer(column.chunks[0].values.buffers()[1], dtype=np.int32)  # zero-copy, memory-mapped
    order = np.random.default_rng(0).integers(0, max(1, values.size - args.seq_len - 1), 10**6)
    tokens, count, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds / 2:
        at = order[count % order.size]
        window = values[at:at + args.seq_len + 1].astype(np.int64)
        tokens += window.size
        count += 1
    result["read_tokens_per_s"] = tokens / (time.perf_counter() - start)
    result["bytes_on_disk"] = sum(f.stat().st_size for f in cache.rglob("*.arrow")
                                  if "cache-" in f.name)
    result["layout_independent"] = "no loader: windows, order, ranks and resume would be this repo's code"
    return result


def _litdata_tokenize(path: str):
    import torch

    from components.tokenizer import build_tokenizer as build
    tokenizer = build("hf", os.environ["BENCH_TOKENIZER"])
    for line in open(path, encoding="utf-8"):
        ids = tokenizer.encode(json.loads(line)["text"])
        yield torch.tensor([tokenizer.bos_id, *ids, tokenizer.eos_id], dtype=torch.int32)


def _litdata(work, files, tokenizer_path, tokenizer, workers, args) -> dict:
    from litdata import StreamingDataset, TokensLoader, optimize
    from litdata.utilities.env import _DistributedEnv

    out = work / "litdata"
    shutil.rmtree(out, ignore_errors=True)
    os.environ["BENCH_TOKENIZER"] = str(tokenizer_path)
    start = time.perf_counter()
    optimize(fn=_litdata_tokenize, inputs=[str(f) for f in files], output_dir=str(out),
             chunk_size=(args.seq_len + 1) * 256, item_loader=TokensLoader(), num_workers=workers)
    result = {"prepare_s": time.perf_counter() - start}
    dataset = StreamingDataset(str(out), item_loader=TokensLoader(block_size=args.seq_len + 1), shuffle=True,
                               seed=0)
    result["tokens"] = len(dataset) * (args.seq_len + 1)
    iterator = iter(dataset)
    next(iterator)
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds / 2:
        try:
            tokens += next(iterator).numel()
        except StopIteration:  # an epoch read: the next one, as a training run would
            iterator = iter(dataset)
    result["read_tokens_per_s"] = tokens / (time.perf_counter() - start)
    windows = {}
    for world in (1, 2):
        windows[world] = []
        for rank in range(world):
            data = StreamingDataset(str(out), item_loader=TokensLoader(block_size=65), shuffle=True, seed=0)
            data.distributed_env = _DistributedEnv(world, rank, 1)
            it = iter(data)
            windows[world] += [tuple(next(it).tolist()) for _ in range(4 // world)]
    result["layout_independent"] = windows[1] == windows[2]
    return result


def _datatrove(work, files, tokenizer_path, tokenizer, workers, args) -> dict:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer
    from datatrove.utils.dataset import DatatroveFolderDataset

    out, logs = work / "datatrove", work / "datatrove-logs"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    start = time.perf_counter()
    LocalPipelineExecutor(pipeline=[JsonlReader(str(files[0].parent)),
                                    DocumentTokenizer(str(out), tokenizer_name_or_path=str(tokenizer_path),
                                                      eos_token="<|end_of_text|>", shuffle_documents=False)],
                          tasks=len(files), workers=workers, logging_dir=str(logs)).run()
    result = {"prepare_s": time.perf_counter() - start}
    dataset = DatatroveFolderDataset(str(out), seq_len=args.seq_len, token_size=2 if tokenizer.vocab_size <= 2**16 else 4)
    order = np.random.default_rng(0).permutation(len(dataset))
    tokens, count, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds / 2:
        tokens += dataset[int(order[count % len(order)])]["input_ids"].numel()
        count += 1
    result["read_tokens_per_s"] = tokens / (time.perf_counter() - start)
    result["tokens"] = len(dataset) * args.seq_len
    result["layout_independent"] = "no loader state of its own (a map-style dataset: order and resume come from the sampler)"
    return result


if __name__ == "__main__":
    sys.exit(main())
