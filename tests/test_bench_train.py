"""scripts/bench/train.py: short real CPU runs of train.py (equal batch, then a search over
batches 1, 2, 4), and, through --train-cmd, a stand-in trainer that prints what train.py prints on
an out-of-memory or another failure, or writes metrics.jsonl with a memory limit per AC mode: the
benchmark's parsing, its batch search (doubling, bisection, AC modes) and its time budget."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.bench import train as bench_train
from scripts.lib import train_report
from scripts.lib.runs import classify
from torch_threads import ONE_THREAD

REPO = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, "-m", "scripts.bench.train"]

# Reads the `--key value` pairs the benchmark passes. FAKE_MODE=oom / error fails like train.py;
# otherwise the run fits when the local batch is at most LIMITS[loss][ac], logs the steps train.py
# logs (a slow first window, which the warm-up must leave out) and tokens/s = batch * SPEED[ac].
FAKE_TRAINER = r"""
import json, os, sys, time
from pathlib import Path
opts = dict(zip(sys.argv[1::2], sys.argv[2::2]))
mode = os.environ.get("FAKE_MODE", "limits")
time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
if mode == "oom":
    print("Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory. "
          "Tried to allocate 3.91 GiB.", file=sys.stderr)
    sys.exit(1)
if mode == "error":
    print("Traceback (most recent call last):\nRuntimeError: boom in the trainer", file=sys.stderr)
    sys.exit(1)
LIMITS = {"flce": {"none": 5, "full": 12}, "unfused": {"none": 3, "full": 6}}
SPEED = {"none": 1000.0, "full": 700.0}
batch, ac = int(opts["--training.local_batch_size"]), opts["--activation_checkpoint.mode"]
if batch > LIMITS[opts["--loss.impl"]][ac]:
    print("torch.OutOfMemoryError: CUDA out of memory.", file=sys.stderr)
    sys.exit(1)
dump, steps, freq = Path(opts["--job.dump_folder"]), int(opts["--training.steps"]), int(opts["--metrics.log_freq"])
dump.mkdir(parents=True, exist_ok=True)
with open(dump / "metrics.jsonl", "w") as f:
    for step in range(1, steps + 1):
        if step % freq == 0 or step in (1, steps):
            tps = batch * SPEED[ac] / (10 if step == 1 else 1)
            f.write(json.dumps({"step": step, "loss": 5.0, "tokens_per_second": tps,
                                "tokens_per_second_total": 2 * tps, "mfu_percent": tps / 1e3,
                                "memory_max_allocated_gib": batch, "memory_max_reserved_gib": batch + 1.0}) + "\n")
    f.write(json.dumps({"step": steps, "val_loss": 5.0}) + "\n")
"""

CPU_RUN = ["--config", "configs/debug.toml", "--seq-len", "64", "--steps", "4",
           "--warmup-steps", "1", "--losses", "flce,unfused", "--batch", "2", "--max-batch", "4",
           "--ac", "none"]


# Generous: six trainer processes start and import torch; on a loaded GPU machine (pytest-xdist
# workers) 120 s ran out while the same test alone took 60 s.
def bench(tmp_path, *args, env=None, timeout=400):
    out = tmp_path / "report"
    result = subprocess.run([*SCRIPT, *args, "--out", str(out),
                             "--runs-dir", str(tmp_path / "runs")],
                            cwd=REPO, env={**os.environ, **(env or {})}, text=True,
                            capture_output=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return (json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text(),
            result.stdout)


@pytest.fixture
def fake_trainer(tmp_path):
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAINER)
    return ["--train-cmd", shlex.join([sys.executable, str(path)])]


# ---- real train.py runs on the CPU ------------------------------------------------------------

@pytest.mark.slow
def test_equal_batch_and_search_on_the_cpu(tmp_path):
    # CUDA hidden: the runs must be CPU runs also on a GPU machine (MFU and memory are None)
    report, md, stdout = bench(tmp_path, *CPU_RUN, "--mode", "both",
                               env={"CUDA_VISIBLE_DEVICES": "", **ONE_THREAD})
    runs = report["runs"]
    # The search's batch-2 runs are the equal-batch runs, not run twice.
    assert [(r["loss"], r["batch"]) for r in runs] == [
        ("flce", 2), ("unfused", 2), ("flce", 1), ("flce", 4), ("unfused", 1), ("unfused", 4)]
    for r in runs:
        assert r["status"] == "ok", r
        assert r["tokens_per_second"] > 0 and r["tokens_per_second_total"] > 0
        assert r["measured_steps"] == [4]
        assert r["mfu_percent"] is None and r["memory_max_reserved_gib"] is None  # CPU
        assert r["compile"] == "off" and r["ac"] == "none"
        assert (Path(r["dump_folder"]) / "metrics.jsonl").is_file()
    assert "--loss.impl flce" in runs[0]["command"] and "--loss.impl unfused" in runs[1]["command"]
    assert report["state"] == "complete"
    assert report["meta"]["torch"] and report["meta"]["date"] and "--max-batch 4" in report["meta"]["command"]
    for loss in ("flce", "unfused"):
        s = report["summary"]["per_loss"][loss]
        assert s["equal"]["status"] == "ok" and s["equal"]["tokens_per_second"] > 0
        assert s["best"]["tokens_per_second"] > 0
        assert s["largest_batch_ac_none"]["batch"] == 4 and s["largest_batch"]["batch"] == 4
    comparison = report["summary"]["comparisons"]["flce_vs_unfused"]
    assert comparison["equal_batch_speedup"] > 0 and comparison["largest_batch_ratio"] == 1.0
    assert "| flce | 2 | none | off |" in md and "| unfused | 4 | none | off |" in md
    assert "- flce vs unfused:" in md and "Command: `" in md and "GPU: " in md
    assert stdout.startswith("Plan: ")


# ---- a stand-in trainer: parsing and the search -----------------------------------------------

def test_out_of_memory_runs_are_reported_not_fatal(tmp_path, fake_trainer):
    report, md, _ = bench(tmp_path, *CPU_RUN, "--mode", "both", *fake_trainer,
                          env={"FAKE_MODE": "oom"})
    runs = report["runs"]
    # Equal batch 2 runs out of memory; the search tries 1, which does too, and gives up.
    assert [(r["loss"], r["batch"], r["status"]) for r in runs] == [
        ("flce", 2, "oom"), ("unfused", 2, "oom"), ("flce", 1, "oom"), ("unfused", 1, "oom")]
    assert all(r["exit_code"] == 1 and r["tokens_per_second"] is None for r in runs)
    assert "CUDA out of memory" in runs[0]["output_tail"]
    s = report["summary"]["per_loss"]["flce"]
    assert s["equal"]["status"] == "oom" and s["best"] is None
    assert s["largest_batch"] == {"batch": None, "ac": None, "first_oom_above": 1}
    assert report["summary"]["comparisons"]["flce_vs_unfused"]["equal_batch_speedup"] is None
    assert report["state"] == "complete"
    assert "| flce | 2 | none |" in md and "| oom |" in md and "none fit (OOM from 1)" in md and "n/a" in md


def test_a_failed_run_keeps_its_last_lines(tmp_path, fake_trainer):
    report, md, _ = bench(tmp_path, *CPU_RUN, "--mode", "both", "--losses", "flce",
                          *fake_trainer, env={"FAKE_MODE": "error"})
    # An error is not an OOM: the search does not go on to other batches after it.
    assert [(r["batch"], r["status"]) for r in report["runs"]] == [(2, "error"), (1, "error")]
    assert "RuntimeError: boom in the trainer" in report["runs"][0]["output_tail"]
    assert "boom in the trainer" in md and "error (exit 1)" in md


def test_search_doubles_bisects_and_tries_more_checkpointing(tmp_path, fake_trainer):
    report, md, _ = bench(tmp_path, "--config", "configs/debug.toml", "--mode", "search",
                          "--losses", "flce,unfused", "--ac", "none,full", "--max-batch", "32",
                          "--bisect", "2", "--steps", "25", "--warmup-steps", "10", *fake_trainer)
    tried = [(r["loss"], r["ac"], r["batch"], r["status"]) for r in report["runs"]]
    # flce fits 5 at ac none, 12 with full AC; unfused 3 and 6. Full AC starts at the batch that
    # ran out of memory without it (the smaller ones fit there too, only more slowly).
    assert tried == [
        ("flce", "none", 1, "ok"), ("flce", "none", 2, "ok"), ("flce", "none", 4, "ok"),
        ("flce", "none", 8, "oom"), ("flce", "none", 6, "oom"), ("flce", "none", 5, "ok"),
        ("unfused", "none", 1, "ok"), ("unfused", "none", 2, "ok"),
        ("unfused", "none", 4, "oom"), ("unfused", "none", 3, "ok"),
        ("flce", "full", 6, "ok"), ("flce", "full", 12, "ok"), ("flce", "full", 24, "oom"),
        ("flce", "full", 18, "oom"), ("flce", "full", 15, "oom"),
        ("unfused", "full", 4, "ok"), ("unfused", "full", 8, "oom"),
        ("unfused", "full", 6, "ok"), ("unfused", "full", 7, "oom")]
    flce = report["summary"]["per_loss"]["flce"]
    # The slow first window (step 1) and the steps up to 10 are left out of the median.
    assert report["runs"][0]["measured_steps"] == [15, 20, 25]
    assert report["runs"][0]["tokens_per_second"] == 1000.0
    assert report["runs"][0]["memory_max_reserved_gib"] == 2.0
    assert flce["best"]["batch"] == 12 and flce["best"]["ac"] == "full"
    assert flce["best"]["tokens_per_second"] == 12 * 700.0
    assert flce["largest_batch_ac_none"] == {"batch": 5, "ac": "none", "first_oom_above": 6}
    assert flce["largest_batch"] == {"batch": 12, "ac": "full", "first_oom_above": 15}
    assert flce["equal"]["tokens_per_second"] == 4000.0  # batch 4, ac none ran in the search
    c = report["summary"]["comparisons"]["flce_vs_unfused"]
    assert c["best_speedup"] == 2.0 and c["largest_batch_ratio"] == 2.0
    assert c["largest_batch_ratio_ac_none"] == pytest.approx(5 / 3, abs=1e-3)
    assert c["equal_batch_speedup"] is None  # unfused ran out of memory at batch 4
    assert "12 (ac full; OOM at 15)" in md and "| flce | 12 | full |" in md


@pytest.mark.parametrize("revision, dirty", [("abc1234", False), ("abc1234+dirty", True)])
def test_report_records_the_commit_and_flags_a_dirty_tree(tmp_path, fake_trainer, revision,
                                                          dirty):
    report, md, _ = bench(tmp_path, *CPU_RUN, "--mode", "equal", *fake_trainer,
                          env={"FLCE_GIT_REVISION": revision})
    assert report["meta"]["git"] == revision and report["meta"]["dirty"] is dirty
    assert report["meta"]["command"].startswith("python3 -m scripts.bench.train ")
    first = md.splitlines()[0]
    if dirty:
        assert first.startswith("**DIRTY TREE: not reproducible from a commit** (git abc1234+dirty")
    else:
        assert first.startswith("GPU: ") and first.endswith(f" · git {revision}")
        assert "DIRTY" not in md


def test_budget_stops_a_run_and_the_search(tmp_path, fake_trainer):
    start = time.monotonic()
    report, md, stdout = bench(tmp_path, *CPU_RUN, "--budget-minutes", "0.04", *fake_trainer,
                               env={"FAKE_SLEEP": "60"})
    # The first run is stopped when the 2.4 s are up; no other starts. What ran is reported.
    assert time.monotonic() - start < 30
    assert [(r["batch"], r["status"]) for r in report["runs"]] == [(2, "timeout")]
    assert report["state"].startswith("stopped: --budget-minutes 0.04")
    assert "stopped:" in stdout and "| timeout |" in md


def test_dry_run_prints_the_torchrun_command(tmp_path):
    result = subprocess.run([*SCRIPT, "--dry-run", "--nproc", "2",
                             "--losses", "unfused_compiled", "--extra=--loss.chunk_size 4096"],
                            cwd=REPO, text=True, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert argv[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    assert argv[argv.index("--loss.impl") + 1] == "unfused"
    assert argv[argv.index("--compile.components") + 1] == "model,loss"
    assert argv.index("--loss.chunk_size") < argv.index("--loss.impl")  # per-run overrides win
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, message", [
    (["--losses", "flce,fused"], "--losses fused"),
    (["--ac", "some"], "--ac some"),
    (["--steps", "10", "--warmup-steps", "10"], "no logged window starts after"),
    (["--config", "configs/nope.toml"], "no such file"),
    (["--nproc", "2", "--train-cmd", "python3 train.py"], "--train-cmd"),
])
def test_bad_arguments_are_clear_errors(args, message):
    result = subprocess.run([*SCRIPT, "--dry-run", *args], cwd=REPO,
                            text=True, capture_output=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_measured_windows_and_status():
    m = bench_train
    assert train_report.measured_steps(25, 5, 10) == [15, 20, 25]
    assert train_report.measured_steps(25, 5, 12) == [20, 25]  # 11-15 straddles the warm-up
    assert train_report.measured_steps(4, 5, 1) == [4]
    assert train_report.measured_steps(10, 5, 10) == []
    assert m.batches_from(1, 32) == [1, 2, 4, 8, 16, 32] and m.batches_from(3, 12) == [3, 6, 12]
    assert classify(1, False, "torch.OutOfMemoryError: CUDA out of memory", True) == "oom"
    assert classify(1, False, "RuntimeError: CUBLAS_STATUS_ALLOC_FAILED", False) == "oom"
    assert classify(1, False, "triton OutOfResources: shared memory", False) == "error"
    assert classify(0, False, "", False) == "error"  # nothing measured
    assert classify(0, True, "", True) == "timeout"
    assert classify(0, True, "", True, finished=True) == "ok"  # stopped in teardown
    assert classify(None, True, "", False, finished=False) == "timeout"
    assert classify(0, False, "", True) == "ok"
