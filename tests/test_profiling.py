"""[profiling] traces: named and scheduled by the training step, also after a resume, and the
profiling folders checked when the config is read."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from components.config.schema import ConfigError, Profiling
from components.profiling import maybe_profile

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
        "--loss.impl", "unfused", "--training.seq_len", "64",
        "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--job.print_config",
        "false", "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2"]


def traced_steps(folder: Path) -> dict[int, list[str]]:
    """{step: the ProfilerStep#<n> marks in its trace} for each step-<N>/rank-0.json."""
    steps = {}
    for trace in folder.glob("step-*/rank-0.json"):
        events = json.loads(trace.read_text())["traceEvents"]
        steps[int(trace.parent.name[5:])] = sorted(
            {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    return steps


def run_steps(folder: Path, first: int, last: int, freq: int) -> None:
    """The training loop's calls, from `first` (a resumed run's) to `last`, with a matmul a
    step."""
    x = torch.randn(64, 64)
    with maybe_profile(Profiling(enable_profiling=True, profile_freq=freq), folder, 0,
                       torch.device("cpu"), print, first_step=first) as profilers:
        for step in range(first, last + 1):
            x = (x @ x).tanh()
            profilers.step(step)


@pytest.mark.parametrize("freq", [1, 2, 3, 5])
def test_traces_are_of_the_multiples_of_profile_freq_from_any_first_step(tmp_path, freq):
    """A process starting at step 1 + k (a resume) traced its (profile_freq)-th, 2 x ... steps
    counted from its own first, and named them so: step-3 for the 7th step of the run resumed
    at step 5 with profile_freq 3."""
    for first in range(1, freq + 3):
        folder = tmp_path / f"from-{first}"
        run_steps(folder, first, first + 2 * freq, freq)
        expected = [s for s in range(first, first + 2 * freq + 1) if s % freq == 0]
        traces = traced_steps(folder / "profile_traces")
        assert sorted(traces) == expected, first
        for step in expected:  # the trace holds that step and no other
            assert traces[step] == [f"ProfilerStep#{step}"], (first, step)


@pytest.mark.parametrize("freq,first_steps,steps", [(3, 4, 10), (5, 4, 7), (1, 2, 4)])
def test_a_resumed_run_names_its_traces_by_the_training_step(tmp_path, freq, first_steps, steps):
    """The run resumed at step 5 with profile_freq 3 traced steps 7 and 10 and wrote them as
    step-3 and step-6, over the first run's step-3."""
    dump = tmp_path / "run"
    argv = BASE + ["--job.dump_folder", str(dump), "--checkpoint.enable", "true",
                   "--checkpoint.interval", str(first_steps), "--profiling.enable_profiling",
                   "true", "--profiling.profile_freq", str(freq)]
    assert train.main(argv + ["--training.steps", str(first_steps)]) == 0
    folder = dump / "profile_traces"
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.glob("step-*/*")}
    assert sorted(traced_steps(folder)) == list(range(freq, first_steps + 1, freq))
    assert (dump / "checkpoint" / f"step-{first_steps}").is_dir()  # where the next resumes
    assert train.main(argv + ["--training.steps", str(steps)]) == 0
    traces = traced_steps(folder)
    assert sorted(traces) == list(range(freq, steps + 1, freq))
    for step, marks in traces.items():
        assert marks == [f"ProfilerStep#{step}"], step
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in before} == before


def test_a_trace_that_cannot_be_written_is_an_error_not_a_crash(tmp_path):
    """Raised inside torch.profiler's step, the error left the profiler half-stopped, and its
    exit killed the process: exit status 139 and no message."""
    code = f"""
import torch
from pathlib import Path
from components.config.schema import Profiling
from components.profiling import maybe_profile
dump = Path({str(tmp_path)!r})
(dump / "blocked").write_text("a file")
try:
    with maybe_profile(Profiling(enable_profiling=True, profile_freq=2,
                                 save_traces_folder="blocked"), dump, 0, torch.device("cpu"),
                       print) as profilers:
        for step in range(1, 5):
            torch.randn(8, 8) @ torch.randn(8, 8)
            profilers.step(step)
except OSError as e:
    print("raised", type(e).__name__, e.filename)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"raised NotADirectoryError {tmp_path / 'blocked' / 'step-2'}" in result.stdout


def refused(dump: Path, key: str, value: str) -> str:
    from components.config.parse import load_config
    with pytest.raises(ConfigError) as error:
        load_config([*BASE, "--job.dump_folder", str(dump), f"--profiling.{key}={value}"])
    return str(error.value)


@pytest.mark.parametrize("key", ["save_traces_folder", "save_memory_snapshot_folder"])
def test_a_profiling_folder_that_cannot_be_made_is_refused_at_startup(tmp_path, key):
    """/proc/nope or metrics.jsonl segfaulted the run at its first profiled step (exit status
    139, no message); "" wrote step-<N>/ among the dump folder's own files."""
    fresh = tmp_path / "fresh"
    default = getattr(Profiling, key)
    for value in ("/proc/nope", str(tmp_path / "elsewhere"), "", ".", "../x", "a/../.."):
        assert refused(fresh, key, value) == (
            f"[profiling] {key} = {value!r}: must name a folder inside the dump folder, as a "
            f"relative path (the default: {default!r})")
    for value in ("metrics.jsonl", "config.toml/traces", "run.lock"):  # the run writes them
        assert refused(fresh, key, value) == (
            f"[profiling] {key} = {value!r}: {fresh / value.split('/')[0]} is the run's own "
            "file, not a folder: name another folder")
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    assert refused(used, key, "notes.txt/x") == (
        f"[profiling] {key} = 'notes.txt/x': {used / 'notes.txt'} is a file, not a folder: "
        "name another folder")
    # train.py's command line: one line, exit status 2, before anything is written (a
    # subprocess: the run this refuses crashed the process)
    result = subprocess.run([sys.executable, "train.py", *BASE, "--job.dump_folder", str(fresh),
                             "--training.steps", "4", "--profiling.enable_profiling", "true",
                             "--profiling.profile_freq", "2", f"--profiling.{key}=/proc/nope"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stderr) == (2, (
        f"config error: [profiling] {key} = '/proc/nope': must name a folder inside the dump "
        f"folder, as a relative path (the default: {default!r})\n"))
    assert not fresh.exists()


@pytest.mark.parametrize("key", ["save_traces_folder", "save_memory_snapshot_folder"])
def test_a_profiling_folder_in_tensorboards_folder_is_refused(tmp_path, key):
    """tb/plugins/profile (where TensorBoard's profile plugin looks) was accepted: a later fresh
    run in the folder set tb/ aside, then failed to find the traces' folder in it (a
    FileNotFoundError traceback) after moving the earlier run's metrics, config and tb/."""
    fresh = tmp_path / "fresh"
    for value in ("tb", "tb/plugins/profile"):
        assert refused(fresh, key, value) == (
            f"[profiling] {key} = {value!r}: {fresh / 'tb'} is TensorBoard's folder, which a "
            "fresh run sets aside whole: name another folder")


def test_profiling_folders_inside_the_dump_folder_are_accepted(tmp_path):
    from components.config.parse import load_config
    (tmp_path / "linked").symlink_to(tmp_path, target_is_directory=True)
    cfg = load_config([*BASE, "--job.dump_folder", str(tmp_path),
                       "--profiling.save_traces_folder", "./runs/a/../traces",
                       "--profiling.save_memory_snapshot_folder", "linked/memory"])
    assert cfg.profiling.save_traces_folder == "./runs/a/../traces"


@pytest.mark.parametrize("traces, snapshots, checkpoint, error", [
    # the run died at its first save
    ("checkpoint", "memory_snapshot", "checkpoint",
     "[profiling] save_traces_folder is [checkpoint] folder ({dump}/checkpoint)"),
    ("traces", "./ckpt/../ckpt", "ckpt",
     "[profiling] save_memory_snapshot_folder is [checkpoint] folder ({dump}/ckpt)"),
    ("prof", "prof", "checkpoint",
     "[profiling] save_traces_folder is [profiling] save_memory_snapshot_folder ({dump}/prof)"),
    # a fresh run sets the earlier run's traces aside, checkpoints and all
    ("prof", "memory_snapshot", "prof/ckpt",
     "[profiling] save_traces_folder holds [checkpoint] folder ({dump}/prof/ckpt)"),
    ("profile_traces", "profile_traces/memory", "checkpoint",
     "[profiling] save_traces_folder holds [profiling] save_memory_snapshot_folder "
     "({dump}/profile_traces/memory)"),
])
def test_profiling_and_checkpoint_folders_that_meet_are_refused(tmp_path, traces, snapshots,
                                                                 checkpoint, error):
    """Traces in the checkpoint folder: the trace of step 2 took step-2/, and the save of step 2
    died renaming step-2.tmp onto it (OSError: Directory not empty) after the step was done."""
    from components.config.parse import load_config
    with pytest.raises(ConfigError) as raised:
        load_config([*BASE, "--job.dump_folder", str(tmp_path),
                     "--profiling.save_traces_folder", traces,
                     "--profiling.save_memory_snapshot_folder", snapshots,
                     "--checkpoint.folder", checkpoint])
    assert str(raised.value) == (error.format(dump=tmp_path) + ": each writes its own "
                                 "step-<N>/ folders; name separate folders")


def test_a_profiling_folder_in_a_checkpoints_step_folder_is_refused(tmp_path):
    """Spelled through an absolute checkpoint folder and a symlinked dump folder alike."""
    from components.config.parse import load_config
    (tmp_path / "linked").symlink_to(tmp_path, target_is_directory=True)
    for dump, checkpoint, traces in ((tmp_path, "checkpoint", "checkpoint/step-2"),
                                     (tmp_path / "linked", str(tmp_path / "ck"), "ck/step-10/x")):
        with pytest.raises(ConfigError) as raised:
            load_config([*BASE, "--job.dump_folder", str(dump), "--checkpoint.folder",
                         checkpoint, "--profiling.save_traces_folder", traces])
        assert str(raised.value) == (
            f"[profiling] save_traces_folder ({tmp_path / traces}) is inside a checkpoint's step "
            "folder: name a folder outside [checkpoint] folder's step-<N>/")
    with pytest.raises(ConfigError, match=r"save_traces_folder is \[checkpoint\] folder"):
        load_config([*BASE, "--job.dump_folder", str(tmp_path / "linked"), "--checkpoint.folder",
                     str(tmp_path / "ck"), "--profiling.save_traces_folder", "ck"])


@pytest.mark.parametrize("checkpoint", [".", "profile_traces/.."])
def test_a_checkpoint_folder_holding_the_profiling_folders_is_accepted(tmp_path, checkpoint):
    """Checkpoints in the dump folder itself: its step-<N>/ beside profile_traces/."""
    from components.config.parse import load_config
    cfg = load_config([*BASE, "--job.dump_folder", str(tmp_path), "--checkpoint.folder",
                       checkpoint])
    assert cfg.checkpoint.folder == checkpoint


def test_profiling_that_no_step_reaches_says_so(tmp_path, capsys):
    """enable_profiling with profile_freq (default 10) above the run's steps: no step is a
    multiple of it and no trace is written, and the run said nothing."""
    run = tmp_path / "run"
    assert train.main([*BASE, "--data.synthetic", "true", "--training.steps", "2",
                       "--job.dump_folder", str(run), "--profiling.enable_profiling", "true",
                       "--profiling.profile_freq", "10"]) == 0
    out = capsys.readouterr().out
    assert "warning: [profiling] profile_freq = 10: no step of this run (1 to 2)" in out, out
    assert not list((run / "profile_traces").rglob("*.json"))
