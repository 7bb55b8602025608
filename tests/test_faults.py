"""Faults while checkpointing lose nothing. A run resumed from step 2 is killed with SIGKILL at a
named point of its step-4 save, synchronous or asynchronous, or of the pruning after it
(FLCE_FAULT_POINT, a test-only hook in components/checkpoint.py), or its disk fills up: a real
failing write, RLIMIT_FSIZE making writes past 1 MB fail with EFBIG. Then the same command
resumes from the latest committed checkpoint, a half-written one is never picked, what was
committed before the fault is still there unchanged, and the run ends at the loss of a run that
went straight through. A committed checkpoint damaged afterwards (bytes overwritten, a file
missing, emptied or cut short) is named and the previous one resumed."""

import filecmp
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import train
from components.checkpoint_folders import list_checkpoints
from test_checkpoint import as_before_checksums
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread)

pytestmark = pytest.mark.slow  # multi-process runs: not in the fast subset

ROOT = Path(__file__).resolve().parents[1]
# The unfused loss: the fastest on the CPU, and the loss is not under test here.
ARGS = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
        "--loss.impl", "unfused", "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--metrics.log_freq", "1", "--job.print_config", "false", "--validation.enable", "false",
        "--lr_scheduler.warmup_steps", "2", "--training.steps", "6",
        "--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "2"]


def metric_rows(dump: Path) -> list[dict]:
    """metrics.jsonl's lines of logged steps: without the line where a resume goes back to its
    checkpoint's step ({"step": N, "resumed": true}, tests/test_metrics.py checks it)."""
    rows = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if not r.get("resumed")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("straight")
    assert train.main(ARGS + ["--job.dump_folder", str(dump)]) == 0
    return dump


def _disk_of_1_mb() -> None:  # in the child, before it runs train.py
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def _disk_of_4_kb() -> None:  # full before the rank file (6.7 KB) is written
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 10, 4 << 10))


DISKS = {"disk_full": _disk_of_1_mb, "disk_full_at_rank_file": _disk_of_4_kb}


@pytest.mark.parametrize("async_mode,fault,extra,committed", [
    ("disabled", "after_rank_files@4", [], [2]),
    ("disabled", "before_commit@4", [], [2]),
    ("disabled", "after_commit@4", [], [2, 4]),
    ("disabled", "mid_prune@4", ["--checkpoint.keep_latest_k", "1"], [4]),
    ("disabled", "disk_full", [], [2]),
    ("async", "async_started@4", [], [2]),  # killed while DCP's thread writes
    ("async", "before_commit@4", [], [2]),
    ("async", "disk_full", [], [2]),
    ("async", "disk_full_at_rank_file", [], [2]),  # was a bare OSError
])
def test_a_fault_loses_nothing(tmp_path, straight, async_mode, fault, extra, committed):
    dump = tmp_path / "run"
    step_2 = dump / "checkpoint" / "step-2"
    shutil.copytree(straight / "checkpoint" / "step-2", step_2)
    run = ARGS + ["--checkpoint.async_mode", async_mode, *extra, "--job.dump_folder", str(dump)]
    env = {**os.environ, "FLCE_FAULT_POINT": fault, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *run], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, preexec_fn=DISKS.get(fault))
    if fault in DISKS:
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert f"[checkpoint] writing {dump / 'checkpoint' / 'step-4'} failed" in proc.stderr
    else:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert sorted(list_checkpoints(dump / "checkpoint")) == committed
    if 2 in committed:  # committed before the fault: still the same bytes
        names = sorted(os.listdir(straight / "checkpoint" / "step-2"))
        assert sorted(os.listdir(step_2)) == names
        assert filecmp.cmpfiles(step_2, straight / "checkpoint" / "step-2", names,
                                shallow=False)[0] == names

    logged = len(metric_rows(dump))
    assert train.main(run) == 0  # the same command, without the fault
    resumed = metric_rows(dump)[logged:]
    assert [r["step"] for r in resumed] == list(range(max(committed) + 1, 7))
    assert abs(resumed[-1]["loss"] - metric_rows(straight)[-1]["loss"]) <= 1e-6
    assert sorted(list_checkpoints(dump / "checkpoint"))[-1] == 6
    assert not list((dump / "checkpoint").glob("*.pruned"))


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_failed_async_save_stops_the_run_at_the_next_log_step(tmp_path, nproc):
    """The disk fills during step 10's async save: the run stops with the save's error within a
    few steps, not at step 20's save (training on, for an interval, without a checkpoint); with
    2 gloo processes the ranks agree on it at the same step."""
    dump = tmp_path / "run"
    run = ARGS + ["--checkpoint.async_mode", "async", "--training.steps", "30",
                  "--checkpoint.interval", "10", "--job.dump_folder", str(dump)]
    launch = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*launch, str(ROOT / "train.py"), *run], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300, preexec_fn=_disk_of_1_mb)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"[checkpoint] writing {dump / 'checkpoint' / 'step-10'} failed" in proc.stderr
    last = metric_rows(dump)[-1]["step"]
    assert 10 <= last < 20, f"stopped after step {last}"
    assert list_checkpoints(dump / "checkpoint") == {}


def _overwrite_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 256] = os.urandom(256)
    path.write_bytes(bytes(data))


DAMAGE = {  # what is done to a file of step-4, and how the warning describes it
    "overwritten": (_overwrite_middle, "does not match its checksum"),
    "missing": (Path.unlink, r"is missing \(the save wrote it\)"),
    "emptied": (lambda path: path.write_bytes(b""), "has 0 bytes"),
    "cut_short": (lambda path: path.write_bytes(path.read_bytes()[:-100]), r"has \d+ bytes, \d+ when"),
    "garbled": (lambda path: path.write_bytes(b"x" * path.stat().st_size),
                "does not match its checksum"),
}


@pytest.mark.parametrize("file,damage", [
    ("__0_0.distcp", "overwritten"),  # 256 bytes of the weights: resumed into NaN losses before
    ("rank-0.pt", "missing"),  # the data restarted from its beginning (a warning, no fallback)
    ("__0_0.distcp", "emptied"),
    (".metadata", "cut_short"),
    ("train_state.json", "garbled"),
])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_resumed(tmp_path, straight, file,
                                                                    damage):
    dump = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(straight / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    harm, described = DAMAGE[damage]
    harm(dump / "checkpoint" / "step-4" / file)
    with pytest.warns(UserWarning, match=rf"not resuming from {dump}/checkpoint/step-4: "
                                         rf"{dump}/checkpoint/step-4/{re.escape(file)} {described}"
                                         r".*; falling back to step-2"):
        assert train.main(ARGS + ["--job.dump_folder", str(dump)]) == 0
    resumed = metric_rows(dump)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    assert abs(resumed[-1]["loss"] - metric_rows(straight)[-1]["loss"]) <= 1e-6
    aside = [p for p in (dump / "checkpoint").iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and (aside[0] / "step-4").is_dir()  # set aside, not deleted


@pytest.mark.parametrize("file,damage,named", [
    ("__0_0.distcp", "emptied", r"__0_0\.distcp missing or shorter than its metadata says"),
    (".metadata", "cut_short", r"\.metadata is damaged \(UnpicklingError"),
    ("train_state.json", "garbled", r"train_state\.json is damaged \(JSONDecodeError"),
    ("rank-0.pt", "garbled", r"rank-0\.pt is damaged"),
])
def test_a_damaged_file_of_a_checkpoint_without_checksums_is_named(tmp_path, straight, file, damage,
                                                                   named):
    """A checkpoint saved before checksums.json existed: the damaged file is named, with the way
    out, instead of a bare EOFError or JSONDecodeError."""
    dump = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(straight / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
        as_before_checksums(dump / "checkpoint" / f"step-{step}")
    DAMAGE[damage][0](dump / "checkpoint" / "step-4" / file)
    with pytest.raises(ValueError, match=rf"{dump}/checkpoint/step-4.*{named}.*Resume from an "
                                         r"earlier checkpoint: \[checkpoint\] load_step = one of "
                                         r"\[2\]$"):
        train.main(ARGS + ["--job.dump_folder", str(dump)])


def test_an_unreadable_config_toml_in_a_checkpoint_is_a_warning(tmp_path, straight, capsys):
    """The checkpoint's config.toml only lists the config changes since it: unreadable, the run
    says so and resumes (it crashed after 'resumed from')."""
    dump = tmp_path / "run"
    shutil.copytree(straight / "checkpoint" / "step-4", dump / "checkpoint" / "step-4")
    (dump / "checkpoint" / "step-4" / "config.toml").write_bytes(b"[training\n\xff")
    assert train.main(ARGS + ["--job.dump_folder", str(dump)]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {dump}/checkpoint/step-4" in out
    assert f"warning: {dump}/checkpoint/step-4/config.toml cannot be read (" in out
    assert [r["step"] for r in metric_rows(dump)] == [5, 6]


def test_a_validation_step_cut_short_is_validated_on_resume(tmp_path):
    """Step 4 is saved, then validated: killed in between (or stopped by a signal, which ends the
    run right after the save), the resumed run started at step 5 and step 4's validation was
    never run. It runs first now, and gives what a straight run logs there."""
    valid = ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"]
    straight, dump = tmp_path / "straight", tmp_path / "run"
    assert train.main(ARGS + valid + ["--job.dump_folder", str(straight)]) == 0
    run = ARGS + valid + ["--job.dump_folder", str(dump)]
    env = {**os.environ, "FLCE_FAULT_POINT": "after_commit@4", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *run], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert 4 not in {r["step"] for r in metric_rows(dump) if "val_loss" in r}
    assert train.main(run) == 0
    val = {r["step"]: r["val_loss"] for r in metric_rows(dump) if "val_loss" in r}
    want = {r["step"]: r["val_loss"] for r in metric_rows(straight) if "val_loss" in r}
    assert sorted(val) == sorted(want) == [2, 4, 6]
    assert all(abs(val[s] - want[s]) <= 1e-6 for s in want)
    assert train.main(run) == 0  # nothing left: step 6 validated already, not again
    assert [r["step"] for r in metric_rows(dump) if "val_loss" in r].count(6) == 1
