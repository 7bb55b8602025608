"""Trainer runs as child processes: launch one in its own process group, stop it and whatever it
started, read its log and metrics.jsonl, and say how it went. Never imports torch."""

import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from components.metrics_timeline import records, timeline

REPO = Path(__file__).resolve().parents[2]
# What a CUDA allocation failure prints, from torch, cuBLAS or a raw CUDA call (also under
# torchrun, which reprints the failed worker's traceback).
OOM_PATTERN = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|"
                         r"CUBLAS_STATUS_ALLOC_FAILED")
STOP_GRACE_SECONDS = 20  # train.py stops cleanly after the current step on SIGTERM
TAIL_LINES = 25


def torchrun(nproc: int) -> list[str]:
    """This Python's torchrun on one machine (rendezvous here, no port to choose)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc)]


def trainer(nproc: int, train_cmd: str | None = None) -> list[str]:
    """The trainer command before its arguments: train_cmd as given, else this Python on
    train.py (relative to the working directory), under torchrun when nproc > 1."""
    if train_cmd:
        return shlex.split(train_cmd)
    train_py = os.path.relpath(REPO / "train.py")
    return [*torchrun(nproc), train_py] if nproc > 1 else [sys.executable, train_py]


def stop_process_group(proc: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM first (train.py then stops after its current step), SIGKILL for what is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.poll()


def kill_leftovers(proc: subprocess.Popen) -> None:
    """A worker that outlives its launcher would hold GPU memory and shrink the next run's."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_process(cmd: list[str], log_path: Path, timeout: float, cwd: Path | None = None,
                env: dict | None = None) -> tuple[int | None, bool, float]:
    """Run cmd in its own process group with output to log_path: (exit code, timed out, s);
    env (default: this process's) is its environment."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        # Its own session: the whole group (torchrun and its workers) can be stopped at once.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_process_group(proc)
        except BaseException:  # Ctrl-C, SIGTERM: leave no trainer behind
            stop_process_group(proc, grace=5)
            raise
        finally:
            kill_leftovers(proc)
    return proc.returncode, timed_out, time.monotonic() - start


def log_tail(path: Path, max_bytes: int = 1 << 20) -> str:
    """The end of a log (the last max_bytes), as text."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def last_lines(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def read_metrics(path: Path) -> list[dict]:
    """The training steps of metrics.jsonl, as the run's timeline has them: each step's lines
    merged (a later line's keys win), the steps without tokens_per_second (validation only) and
    those a resumed run abandoned left out."""
    rows = timeline(records(path))
    return [rows[s] for s in sorted(rows) if rows[s].get("tokens_per_second") is not None]


def throughput(rows: list[dict], warmup: int) -> dict:
    """Medians over the windows past the warm-up; memory peaks over the whole run."""
    steps = [r["step"] for r in rows]
    measured = [r for prev, r in zip([0, *steps], rows) if prev >= warmup]

    def median(key):
        values = [r[key] for r in measured if r.get(key) is not None]
        return statistics.median(values) if values else None

    def peak(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return max(values) if values else None

    return {"tokens_per_second": median("tokens_per_second"),
            "tokens_per_second_total": median("tokens_per_second_total"),
            "mfu_percent": median("mfu_percent"), "tflops_per_device": median("tflops_per_device"),
            "step_seconds": median("step_seconds"),
            "memory_max_allocated_gib": peak("memory_max_allocated_gib"),
            "memory_max_reserved_gib": peak("memory_max_reserved_gib"),
            "measured_steps": [r["step"] for r in measured]}


def classify(returncode: int | None, timed_out: bool, output: str, measured: bool,
             finished: bool = False) -> str:
    """ok, oom, error or timeout, from the exit, the output and what was measured."""
    if timed_out:
        # Stopped after its last step was logged (in teardown): the measurement is whole.
        # Otherwise a timeout, even if train.py then exited cleanly on our SIGTERM.
        return "ok" if finished and measured else "timeout"
    if returncode == 0:
        return "ok" if measured else "error"
    return "oom" if OOM_PATTERN.search(output) else "error"
