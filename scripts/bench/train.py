#!/usr/bin/env python3
"""End-to-end training throughput of the fused loss against the unfused ones, through train.py.

Every configuration is its own train.py process on synthetic tokens, so an out-of-memory run
cannot leave this process (or its GPU memory) in a bad state. Throughput is the median of the
logged windows that start after --warmup-steps (compilation and allocator warm-up happen in the
first steps); peak memory is the largest over the whole run.

Two comparisons (--mode both runs the first, then the second):
  equal   every loss at --batch with the first --ac mode (default: none)
  search  per loss, for each --ac mode: the local batch doubles from --search-start up to
          --max-batch until the first out-of-memory, then up to --bisect runs between the last
          fit and the first OOM. A mode with more checkpointing starts at the batch that ran out
          of memory with less: checkpointing only lowers memory, so the smaller batches fit too,
          and at the same batch more recompute can only be slower. Reports, per loss, the largest
          batch that fits (at ac none and with any mode) and the fastest configuration.

    python3 -m scripts.bench.train --dry-run                 # the plan and the first command
    python3 -m scripts.bench.train --mode equal              # 3 runs
    python3 -m scripts.bench.train --budget-minutes 30 --out benchmarks/train_h200
    python3 -m scripts.bench.train --nproc 2 --out benchmarks/train_2xh200  # torchrun + FSDP

<out>.json and <out>.md are rewritten after every run, so a killed benchmark keeps what it
measured; each run's dump folder (metrics.jsonl, config.toml, train.log) is under --runs-dir.
The benchmark itself never imports torch: a CUDA context here would take GPU memory from the runs.
"""

import argparse
import shlex
import signal
import statistics
import sys
import time
import tomllib
from pathlib import Path

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.train ...")

from scripts.lib.report import report_file, write_report  # noqa: E402
from scripts.lib.run_folders import exit_unless_clearable, fresh_run_folder  # noqa: E402
from scripts.lib.runs import (classify, last_lines, log_tail, read_metrics,  # noqa: E402
                              run_process, throughput, trainer)
from scripts.lib.train_report import (AC_MODES, build_meta, markdown,  # noqa: E402
                                      measured_steps, summarize)

# Benchmark name -> [loss] impl. unfused_compiled also compiles the loss module (--compile).
LOSS_IMPLS = {"flce": "flce", "unfused": "unfused", "torch_chunked": "torch_chunked",
              "unfused_compiled": "unfused"}
RUN_FOLDER = "{loss}_b{batch}_ac-{ac}"  # each run's dump folder under --runs-dir


class BudgetExhausted(Exception):
    pass


# ---- arguments --------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.train", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/llama_1b.toml", help="train.py config (TOML)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=25, help="training steps per run")
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="steps left out of the throughput (compilation happens in the first)")
    p.add_argument("--log-freq", type=int, default=5, help="train.py --metrics.log_freq")
    p.add_argument("--losses", default="flce,unfused,torch_chunked",
                   help=f"comma-separated, from {', '.join(LOSS_IMPLS)}")
    p.add_argument("--mode", choices=("equal", "search", "both"), default="both")
    p.add_argument("--batch", type=int, default=4, help="local batch of the equal-batch runs")
    p.add_argument("--ac", default=",".join(AC_MODES),
                   help="activation-checkpointing modes the search tries (least checkpointing "
                        "first); the equal-batch runs use the first one listed")
    p.add_argument("--max-batch", type=int, default=32, help="largest local batch searched")
    p.add_argument("--search-start", type=int, default=1, help="first local batch searched")
    p.add_argument("--bisect", type=int, default=1,
                   help="runs between the last fit and the first OOM, per loss and AC mode")
    p.add_argument("--compile", choices=("config", "true", "false"), default="config",
                   help="[compile] enable for every run (config: the config's setting)")
    p.add_argument("--nproc", type=int, default=1,
                   help="processes (GPUs) per run; > 1 runs under torchrun (FSDP)")
    p.add_argument("--train-cmd", default=None,
                   help="the trainer command, run as it is (default: this Python on train.py, "
                        "under torch.distributed.run when --nproc > 1)")
    p.add_argument("--extra", action="append", default=[],
                   help='further train.py overrides, e.g. --extra="--loss.chunk_size 4096" '
                        "(repeatable; the per-run loss, batch, AC and folder still win)")
    p.add_argument("--budget-minutes", type=float, default=0,
                   help="no run starts that would end past this (0: no limit); a run still "
                        "going at the limit is stopped")
    p.add_argument("--run-timeout", type=float, default=1200, help="seconds per run")
    p.add_argument("--out", default="benchmarks/train_bench", help="output path without suffix")
    p.add_argument("--runs-dir", default="outputs/train_bench", help="the runs' dump folders")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the first command")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.losses = list(dict.fromkeys(x.strip() for x in args.losses.split(",") if x.strip()))
    args.ac = list(dict.fromkeys(x.strip() for x in args.ac.split(",") if x.strip()))
    unknown = [x for x in args.losses if x not in LOSS_IMPLS]
    if unknown or not args.losses:
        p.error(f"--losses {','.join(unknown) or '(empty)'}: expected some of "
                f"{', '.join(LOSS_IMPLS)}")
    bad_ac = [x for x in args.ac if x not in AC_MODES]
    if bad_ac or not args.ac:
        p.error(f"--ac {','.join(bad_ac) or '(empty)'}: expected some of {', '.join(AC_MODES)}")
    for name in ("seq_len", "steps", "log_freq", "batch", "max_batch", "search_start", "nproc"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.bisect < 0 or args.warmup_steps < 0 or args.budget_minutes < 0:
        p.error("--bisect, --warmup-steps and --budget-minutes must be >= 0")
    if args.search_start > args.max_batch:
        p.error(f"--search-start {args.search_start} is above --max-batch {args.max_batch}")
    if not measured_steps(args.steps, args.log_freq, args.warmup_steps):
        p.error(f"no logged window starts after --warmup-steps {args.warmup_steps} with "
                f"--steps {args.steps} and --log-freq {args.log_freq}: raise --steps")
    if args.train_cmd and args.nproc > 1:
        p.error("--nproc launches torchrun around the default trainer; with --train-cmd, "
                "put the launcher into that command instead")
    if not Path(args.config).is_file():
        p.error(f"--config {args.config}: no such file")
    try:
        with open(args.config, "rb") as f:
            args.config_data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        p.error(f"--config {args.config}: invalid TOML: {e}")
    args.extra = [token for chunk in args.extra for token in shlex.split(chunk)]


# ---- one run ----------------------------------------------------------------------------------

def base_compile(args) -> tuple[bool, list[str]]:
    """[compile] enable/components of every run before the loss variant's own change."""
    section = args.config_data.get("compile", {})
    enabled = section.get("enable", False) if args.compile == "config" else args.compile == "true"
    return enabled, list(section.get("components", ["model"]))


def compile_overrides(args, loss: str) -> list[str]:
    enabled, components = base_compile(args)
    if loss == "unfused_compiled":
        # Compile the loss module on top of whatever the other runs compile.
        components = [*(c for c in components if c != "loss"), "loss"] if enabled else ["loss"]
        return ["--compile.enable", "true", "--compile.components", ",".join(components)]
    return [] if args.compile == "config" else ["--compile.enable", args.compile]


def compile_label(args, loss: str, dump: Path) -> str:
    """What was compiled: the run's own resolved config.toml if it wrote one, else the plan."""
    try:
        section = tomllib.loads((dump / "config.toml").read_text())["compile"]
        enabled, components = section["enable"], section["components"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        enabled, components = base_compile(args)
        if loss == "unfused_compiled":
            enabled, components = True, ([*components, "loss"] if enabled else ["loss"])
    return ",".join(components) if enabled else "off"


def train_command(args, loss: str, batch: int, ac: str, dump: Path) -> list[str]:
    # train.py applies overrides in order: --extra may change the common settings, the
    # per-run ones come last so that they always hold.
    return [*trainer(args.nproc, args.train_cmd), "--config", args.config,
            "--data.synthetic", "true", "--training.seq_len", str(args.seq_len),
            "--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_freq),
            "--lr_scheduler.warmup_steps", str(max(0, min(5, args.steps - 1))),
            "--validation.enable", "false", "--checkpoint.enable_checkpoint", "false",
            "--job.print_config", "false", *args.extra,
            "--loss.impl", LOSS_IMPLS[loss], *compile_overrides(args, loss),
            "--training.local_batch_size", str(batch), "--activation_checkpoint.mode", ac,
            "--job.dump_folder", str(dump)]


# ---- the benchmark ----------------------------------------------------------------------------

class Bench:
    """Runs configurations once each (the search reuses the equal-batch runs), keeps the records
    and rewrites the report after every run."""

    def __init__(self, args, meta: dict):
        self.args = args
        self.meta = meta
        self.runs: list[dict] = []
        self.by_key: dict[tuple, dict] = {}
        self.state = "running"
        self.start = time.monotonic()
        self.max_runs = planned_max_runs(args)

    def budget_left(self) -> float:
        if not self.args.budget_minutes:
            return float("inf")
        return self.args.budget_minutes * 60 - (time.monotonic() - self.start)

    def typical_run_seconds(self) -> float:
        walls = [r["wall_seconds"] for r in self.runs if r["status"] == "ok"]
        return statistics.median(walls) if walls else 0.0

    def run(self, loss: str, batch: int, ac: str, phase: str) -> dict:
        key = (loss, batch, ac)
        if key in self.by_key:
            return self.by_key[key]
        left = self.budget_left()
        if left <= 0 or left < self.typical_run_seconds():
            raise BudgetExhausted(f"--budget-minutes {self.args.budget_minutes} reached "
                                  f"({len(self.runs)} runs)")
        record = self._execute(loss, batch, ac, phase, timeout=min(self.args.run_timeout, left))
        self.runs.append(record)
        self.by_key[key] = record
        self.write()
        print(progress_line(record, len(self.runs), self.max_runs), flush=True)
        return record

    def _execute(self, loss, batch, ac, phase, timeout) -> dict:
        runs_dir = Path(self.args.runs_dir)
        dump = fresh_run_folder(runs_dir / RUN_FOLDER.format(loss=loss, batch=batch, ac=ac))
        cmd = train_command(self.args, loss, batch, ac, dump)
        returncode, timed_out, seconds = run_process(cmd, dump / "train.log", timeout)
        output = log_tail(dump / "train.log")
        stats = throughput(read_metrics(dump / "metrics.jsonl"), self.args.warmup_steps)
        finished = self.args.steps in stats["measured_steps"]
        status = classify(returncode, timed_out, output, bool(stats["measured_steps"]), finished)
        record = {"loss": loss, "loss_impl": LOSS_IMPLS[loss], "batch": batch, "ac": ac,
                  "compile": compile_label(self.args, loss, dump), "phase": phase,
                  "status": status, "stopped_at_limit": timed_out, "exit_code": returncode,
                  "wall_seconds": round(seconds, 1),
                  **stats, "command": shlex.join(cmd), "dump_folder": str(dump)}
        if status != "ok":
            lines = output.rstrip().splitlines()
            if returncode == 0 and not timed_out:
                lines.append(f"(no logged step after the warm-up of {self.args.warmup_steps} "
                             "steps: raise --steps or lower --warmup-steps)")
            record["output_tail"] = last_lines("\n".join(lines))
        return record

    def report(self) -> dict:
        return {"meta": {**self.meta, "elapsed_minutes": round((time.monotonic() - self.start)
                                                                / 60, 1)},
                "state": self.state, "runs": self.runs, "summary": summarize(self.runs, self.args)}

    def write(self) -> None:
        report = self.report()
        write_report(self.args.out, report, markdown(report, self.args))


def progress_line(r: dict, index: int, max_runs: int) -> str:
    head = f"[{index}/<={max_runs}] {r['loss']} batch {r['batch']} ac {r['ac']}: "
    if r["status"] != "ok":
        return head + f"{r['status']} ({r['wall_seconds']:.0f} s)"
    parts = [f"{r['tokens_per_second']:,.0f} tok/s/device"]
    if r["mfu_percent"] is not None:
        parts.append(f"MFU {r['mfu_percent']:.1f}%")
    if r["memory_max_reserved_gib"] is not None:
        parts.append(f"{r['memory_max_reserved_gib']:.1f} GiB reserved")
    return head + ", ".join(parts) + f" ({r['wall_seconds']:.0f} s)"


def batches_from(start: int, cap: int) -> list[int]:
    """start, 2*start, 4*start, ... below cap, then cap itself."""
    out, b = [], start
    while b < cap:
        out.append(b)
        b *= 2
    return out + [cap]


def search_one(bench: Bench, loss: str, ac: str, known_fit: int, known_oom: int | None):
    """Largest batch that fits for (loss, ac) and the smallest that did not (None: unknown).

    known_fit / known_oom come from the modes with less checkpointing: the former fits here too
    and is not run again; the search starts at the latter (or above the former)."""
    args = bench.args
    if known_fit >= args.max_batch:
        return known_fit, None
    start = known_oom or (2 * known_fit if known_fit else args.search_start)
    fit, oom = known_fit, None
    for batch in batches_from(min(start, args.max_batch), args.max_batch):
        status = bench.run(loss, batch, ac, "search")["status"]
        if status == "ok":
            fit = batch
            continue
        if status != "oom":
            return fit, None  # an error or a timeout: larger batches would not tell more
        oom = batch
        break
    if oom is None:
        return fit, None  # fits --max-batch
    batch = oom // 2
    while fit == 0 and batch >= 1:  # nothing fit yet: halve down from the first OOM
        status = bench.run(loss, batch, ac, "search")["status"]
        if status == "ok":
            fit = batch
        elif status == "oom":
            oom, batch = batch, batch // 2
        else:
            return fit, oom
    for _ in range(args.bisect):
        if fit == 0 or oom - fit <= 1:
            break
        mid = (fit + oom) // 2
        status = bench.run(loss, mid, ac, "search")["status"]
        if status not in ("ok", "oom"):
            break
        fit, oom = (mid, oom) if status == "ok" else (fit, mid)
    return fit, oom


def search_order(acs: list[str]) -> list[str]:
    """Least checkpointing first, whatever the --ac order: each mode builds on the previous."""
    return [mode for mode in AC_MODES if mode in acs]


def run_search(bench: Bench) -> None:
    # AC mode by AC mode across all losses, so that a budget cut still compares every loss.
    known = {loss: (0, None) for loss in bench.args.losses}
    for ac in search_order(bench.args.ac):
        for loss in bench.args.losses:
            fit, oom = search_one(bench, loss, ac, *known[loss])
            known[loss] = (fit, oom if oom is not None else known[loss][1])


def run_equal(bench: Bench) -> None:
    for loss in bench.args.losses:
        bench.run(loss, bench.args.batch, bench.args.ac[0], "equal")


def planned_max_runs(args) -> int:
    equal = len(args.losses) if args.mode in ("equal", "both") else 0
    # Doubling up, or halving down from --search-start when it does not fit, then bisection.
    per_mode = (len(batches_from(args.search_start, args.max_batch)) + args.bisect
                + args.search_start.bit_length() - 1)
    search = len(args.losses) * len(args.ac) * per_mode if args.mode in ("search", "both") else 0
    return equal + search


def print_plan(args) -> None:
    measured = ", ".join(map(str, measured_steps(args.steps, args.log_freq, args.warmup_steps)))
    print(f"Plan: {args.config}, seq {args.seq_len}, {args.nproc} process(es), {args.steps} steps "
          f"a run (tokens/s: median of the windows logged at steps {measured}); "
          f"losses {', '.join(args.losses)}")
    if args.mode in ("equal", "both"):
        print(f"  equal batch: {len(args.losses)} runs at local batch {args.batch}, "
              f"ac {args.ac[0]}")
    if args.mode in ("search", "both"):
        batches = ", ".join(map(str, batches_from(args.search_start, args.max_batch)))
        print(f"  search, per loss and AC mode ({', '.join(search_order(args.ac))}): local "
              f"batch {batches} until the first OOM, then up to {args.bisect} bisection "
              "run(s); a mode with more checkpointing starts at the batch that ran out of "
              "memory with less")
    budget = f"budget {args.budget_minutes:g} min" if args.budget_minutes else "no time budget"
    print(f"  at most {planned_max_runs(args)} runs (each search stops at its first OOM, so "
          f"usually far fewer); {budget}; results to {report_file(args.out, '.json')} and "
          f"{report_file(args.out, '.md').name}", flush=True)


# ---- main -------------------------------------------------------------------------------------


def exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_process, which stops the trainer


def main(argv=None) -> int:
    args = parse_args(argv)
    print_plan(args)
    if args.dry_run:
        first = args.batch if args.mode != "search" else args.search_start
        print(shlex.join(train_command(args, args.losses[0], first, args.ac[0],
                                       Path(args.runs_dir) / "RUN")))
        return 0
    # which batches run is found as it goes: check every folder a run of this bench could reuse
    exit_unless_clearable(sorted(Path(args.runs_dir).glob(RUN_FOLDER.format(loss="*", batch="*",
                                                                           ac="*"))))
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    bench = Bench(args, build_meta(args))
    bench.write()
    try:
        if args.mode in ("equal", "both"):
            run_equal(bench)
        if args.mode in ("search", "both"):
            run_search(bench)
        bench.state = "complete"
    except BudgetExhausted as e:
        bench.state = f"stopped: {e}"
        print(f"stopped: {e}", flush=True)
    except (KeyboardInterrupt, SystemExit):
        bench.state = "interrupted"
        bench.write()
        raise
    bench.write()
    print(markdown(bench.report(), args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
