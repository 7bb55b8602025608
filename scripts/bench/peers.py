#!/usr/bin/env python3
"""This repo's train.py and torchtitan 0.2.2 side by side, on the same machine, in one call.

Each --run is one training process: `ours` runs train.py (synthetic tokens) with --config plus
the run's overrides; `titan` runs torchtitan through the peer runner in --titan-dir (see
../shared/peers/torchtitan/README.md: titan_train.py and make_assets.sh; torchtitan and its
wheels must be importable). Throughput is the median tokens/s per GPU of the logged windows
that start after --warmup-steps; peak memory is the largest reserved memory any window logged.
MFU is computed the same way for both: tokens/s x FLOPs per token (models.args.flops_per_token,
6 x matmul parameters + attention over the full square, torchtitan's formula) / 989 TFLOP/s
(dense bf16 peak of an H100 SXM / H200), also for float8 runs.

    python3 -m scripts.bench.peers --titan-dir .peer/torchtitan --out benchmarks/peers_1xh200 \\
        --run "ours_b4=ours:--training.local_batch_size 4" \\
        --run "titan_fp8_b4=titan:--training.local_batch_size 4 --model.converters \\
               quantize.linear.float8 --quantize.linear.float8.recipe_name tensorwise \\
               --quantize.linear.float8.filter_fqns output"

Writes <out>.json and <out>.md after every run (a killed call keeps what it measured); ratios
are against --reference (default: the fastest titan run).

@FILE reads arguments from FILE, a line at a time split as a shell would (# starts a comment):
scripts/bench/peer_runs/ holds the run lists of the comparisons benchmarks/ reports, each peer
at its best configuration beside this repo's, e.g. 8B on two GPUs:

    python3 -m scripts.bench.peers @scripts/bench/peer_runs/llama_8b_2gpu.args \
        --titan-dir .peer/torchtitan --out benchmarks/peers_8b_2xh200
"""

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.peers ...")

from components.allocator import allocator_settings, run_environment  # noqa: E402
from components.config.parse import load_config  # noqa: E402
from components.config.schema import ConfigError  # noqa: E402
from models.args import FLAVORS, flops_per_token  # noqa: E402  (torch, but no CUDA context)
from scripts.lib.report import (fmt, probe_environment, provenance,  # noqa: E402
                                report_file, warning_lines, write_report)
from scripts.lib.run_folders import exit_unless_clearable, fresh_run_folder  # noqa: E402
from scripts.lib.runs import (REPO, classify, last_lines, log_tail, read_metrics,  # noqa: E402
                              run_process, throughput, torchrun)

PEAK_FLOPS = 989e12
TITAN_FLAVORS = {"llama_1b": "1B", "llama_8b": "8B"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TITAN_LINE = re.compile(r"step:\s*(\d+)\s+loss:.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")


class ArgsFileParser(argparse.ArgumentParser):
    """@FILE's lines are split as a shell would split them, and # starts a comment."""

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        return shlex.split(arg_line, comments=True)


def parse_args(argv=None):
    p = ArgsFileParser(prog="python3 -m scripts.bench.peers", description=__doc__,
                       formatter_class=argparse.RawTextHelpFormatter, fromfile_prefix_chars="@")
    p.add_argument("--run", action="append", default=[], metavar="NAME=KIND[:ARGS]",
                   help="KIND is ours or titan; ARGS are that trainer's command-line overrides")
    p.add_argument("--config", default="configs/llama_1b.toml", help="train.py config; its "
                   "[model] flavor also picks torchtitan's flavor")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the median")
    p.add_argument("--log-freq", type=int, default=5)
    p.add_argument("--nproc", type=int, default=1, help="GPUs per run (torchrun)")
    p.add_argument("--titan-dir", default=str(REPO.parent / "shared/peers/torchtitan"))
    p.add_argument("--reference", default=None, help="run name the ratios are against")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", default="benchmarks/peers", help="output path without suffix")
    p.add_argument("--runs-dir", default="outputs/bench_peers")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    p.add_argument("--resume", action="store_true", help="keep the runs <out>.json already "
                   "holds that finished (same name, trainer and overrides) and run the others")
    args = p.parse_args(argv)
    args.runs = []
    for spec in args.run:
        name, eq, rest = spec.partition("=")
        kind, _, extra = rest.partition(":")
        if not eq or kind not in ("ours", "titan") or not re.fullmatch(r"[\w.-]+", name):
            p.error(f"--run {spec!r}: expected NAME=ours[:ARGS] or NAME=titan[:ARGS]")
        args.runs.append((name, kind, shlex.split(extra)))
    if not args.runs:
        p.error("give at least one --run")
    try:  # the flavor train.py will build: the config's, else the default
        args.flavor = load_config(["--config", args.config]).model.flavor
    except ConfigError as e:
        p.error(str(e))
    if args.flavor not in TITAN_FLAVORS and any(k == "titan" for _, k, _ in args.runs):
        p.error(f"{args.config}: flavor {args.flavor!r} has no torchtitan counterpart")
    return args


def ours_command(args, extra: list[str], dump: Path) -> tuple[list[str], Path]:
    train_py = str(REPO / "train.py")
    launch = torchrun(args.nproc) + [train_py] if args.nproc > 1 else [sys.executable, train_py]
    return [*launch, "--config", args.config, "--data.synthetic", "true",
            "--training.seq_len", str(args.seq_len), "--training.steps", str(args.steps),
            "--metrics.log_freq", str(args.log_freq), "--lr_scheduler.warmup_steps", "5",
            "--validation.enable", "false", "--job.print_config", "false", *extra,
            "--job.dump_folder", str(dump.resolve())], REPO


def titan_assets(args) -> Path:
    return Path(args.runs_dir).resolve() / "titan_assets"


def titan_command(args, extra: list[str], dump: Path) -> tuple[list[str], Path]:
    return [*torchrun(args.nproc), str(Path(args.titan_dir).resolve() / "titan_train.py"),
            "--model.name", "llama3", "--model.flavor", TITAN_FLAVORS[args.flavor],
            "--model.hf_assets_path", "./tests/assets/tokenizer", "--training.dataset", "c4_test",
            "--training.seq_len", str(args.seq_len), "--training.steps", str(args.steps),
            "--compile.enable", "--activation_checkpoint.mode", "none",
            "--metrics.log_freq", str(args.log_freq), "--lr_scheduler.warmup_steps", "5",
            "--metrics.disable_color_printing", *extra,
            "--job.dump_folder", str(dump.resolve())], titan_assets(args)


def titan_same_batch(extra: list[str]) -> int:
    """Ranks that read each batch in a torchtitan run: context x tensor parallel degree."""
    degrees = {"--parallelism.context_parallel_degree": 1,
               "--parallelism.tensor_parallel_degree": 1}
    for i, arg in enumerate(extra):
        name, eq, value = arg.partition("=")
        if name in degrees and (eq or i + 1 < len(extra)):
            degrees[name] = int(value if eq else extra[i + 1])
    return degrees["--parallelism.context_parallel_degree"] * degrees[
        "--parallelism.tensor_parallel_degree"]


def titan_rows(log: str, same_batch: int = 1) -> list[dict]:
    """torchtitan's logged steps. Its tps counts every batch's tokens on each rank that reads
    it (labels.numel() before its context-parallel sharding; tensor-parallel ranks alike), so
    under CP or TP it is same_batch times the tokens a GPU processes: divided by same_batch it
    is tokens/s per GPU as train.py logs it."""
    rows = {}
    for line in ANSI.sub("", log).splitlines():
        m = TITAN_LINE.search(line)
        if m:
            rows[int(m.group(1))] = {
                "step": int(m.group(1)),
                "tokens_per_second": float(m.group(3).replace(",", "")) / same_batch,
                "memory_max_reserved_gib": float(m.group(2))}
    return [rows[s] for s in sorted(rows)]


def execute(args, name: str, kind: str, extra: list[str]) -> dict:
    dump = fresh_run_folder(Path(args.runs_dir) / name)
    build = ours_command if kind == "ours" else titan_command
    cmd, cwd = build(args, extra, dump)
    if kind == "titan" and not (cwd / "tests/assets/c4_test/data.json").is_file():
        subprocess.run(["bash", str(Path(args.titan_dir) / "make_assets.sh"), str(cwd)],
                       check=True, stdout=subprocess.DEVNULL)
    log = dump / "train.log"
    # Both trainers get the allocator settings that each one's own launcher would give: ours sets
    # its default itself, torchtitan's run_train.sh sets the same (titan_train.py does not).
    env = run_environment()
    # torchtitan finds its data set and tokenizer relative to the working directory
    code, timed_out, seconds = run_process(cmd, log, args.run_timeout, cwd=cwd, env=env)
    output = log_tail(log)
    rows = (read_metrics(dump / "metrics.jsonl") if kind == "ours"
            else titan_rows(output, titan_same_batch(extra)))
    stats = throughput(rows, args.warmup_steps)
    finished = args.steps in stats["measured_steps"]
    status = classify(code, timed_out, output, bool(stats["measured_steps"]), finished)
    tps = stats["tokens_per_second"]
    fpt = flops_per_token(FLAVORS[args.flavor], args.seq_len)
    record = {"name": name, "trainer": kind, "args": extra, "status": status, "exit_code": code,
              "wall_seconds": round(seconds, 1), "tokens_per_second": tps,
              "mfu_percent": round(100 * tps * fpt / PEAK_FLOPS, 2) if tps else None,
              "memory_max_reserved_gib": stats["memory_max_reserved_gib"],
              "measured_steps": stats["measured_steps"], "command": shlex.join(cmd),
              "cwd": str(cwd), "allocator": allocator_settings(env)}
    if status != "ok":
        record["output_tail"] = last_lines(output)
    return record


def reference(args, runs: list[dict]) -> dict | None:
    ok = [r for r in runs if r["status"] == "ok"]
    if args.reference:
        return next((r for r in ok if r["name"] == args.reference), None)
    titan = [r for r in ok if r["trainer"] == "titan"]
    return max(titan, key=lambda r: r["tokens_per_second"]) if titan else None


def resumed_lines(meta: dict, runs: list[dict]) -> list[str]:
    """The line naming the runs --resume kept from earlier calls (a date other than this
    call's), with their commits and dates."""
    kept = [r for r in runs if r.get("date", meta["date"]) != meta["date"]]
    if not kept:
        return []
    return ["Kept from earlier calls (--resume): " + "; ".join(
        f"{r['name']} (git {r['git']}, {r['date']})" for r in kept) + ".", ""]


def markdown(meta: dict, runs: list[dict], ref: dict | None) -> str:
    lines = [*warning_lines(meta),
             f"# {meta['config']} ({meta['flavor']}), seq {meta['seq_len']}, "
             f"{meta['nproc']} GPU(s): this repo vs torchtitan 0.2.2", "",
             f"{meta.get('gpu')}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
             f"{meta['date']}, git {meta['git']}", "", f"`{meta['command']}`", "",
             *resumed_lines(meta, runs),
             "tokens/s per GPU: median of the logged windows after step "
             f"{meta['warmup_steps']}; MFU = tokens/s x FLOPs/token / 989 TFLOP/s (bf16 dense "
             "peak, also for float8); memory: peak reserved.", "",
             f"| run | trainer | overrides | tokens/s/GPU | MFU % | peak GiB | vs {ref['name'] if ref else '-'} |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['trainer']} | `{shlex.join(r['args'])}` | "
                         f"{r['status']} | | | |")
            continue
        ratio = f"{r['tokens_per_second'] / ref['tokens_per_second']:.3f}x" if ref else "-"
        lines.append(f"| {r['name']} | {r['trainer']} | `{shlex.join(r['args'])}` | "
                     f"{r['tokens_per_second']:,.0f} | {fmt(r['mfu_percent'], '{:.1f}')} | "
                     f"{fmt(r['memory_max_reserved_gib'], '{:.1f}')} | {ratio} |")
    for r in runs:
        if r["status"] != "ok":
            lines += ["", f"{r['name']}: {r['status']} (exit {r['exit_code']})", "```",
                      r.get("output_tail", ""), "```"]
    return "\n".join(lines) + "\n"


SAME_SETUP = ("config", "flavor", "nproc", "seq_len", "steps", "warmup_steps", "gpu",
              "gpu_count", "torch")


def finished_runs(report: Path, meta: dict) -> dict:
    """The runs of an earlier report that finished, by (name, trainer, overrides), each with the
    commit and date it ran at; {} where there is none. A report of another setup (config, GPUs,
    steps, torch) is refused: its runs would not compare with this call's."""
    if not report.is_file():
        return {}
    earlier = json.loads(report.read_text())
    then = earlier["meta"]
    differ = [f"{k}={then.get(k)!r}" for k in SAME_SETUP if then.get(k) != meta.get(k)]
    if differ:
        sys.exit(f"error: --resume: {report} was measured in another setup ({', '.join(differ)}"
                 "); give another --out")
    return {(r["name"], r["trainer"], tuple(r["args"])):
            {"git": then["git"], "date": then["date"], **r}
            for r in earlier["runs"] if r["status"] == "ok"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        for name, kind, extra in args.runs:
            build = ours_command if kind == "ours" else titan_command
            print(name, shlex.join(build(args, extra, Path(args.runs_dir) / name)[0]))
        return 0
    meta = {**probe_environment(), **provenance(), "config": args.config, "flavor": args.flavor,
            "nproc": args.nproc, "seq_len": args.seq_len, "steps": args.steps,
            "warmup_steps": args.warmup_steps, "log_freq": args.log_freq}
    out = Path(args.out)
    kept = finished_runs(report_file(out, ".json"), meta) if args.resume else {}
    exit_unless_clearable(Path(args.runs_dir) / name for name, kind, extra in args.runs
                          if (name, kind, tuple(extra)) not in kept)
    runs = []
    for name, kind, extra in args.runs:
        if (name, kind, tuple(extra)) in kept:
            runs.append(kept[name, kind, tuple(extra)])
            print(f"{name}: kept from {report_file(out, '.json')} (git {runs[-1]['git']})")
            continue
        start = time.monotonic()
        runs.append({**execute(args, name, kind, extra), "git": meta["git"],
                     "date": meta["date"]})
        r = runs[-1]
        print(f"{name}: {r['status']} {r['tokens_per_second'] or 0:,.0f} tok/s/GPU, "
              f"{r['memory_max_reserved_gib'] or 0:.1f} GiB ({time.monotonic() - start:.0f} s)",
              flush=True)
        ref = reference(args, runs)
        write_report(out, {"meta": meta, "reference": ref and ref["name"], "runs": runs},
                     markdown(meta, runs, ref))
    print(report_file(out, ".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
