"""Checkpointing: exact resume, atomic saves (kill -9), preemption by signal, resharding from 2
processes to 1, keep_latest_k, rollback with load_step, async saves committed once written,
initial weights, rank files loaded as plain data only, and clear errors for bad checkpoints.
tests/test_faults.py kills saves at precise points."""

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import forked_ranks
import train
from components.checkpoint_folders import list_checkpoints
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread)

ROOT = Path(__file__).resolve().parents[1]
# The loss is not under test here: the unfused one is the fastest on the CPU, where the fused
# kernels run in Triton's interpreter.
BASE = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
        "--loss.impl", "unfused", "--training.seq_len", "64",
        "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--job.print_config",
        "false", "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2",
        "--checkpoint.enable_checkpoint", "true"]


def losses(dump: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_exact_resume(tmp_path):
    """20 steps straight == 10 steps, then a new process resuming from step 10 to 20."""
    straight = tmp_path / "straight"
    assert train.main(BASE + ["--training.steps", "20", "--checkpoint.interval", "10",
                              "--job.dump_folder", str(straight)]) == 0
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight / "checkpoint" / "step-10", resumed / "checkpoint" / "step-10")
    assert train.main(BASE + ["--training.steps", "20", "--checkpoint.interval", "10",
                              "--job.dump_folder", str(resumed)]) == 0
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == list(range(11, 21))
    assert max(abs(a[s] - b[s]) for s in b) <= 1e-6


def test_resuming_under_another_val_every_or_tokenizer(tmp_path, monkeypatch, capsys):
    """A text source's saved position means nothing under another [data] val_every: the run
    resumes the model and reads from the start, saying so (it failed at the first step with a
    traceback from the data thread). Another tokenizer is refused before anything is built (it
    failed the same way; its ids would mean other tokens)."""
    import random

    from shard_cases import train_tokenizer
    dump = tmp_path / "run"
    assert train.main(BASE + ["--training.steps", "2", "--checkpoint.interval", "2",
                              "--job.dump_folder", str(dump)]) == 0
    with pytest.warns(UserWarning, match=r"data iterator not restored \(data state was saved "
                                         r"reading other documents \(\[data\] val_every 100 -> 7\)"):
        assert train.main(BASE + ["--training.steps", "3", "--checkpoint.interval", "2",
                                  "--data.val_every", "7", "--job.dump_folder", str(dump)]) == 0
    assert sorted(losses(dump)) == [1, 2, 3]

    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", random.Random(0))
    argv = BASE + ["--training.steps", "4", "--tokenizer.name", "hf", "--tokenizer.path",
                   str(tmp_path / "tokenizer.json"), "--job.dump_folder", str(dump)]
    assert tokenizer.vocab_size <= 512  # the debug model's embeddings fit it: only the check refuses
    with pytest.raises(ValueError, match=r"\[tokenizer\] is not the tokenizer .*step-3 was "
                                         r"trained with \(vocab_size 259"):
        train.main(argv)
    monkeypatch.setattr("sys.argv", ["train.py", *argv])
    capsys.readouterr()
    assert train.command_line() == 2
    assert capsys.readouterr().err.startswith("config error: [tokenizer] is not the tokenizer")


def test_a_missing_rank_file_without_checksums_is_named(tmp_path):
    """A checkpoint from before checksums.json, its rank-0.pt gone: the data restarts, saying
    the file is missing (the warning said "the world size grew", at the same world size)."""
    dump = tmp_path / "run"
    assert train.main(BASE + ["--training.steps", "2", "--checkpoint.interval", "2",
                              "--job.dump_folder", str(dump)]) == 0
    (dump / "checkpoint" / "step-2" / "rank-0.pt").unlink()
    as_before_checksums(dump / "checkpoint" / "step-2")
    with pytest.warns(UserWarning, match=r"data iterator not restored \(no data state for this "
                                         r"rank: rank-0.pt is not in the checkpoint \(0 rank "
                                         r"files; 1 ranks now\)\)"):
        assert train.main(BASE + ["--training.steps", "3", "--job.dump_folder", str(dump)]) == 0


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_each_save_is_logged_when_committed(tmp_path, capsys, mode):
    dump = tmp_path / mode
    assert train.main(BASE + ["--training.steps", "4", "--checkpoint.interval", "2",
                              "--checkpoint.async_mode", mode, "--job.dump_folder", str(dump)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "saved to" in line]
    waited = r" \(in the background; training waited \d+\.\d s\)" if mode == "async" else ""
    assert len(lines) == 2, lines
    for step, line in zip((2, 4), lines):
        assert re.fullmatch(rf"checkpoint: step {step} saved to {dump}/checkpoint/step-{step} in "
                            rf"\d+\.\d s{waited}", line), line


def test_keep_latest_k_and_load_step_errors(tmp_path):
    dump = tmp_path / "run"
    assert train.main(BASE + ["--training.steps", "9", "--checkpoint.interval", "2",
                              "--checkpoint.keep_latest_k", "2", "--job.dump_folder", str(dump)]) == 0
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-8", "step-9"]
    with pytest.raises(FileNotFoundError, match=r"load_step = 4: no complete checkpoint"):
        train.main(BASE + ["--training.steps", "12", "--checkpoint.load_step", "4",
                           "--job.dump_folder", str(dump)])


def test_model_shape_mismatch_is_named(tmp_path):
    dump = tmp_path / "run"
    assert train.main(BASE + ["--training.steps", "3", "--job.dump_folder", str(dump)]) == 0
    with pytest.raises(ValueError, match=r"tok_embeddings.weight has shape \(512, 128\) but the "
                                         r"model built from this config has \(1024, 128\)"):
        train.main(BASE + ["--training.steps", "4", "--model.vocab_size", "1024",
                           "--job.dump_folder", str(dump)])


def test_incomplete_folder_is_skipped_with_a_warning(tmp_path):
    dump = tmp_path / "run"
    assert train.main(BASE + ["--training.steps", "4", "--checkpoint.interval", "2",
                              "--job.dump_folder", str(dump)]) == 0
    (dump / "checkpoint" / "step-4" / ".metadata").unlink()  # as if killed mid-write
    (dump / "checkpoint" / "step-6.tmp").mkdir()
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint folder"):
        assert train.main(BASE + ["--training.steps", "5", "--job.dump_folder", str(dump)]) == 0
    steps = [json.loads(x)["step"] for x in (dump / "metrics.jsonl").read_text().splitlines()]
    # the second run resumed from step 2, which its first line marks ({"resumed": true})
    assert steps == [1, 2, 3, 4, 2, 3, 4, 5]


def test_the_checkpoint_to_resume_is_looked_for_once(tmp_path):
    """The resume point is found before the model is built and used by the load (the folder was
    listed twice, and each incomplete folder named twice)."""
    import warnings
    dump = tmp_path / "run"
    assert train.main(BASE + ["--training.steps", "2", "--checkpoint.interval", "2",
                              "--job.dump_folder", str(dump)]) == 0
    (dump / "checkpoint" / "step-6.tmp").mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # resumed after its last step: nothing saved, nor pruned
        assert train.main(BASE + ["--training.steps", "2", "--job.dump_folder", str(dump)]) == 0
    named = [w for w in caught if "skipping incomplete checkpoint folder" in str(w.message)]
    assert len(named) == 2, [str(w.message) for w in named]  # the resume point, the summary


def test_initial_load_path_loads_weights_only(tmp_path):
    trained = tmp_path / "trained"
    assert train.main(BASE + ["--training.steps", "30", "--checkpoint.interval", "30",
                              "--optimizer.lr", "1e-2", "--job.dump_folder", str(trained)]) == 0
    fresh = tmp_path / "fresh"
    assert train.main(BASE + ["--training.steps", "1", "--lr_scheduler.warmup_steps", "0",
                              "--checkpoint.enable_checkpoint", "false",
                              "--job.dump_folder", str(fresh)]) == 0
    warm = tmp_path / "warm"
    assert train.main(BASE + ["--training.steps", "1", "--lr_scheduler.warmup_steps", "0",
                              "--checkpoint.enable_checkpoint", "false",
                              "--checkpoint.initial_load_path", str(trained / "checkpoint/step-30"),
                              "--job.dump_folder", str(warm)]) == 0
    assert losses(warm)[1] < losses(fresh)[1] - 1.0
    # the run's checkpoint folder, as generate/evaluate/export_hf take it: its latest step (it
    # was "neither a DCP checkpoint folder nor a Hugging Face model folder")
    parent = tmp_path / "parent"
    assert train.main(BASE + ["--training.steps", "1", "--lr_scheduler.warmup_steps", "0",
                              "--checkpoint.enable_checkpoint", "false",
                              "--checkpoint.initial_load_path", str(trained / "checkpoint"),
                              "--job.dump_folder", str(parent)]) == 0
    assert losses(parent) == pytest.approx(losses(warm), abs=1e-6)
    # enable = false in a dump folder that holds an earlier run's step-30: that run's checkpoint
    # is not resumed (this run saves nothing), the weights come from initial_load_path.
    assert train.main(BASE + ["--training.steps", "1", "--lr_scheduler.warmup_steps", "0",
                              "--checkpoint.enable", "false",
                              "--checkpoint.initial_load_path", str(trained / "checkpoint/step-30"),
                              "--job.dump_folder", str(trained)]) == 0
    assert losses(trained) == pytest.approx(losses(warm), abs=1e-6)


def _spawn(dump: Path, *extra) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *BASE, "--job.dump_folder",
                             str(dump), *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_step(dump: Path, step: int, proc: subprocess.Popen, timeout=120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = dump / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early:\n{proc.stdout.read()}")
        time.sleep(0.1)
    raise AssertionError("trainer too slow")


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun starts its trainers in sessions of their
    own, so killing its process group would not reach them)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        if ppid == pid:
            found.append(int(stat.parent.name))
    return found


def _wait_until_ended(pids: list[int], timeout: float = 60) -> None:
    """Until each process has exited (gone, or a zombie nobody reaps): a process killed while
    the kernel writes its files for it (fsync on a busy disk) exits, and lets go of its dump
    folder lock, only once the write is done. Resuming before then finds the folder in use."""
    deadline = time.time() + timeout
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        while time.time() < deadline:
            try:
                if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except (OSError, IndexError):
                break  # gone
            time.sleep(0.05)
        else:
            raise AssertionError(f"process {pid} still runs {timeout} s after SIGKILL")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_saves_and_resumes(tmp_path, sig):
    dump = tmp_path / "run"
    proc = _spawn(dump, "--training.steps", "100000", "--checkpoint.interval", "100000")
    _wait_for_step(dump, 5, proc)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    saved = [p.name for p in (dump / "checkpoint").iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step-"), saved
    stopped_at = int(saved[0].split("-")[1])
    assert f"received {sig.name}: stopped after step {stopped_at}" in out
    assert max(losses(dump)) == stopped_at
    code = train.main(BASE + ["--training.steps", str(stopped_at + 2), "--job.dump_folder",
                              str(dump)])
    assert code == 0 and max(losses(dump)) == stopped_at + 2


def _catches(pid: int, sig: signal.Signals) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt")).split()[1], 16)
    return bool(caught >> (sig - 1) & 1)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_during_the_imports_is_kept(tmp_path, sig):
    """SLURM's warning (or a requeue's SIGTERM) may come while the trainer is still importing
    torch (seconds): it stops after the first step with a checkpoint and exit 0, so a requeued
    job resumes, instead of dying with -15 (under torchrun: a ChildFailedError)."""
    dump = tmp_path / "run"
    proc = _spawn(dump, "--training.steps", "100000", "--checkpoint.interval", "100000")
    started = time.time()
    # train.py catches the signal from its first lines on; the old one only after its imports
    # (about 3 s here): 1 s in, it was importing
    while not _catches(proc.pid, sig) and time.time() < started + 1:
        time.sleep(0.005)
    assert not (dump / "metrics.jsonl").exists()  # the loop has not begun
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert f"received {sig.name}: stopped after step 1, checkpoint in {dump}/checkpoint/step-1" in out
    assert sorted(list_checkpoints(dump / "checkpoint")) == [1]


@pytest.mark.slow
def test_kill_9_during_saves_leaves_loadable_checkpoints(tmp_path):
    dump = tmp_path / "run"
    proc = _spawn(dump, "--training.steps", "100000", "--checkpoint.interval", "1",
                  "--checkpoint.keep_latest_k", "3")
    _wait_for_step(dump, 8, proc)
    proc.kill()  # SIGKILL, most likely mid-save: a save happens every step
    proc.communicate(timeout=60)
    done = sorted(list_checkpoints(dump / "checkpoint"))
    assert done, "no complete checkpoint"
    code = train.main(BASE + ["--training.steps", str(done[-1] + 1), "--job.dump_folder", str(dump)])
    assert code == 0 and max(losses(dump)) == done[-1] + 1


@pytest.mark.slow
def test_two_processes_save_one_process_resumes(tmp_path):
    """Saved by 2 gloo processes (FSDP, async save), loaded by one: the same losses after."""
    synthetic = ["--data.synthetic", "true", "--training.steps", "6", "--checkpoint.interval", "3"]
    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the ranks forked from a process that imported torch already (tests/forked_ranks.py)
    forked_ranks.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "2", str(ROOT / "train.py"), *BASE, *synthetic,
                      "--training.local_batch_size", "2", "--checkpoint.async_mode", "async",
                      "--job.dump_folder", str(two)], check=True, cwd=ROOT, env=env, timeout=180)
    one = tmp_path / "one"
    (one / "checkpoint").mkdir(parents=True)
    shutil.copytree(two / "checkpoint" / "step-3", one / "checkpoint" / "step-3")
    assert train.main(BASE + synthetic + ["--job.dump_folder", str(one)]) == 0
    a, b = losses(two), losses(one)
    assert sorted(b) == [4, 5, 6]
    assert max(abs(a[s] - b[s]) for s in b) <= 1e-5


class _TouchesAFile:
    """A pickle that creates `path` when it is unpickled: it stands for any code a planted
    checkpoint file could run."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_a_planted_pickle_in_a_rank_file_is_not_run(tmp_path):
    dump = tmp_path / "run"
    assert train.main(BASE + ["--training.steps", "4", "--checkpoint.interval", "2",
                              "--job.dump_folder", str(dump)]) == 0
    rank_file = dump / "checkpoint" / "step-4" / "rank-0.pt"
    genuine = torch.load(rank_file, weights_only=True)  # what the trainer writes is plain data
    assert genuine["rng"].dtype == torch.uint8 and all(
        isinstance(v, (int, dict)) for v in genuine["data"].values())
    marker = tmp_path / "code-ran"
    torch.save({**genuine, "data": _TouchesAFile(marker)}, rank_file)
    _rewrite_manifest(rank_file.parent)  # as a planter would
    with pytest.raises(ValueError, match=r"rank-0.pt holds objects other than tensors and plain "
                                         r"data; not loading it"):
        train.main(BASE + ["--training.steps", "6", "--job.dump_folder", str(dump)])
    assert not marker.exists()
    torch.save(genuine, rank_file)  # the genuine file resumes
    _rewrite_manifest(rank_file.parent)
    assert train.main(BASE + ["--training.steps", "6", "--job.dump_folder", str(dump)]) == 0
    assert max(losses(dump)) == 6


def test_a_planted_pickle_in_dcp_files_is_not_run(tmp_path):
    """DCP pickles its .metadata and a state dict's non-tensor entries (the optimizer's
    param_groups): planted ones are refused, by the trainer and by the scripts' reader, before
    they run anything; the genuine files still load."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from scripts.lib.checkpoints import load_model_state

    dump = tmp_path / "run"
    assert train.main(BASE + ["--training.steps", "4", "--checkpoint.interval", "2",
                              "--job.dump_folder", str(dump)]) == 0
    step = dump / "checkpoint" / "step-4"
    marker = tmp_path / "code-ran"
    resume = BASE + ["--training.steps", "6", "--job.dump_folder", str(dump)]

    genuine = (step / ".metadata").read_bytes()
    (step / ".metadata").write_bytes(pickle.dumps(_TouchesAFile(marker)))
    _rewrite_manifest(step)  # as a planter would: the checksums are against damage, not intent
    refused = r"\.metadata names pathlib\.Path\.touch, which is not one of DCP's metadata classes"
    with pytest.raises(ValueError, match=refused):
        train.main(resume)
    with pytest.raises(ValueError, match=refused):
        load_model_state(step)
    assert not marker.exists()
    (step / ".metadata").write_bytes(genuine)
    _rewrite_manifest(step)

    full = tmp_path / "full.pt"
    dcp_to_torch_save(step, full)
    state = torch.load(full, weights_only=False)  # the test's own file
    saved_files = {p.name: p.read_bytes() for p in step.iterdir() if p.name.endswith(".distcp")}
    state["optimizer"]["param_groups"][0]["weight_decay"] = _TouchesAFile(marker)
    for name in saved_files:
        (step / name).unlink()
    torch.distributed.checkpoint.save(state, checkpoint_id=str(step), no_dist=True)
    _rewrite_manifest(step)
    with pytest.raises(ValueError, match=r"entry optimizer\.param_groups\.0\.weight_decay of the "
                                         r"checkpoint holds objects other than plain data"):
        train.main(resume)
    assert not marker.exists()
    assert set(load_model_state(step)) and not marker.exists()  # reads the model's tensors only
    for name, data in saved_files.items():
        (step / name).write_bytes(data)
    (step / ".metadata").write_bytes(genuine)
    _rewrite_manifest(step)
    assert train.main(resume) == 0 and max(losses(dump)) == 6


def as_before_checksums(step: Path) -> None:
    """A step folder as saved before checksums.json existed: without it, and without the
    tokenizer record that came with it (a current save without checksums.json is damaged)."""
    (step / "checksums.json").unlink()
    state = json.loads((step / "train_state.json").read_text())
    del state["tokenizer"]
    (step / "train_state.json").write_text(json.dumps(state))


def _rewrite_manifest(step: Path) -> None:
    """The checksums of the files now in `step`, as someone planting files would write them."""
    from components.checkpoint_manifest import write_manifest

    write_manifest(step)


@pytest.mark.slow
def test_rollback_sets_later_checkpoints_aside_and_keeps_what_it_writes(tmp_path):
    """Resuming from step 3 of a run that went to 12, with keep_latest_k = 2: steps 6-12 belong
    to another timeline. They are moved aside (not pruned in place of the new step 5, not picked
    by the next resume), and the checkpoint this run writes is kept."""
    dump = tmp_path / "run"
    every_3 = ["--checkpoint.interval", "3", "--job.dump_folder", str(dump)]
    assert train.main(BASE + ["--training.steps", "12", *every_3]) == 0
    with pytest.warns(UserWarning, match=r"continues from step 3: moved the later checkpoint "
                                         r"folders step-6, step-9, step-12 \(another timeline\)"):
        assert train.main(BASE + ["--training.steps", "5", "--checkpoint.load_step", "3",
                                  "--checkpoint.keep_latest_k", "2", *every_3]) == 0
    folder = dump / "checkpoint"
    assert sorted(list_checkpoints(folder)) == [3, 5]
    aside = [p for p in folder.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and sorted(list_checkpoints(aside[0])) == [6, 9, 12]
    # The next plain resume continues this timeline, from step 5.
    assert train.main(BASE + ["--training.steps", "7", *every_3]) == 0
    steps = [json.loads(x)["step"] for x in (dump / "metrics.jsonl").read_text().splitlines()]
    assert steps[-3:] == [5, 6, 7]


def test_a_kept_load_step_resumes_from_the_latest_once_passed(tmp_path, capsys):
    """A requeued job keeps its command line: with --checkpoint.load_step 2 kept, the second run
    resumes where the first (which went back to step 2) stopped, saying so, instead of going
    back to step 2 again (and setting its checkpoints aside) for ever."""
    dump = tmp_path / "run"
    every_2 = ["--checkpoint.interval", "2", "--job.dump_folder", str(dump)]
    assert train.main(BASE + ["--training.steps", "6", *every_2]) == 0
    rollback = BASE + ["--training.steps", "5", "--checkpoint.load_step", "2", *every_2]
    with pytest.warns(UserWarning, match="continues from step 2: moved the later checkpoint"):
        assert train.main(rollback) == 0  # saves step-4 and step-5 of the new timeline
    capsys.readouterr()
    assert train.main(rollback) == 0  # the same command, requeued
    out = capsys.readouterr().out
    assert ("[checkpoint] load_step = 2 was passed: a run with this load_step went on from step 2 "
            "to step 5") in out and f"resumed from {dump}/checkpoint/step-5" in out, out
    steps = [json.loads(x)["step"] for x in (dump / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 2, 3, 4, 5]  # nothing trained twice; 2: the rollback's mark
    assert sorted(list_checkpoints(dump / "checkpoint")) == [2, 4, 5]
    assert len([p for p in (dump / "checkpoint").iterdir() if p.name.startswith("superseded-")]) == 1


@pytest.mark.slow
def test_an_async_save_is_committed_once_written(tmp_path):
    """2 gloo processes with async saves every 32 steps, killed with SIGKILL a few steps after
    step 32's save was written (before step 64's): step-32 is committed under its final name,
    and resuming from it ends at the loss of an uninterrupted run. The background write races
    the training, so the saves are far apart: with 16 steps between them the test failed once
    in two runs of the GPU suite (16 workers on one H200 host), where a probe under that load
    saw the commit 0.5-0.7 s after the save's step was logged; 32 leave 27 steps for it."""
    interval, steps = 32, 72
    synthetic = ["--data.synthetic", "true", "--training.steps", str(steps),
                 "--checkpoint.interval", str(interval)]
    dump = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", "2", str(ROOT / "train.py"), *BASE, *synthetic,
                             "--training.local_batch_size", "2", "--checkpoint.async_mode",
                             "async", "--job.dump_folder", str(dump)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    committed = dump / "checkpoint" / f"step-{interval}"
    try:
        _wait_for_step(dump, interval, proc, timeout=180)
        deadline = time.time() + 60
        while (not committed.is_dir() and time.time() < deadline
               and max(losses(dump)) < 2 * interval - 5):
            time.sleep(0.02)
        _wait_for_step(dump, max(losses(dump)) + 2, proc)  # some steps after the commit
    finally:
        killed = _children(proc.pid) + [proc.pid]  # both trainers, then torchrun
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        _wait_until_ended(killed)
    killed_at = max(losses(dump))
    assert killed_at < 2 * interval, "the run reached its next save before the test killed it"
    assert sorted(list_checkpoints(dump / "checkpoint")) == [interval], \
        f"step-{interval} not committed by step {killed_at}: " \
        f"{sorted(os.listdir(dump / 'checkpoint'))}"
    # One process resumes (synthetic windows are indexed globally) and ends where one process
    # running straight through ends.
    assert train.main(BASE + synthetic + ["--job.dump_folder", str(dump)]) == 0
    straight = tmp_path / "straight"
    assert train.main(BASE + synthetic + ["--checkpoint.enable_checkpoint", "false",
                                          "--job.dump_folder", str(straight)]) == 0
    assert abs(losses(dump)[steps] - losses(straight)[steps]) <= 1e-5


def test_ctrl_c_inside_a_save_aborts_instead_of_reporting_a_failed_write(tmp_path, monkeypatch):
    """A second Ctrl-C while torch.save writes surfaces as the zip writer's RuntimeError
    ("unexpected pos"), the KeyboardInterrupt only in its context: that is the user's abort,
    not a failed disk. A real failed write still names the folder and the free space."""
    import components.checkpoint as checkpoint

    def interrupted(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    def failed(*args, **kwargs):
        raise RuntimeError("unexpected pos 704 vs 598")

    run = BASE + ["--training.steps", "3", "--checkpoint.interval", "2"]
    with monkeypatch.context() as patch:  # inside DCP's writer: DCP wraps it per rank
        patch.setattr(torch.distributed.checkpoint.filesystem, "_write_item", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train.main(run + ["--job.dump_folder", str(tmp_path / "dcp")])
    monkeypatch.setattr(checkpoint.dcp, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.main(run + ["--job.dump_folder", str(tmp_path / "a")])
    monkeypatch.setattr(checkpoint.dcp, "save", failed)
    with pytest.raises(RuntimeError, match=r"\[checkpoint\] writing .*step-2 failed .*GiB free"):
        train.main(run + ["--job.dump_folder", str(tmp_path / "b")])
    assert not list_checkpoints(tmp_path / "a" / "checkpoint")
    assert not list_checkpoints(tmp_path / "dcp" / "checkpoint")


def test_one_process_saves_and_loads_without_dcps_single_process_warning(tmp_path, recwarn):
    """DCP warned "torch.distributed is disabled ..." on every save and load of a one-process
    run, which means to run in one process. (An async save warns from DCP's writer thread,
    which no filter of the trainer's calls reaches: docs/checkpoints.md explains it.)"""
    dump = tmp_path / "run"
    args = BASE + ["--checkpoint.interval", "1", "--job.dump_folder", str(dump)]
    assert train.main(args + ["--training.steps", "2"]) == 0
    assert train.main(args + ["--training.steps", "3"]) == 0  # resumes: a full load
    assert train.main(BASE + ["--training.steps", "1", "--checkpoint.enable", "false",
                              "--checkpoint.initial_load_path", str(dump / "checkpoint/step-3"),
                              "--job.dump_folder", str(tmp_path / "weights")]) == 0
    assert sorted(list_checkpoints(dump / "checkpoint")) == [1, 2, 3]
    noise = [str(w.message) for w in recwarn if "torch.distributed is disabled" in str(w.message)]
    assert not noise, noise


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_cpu_run_on_a_cuda_host_saves_without_touching_cuda(tmp_path, monkeypatch, mode):
    """DCP's writer made a CUDA stream wherever CUDA is present, for CPU tensors too: a CPU run
    on a GPU host put a CUDA context on GPU 0 in every rank at each save, and failed when that
    GPU was full (8 gloo ranks beside other GPU work). Here CUDA 'is present' and any use of it
    raises."""
    def no_cuda(*args, **kwargs):
        raise RuntimeError("CUDA touched by a CPU run's save")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "Stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    dump = tmp_path / "run"
    args = BASE + ["--checkpoint.interval", "1", "--checkpoint.async_mode", mode,
                   "--job.dump_folder", str(dump)]
    assert train.main(args + ["--training.steps", "2"]) == 0
    assert train.main(args + ["--training.steps", "3"]) == 0  # and resumes
    assert sorted(list_checkpoints(dump / "checkpoint")) == [1, 2, 3]
