#!/usr/bin/env python3
"""Train one config in several parallel layouts, fused and unfused, and record the lot.

For each layout and loss: one torchrun of train.py (same seed and data), then per layout
compare_losses.py on the fused and unfused curves (table, PNG, verdict). Writes JSON and a
markdown table: tokens/s per GPU, MFU and peak memory per run (medians of the logged windows
after --warmup-steps), final loss, and each layout's verdict.

    python3 -m scripts.compare_layouts --nproc 8 --steps 300 --out benchmarks/layouts_8xh200
    python3 -m scripts.compare_layouts --nproc 8 --layouts fsdp,tp2_sequence --dry-run

Layouts: "fsdp" (FSDP over every process), "tp<K>_sequence" and "tp<K>_vocab" (tensor
parallel of degree K with that loss-parallel mode, FSDP over the rest), "hsdp<R>" (R replicas,
FSDP inside each), "cp<K>" (context parallel of degree K, FSDP over the rest). --seed-runs adds an unfused run at seed + 1 per layout: the fused-unfused
difference is then judged against the seed-to-seed spread (compare_losses.py --seed-run, its
noise-band verdict, right for bf16 GPU runs); without it, against --tolerance at every step.

Runs write under --runs-dir/<layout>_<loss>; the report is rewritten after every run, so a killed
job keeps what it measured. This script never imports torch.
"""

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.compare_layouts ...")

from components.config.parse import load_config  # noqa: E402
from components.config.schema import ConfigError  # noqa: E402
from scripts.lib.report import (fmt, probe_environment, provenance, warning_lines,  # noqa: E402
                                write_report)
from scripts.lib.run_folders import exit_unless_clearable, fresh_run_folder  # noqa: E402
from scripts.lib.runs import (REPO, last_lines, log_tail, read_metrics,  # noqa: E402
                              run_process, throughput, trainer)

LAYOUT = re.compile(r"^(fsdp|tp(\d+)_(sequence|vocab)|hsdp(\d+)|cp(\d+))$")


def layout_overrides(name: str) -> list[str]:
    m = LAYOUT.match(name)
    if not m:
        raise ValueError(f"layout {name!r}: expected fsdp, tp<K>_sequence, tp<K>_vocab, "
                         "hsdp<R> or cp<K>")
    if m[2]:
        return ["--parallelism.tensor_parallel_degree", m[2], "--loss.parallel", m[3]]
    if m[4]:
        return ["--parallelism.data_parallel_replicate_degree", m[4]]
    if m[5]:
        return ["--parallelism.context_parallel_degree", m[5]]
    return []


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m scripts.compare_layouts", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/llama_1b.toml")
    p.add_argument("--nproc", type=int, default=8, help="processes (GPUs) per run")
    p.add_argument("--layouts", default="fsdp,tp2_sequence,tp2_vocab")
    p.add_argument("--losses", default="flce,unfused", help="[loss] impl values; the first is A")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-freq", type=int, default=5, help="train.py --metrics.log_freq")
    p.add_argument("--warmup-steps", type=int, default=20,
                   help="steps left out of the throughput figures (compilation, warm-up)")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="compare_losses.py --tolerance: max |loss difference| that passes "
                        "(without --seed-runs)")
    p.add_argument("--seed-runs", action="store_true",
                   help="also run the second loss at seed + 1 per layout (the noise reference)")
    p.add_argument("--extra", action="append", default=[],
                   help='further train.py overrides, e.g. --extra="--training.local_batch_size 2"')
    p.add_argument("--train-cmd", default=None,
                   help="the launcher, run as it is (default: this Python's torch.distributed.run "
                        "--standalone --nproc_per_node NPROC train.py; plain train.py for 1)")
    p.add_argument("--run-timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--out", default="benchmarks/layouts", help="report path without suffix")
    p.add_argument("--runs-dir", default="outputs/layouts", help="the runs' dump folders")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = p.parse_args(argv)
    args.extra = [token for chunk in args.extra for token in shlex.split(chunk)]
    args.layouts = args.layouts.split(",")
    args.losses = args.losses.split(",")
    try:
        for layout in args.layouts:
            layout_overrides(layout)
    except ValueError as e:
        p.error(str(e))
    if len(args.losses) != 2:
        p.error(f"--losses {','.join(args.losses)}: give two, the fused one first")
    if args.steps <= args.warmup_steps:
        p.error(f"--steps {args.steps} must exceed --warmup-steps {args.warmup_steps}")
    if not Path(args.config).is_file():
        p.error(f"--config {args.config}: no such file")
    try:  # the seed runs' seed is the runs' own + 1, as compare_fused_vs_unfused.sh's
        args.seed = load_config(["--config", args.config, *args.extra]).training.seed
    except ConfigError as e:
        p.error(str(e))
    return args


def plan(args) -> list[dict]:
    """(layout, loss, seed offset, dump folder, command) of every run, in run order."""
    runs = []
    for layout in args.layouts:
        variants = [(loss, 0) for loss in args.losses]
        if args.seed_runs:
            variants.append((args.losses[1], 1))
        for loss, seed_offset in variants:
            name = f"{layout}_{loss}" + (f"_seed+{seed_offset}" if seed_offset else "")
            dump = Path(args.runs_dir) / name
            seed = [] if not seed_offset else ["--training.seed", str(args.seed + seed_offset)]
            # train.py applies overrides in order: the per-run ones come last and always hold.
            cmd = [*trainer(args.nproc, args.train_cmd), "--config", args.config,
                   "--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_freq),
                   "--job.print_config", "false",
                   *args.extra, *layout_overrides(layout), "--loss.impl", loss, *seed,
                   "--job.dump_folder", str(dump)]
            runs.append({"layout": layout, "loss": loss, "seed_offset": seed_offset,
                         "dump_folder": str(dump), "command": shlex.join(cmd), "cmd": cmd})
    return runs


def execute(run: dict, args) -> dict:
    dump = fresh_run_folder(run["dump_folder"])
    code, timed_out, seconds = run_process(run["cmd"], dump / "train.log", args.run_timeout)
    rows = read_metrics(dump / "metrics.jsonl")
    stats = throughput(rows, args.warmup_steps)
    ok = code == 0 and not timed_out and rows and rows[-1]["step"] == args.steps
    record = {k: v for k, v in run.items() if k != "cmd"}
    record.update(status="ok" if ok else ("timeout" if timed_out else "error"), exit_code=code,
                  wall_seconds=round(seconds, 1), final_step=rows[-1]["step"] if rows else None,
                  final_loss=rows[-1].get("loss") if rows else None, **stats)
    if not ok:
        record["output_tail"] = last_lines(log_tail(dump / "train.log"))
    return record


def compare(layout: str, records: list[dict], args, out: Path) -> dict:
    """compare_losses.py on the layout's runs: fused (A) vs unfused, seed run as the reference."""
    mine = [r for r in records if r["layout"] == layout]
    if any(r["status"] != "ok" for r in mine):
        return {"layout": layout, "verdict": "not compared (a run failed)", "exit_code": None}
    main = [r["dump_folder"] for r in mine if not r["seed_offset"]]
    seed = [r["dump_folder"] for r in mine if r["seed_offset"]]
    png = out.parent / f"{out.name}_{layout}.png"
    cmd = [sys.executable, str(REPO / "scripts" / "compare_losses.py"), *main,
           "--tolerance", str(args.tolerance), "--out", str(png)]
    if seed:
        cmd += ["--seed-run", seed[0]]
    result = subprocess.run(cmd, capture_output=True, text=True)
    lines = result.stdout.strip().splitlines()
    verdict = next((line for line in reversed(lines) if line.startswith(("PASS", "FAIL"))),
                   f"error (exit {result.returncode}): {result.stderr.strip()[-300:]}")
    return {"layout": layout, "verdict": verdict, "exit_code": result.returncode,
            "plot": png.name, "table": result.stdout.strip(), "command": shlex.join(cmd)}


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [*warning_lines(meta),
             f"GPU: {meta.get('gpu')} ×{meta['nproc']} · torch {meta.get('torch')} · triton "
             f"{meta.get('triton')} · {meta['date']} · git {meta.get('git')}",
             f"Command: `{meta['command']}`", "",
             f"train.py {meta['config']}, {meta['steps']} steps; tokens/s per GPU and MFU are "
             f"medians of the windows logged after step {meta['warmup_steps']}; memory is the "
             "peak over the run.", "",
             "| layout | loss | status | tok/s/GPU | MFU % | peak alloc GiB | peak reserved GiB "
             "| final loss | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        loss = r["loss"] + (f" (seed +{r['seed_offset']})" if r["seed_offset"] else "")
        lines.append(f"| {r['layout']} | {loss} | {r['status']} | {fmt(r['tokens_per_second'])} "
                     f"| {fmt(r['mfu_percent'], '{:.1f}')} "
                     f"| {fmt(r['memory_max_allocated_gib'], '{:.1f}')} "
                     f"| {fmt(r['memory_max_reserved_gib'], '{:.1f}')} "
                     f"| {fmt(r['final_loss'], '{:.4f}')} | {r['wall_seconds']} |")
    lines += ["", "Fused vs unfused loss curves per layout (`scripts/compare_losses.py`):", ""]
    for c in report["comparisons"]:
        lines.append(f"- **{c['layout']}**: {c['verdict']}"
                     + (f" (plot `{c['plot']}`)" if c.get("plot") else ""))
    for c in report["comparisons"]:
        if c.get("table"):
            lines += ["", f"<details><summary>{c['layout']}</summary>", "", "```", c["table"],
                      "```", "</details>"]
    for r in report["runs"]:
        if r.get("output_tail"):
            lines += ["", f"{r['layout']} {r['loss']} ({r['status']}, exit {r['exit_code']}):",
                      "", "```", r["output_tail"], "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = plan(args)
    if args.dry_run:
        for r in runs:
            print(r["command"])
        return 0
    exit_unless_clearable(run["dump_folder"] for run in runs)
    out = Path(args.out)
    meta = {**probe_environment(), **provenance(), "nproc": args.nproc, "config": args.config,
            "steps": args.steps, "warmup_steps": args.warmup_steps, "log_freq": args.log_freq,
            "tolerance": args.tolerance, "extra": args.extra}
    report = {"meta": meta, "runs": [], "comparisons": []}
    for i, run in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {run['command']}", flush=True)
        record = execute(run, args)
        report["runs"].append(record)
        print(f"    {record['status']}: {fmt(record['tokens_per_second'])} tok/s/GPU, final loss "
              f"{fmt(record['final_loss'], '{:.4f}')}", flush=True)
        layout_done = i == len(runs) or runs[i]["layout"] != run["layout"]
        if layout_done:
            report["comparisons"].append(compare(run["layout"], report["runs"], args, out))
            print(f"    {run['layout']}: {report['comparisons'][-1]['verdict']}", flush=True)
        write_report(out, report, markdown(report))
    print(markdown(report))
    ok = all(r["status"] == "ok" for r in report["runs"])
    return 0 if ok and all(c["exit_code"] == 0 for c in report["comparisons"]) else 1


if __name__ == "__main__":
    sys.exit(main())
