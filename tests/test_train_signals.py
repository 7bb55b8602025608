"""Stop signals to a real training process (python, torchrun): a checkpoint and a clean exit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train import DEBUG_CONFIG, OVERRIDES, ROOT


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants, from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


@pytest.fixture
def start_training(tmp_path):
    """start_training(name, command, env): a long checkpointing run in the background, stdout and
    stderr to <name>.out. Whatever still runs at the end of the test is killed."""
    started = []

    def start(name, command, env=None, extra=()):
        dump = tmp_path / name
        with open(tmp_path / f"{name}.out", "w") as out:
            proc = subprocess.Popen(
                [*command, *OVERRIDES, "--training.steps", "100000", "--job.dump_folder", str(dump),
                 "--checkpoint.enable", "true", "--checkpoint.interval", "100000", *extra],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        started.append(proc)
        return proc, dump, lambda: (tmp_path / f"{name}.out").read_text()

    yield start
    for proc in started:
        if proc.poll() is None:
            for pid in process_tree(proc.pid):  # torchrun's trainers run in sessions of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()


def wait_until(condition, proc, output, timeout=180):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{output()}"
        assert time.monotonic() < deadline, output()
        time.sleep(0.05)


def logged_steps(dump) -> list[int]:
    path = dump / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


PYTHON_TRAIN = [sys.executable, str(ROOT / "train.py"), "--config", DEBUG_CONFIG]


@pytest.mark.slow
def test_ctrl_c_saves_and_exits_cleanly(start_training):
    proc, dump, output = start_training("int", PYTHON_TRAIN)
    wait_until(lambda: len(logged_steps(dump)) >= 2, proc, output)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, output()
    last = logged_steps(dump)[-1]
    assert f"received SIGINT: stopped after step {last}, checkpoint in" in output()
    assert (dump / "checkpoint" / f"step-{last}" / ".metadata").is_file()


@pytest.mark.slow
def test_second_ctrl_c_aborts_at_once(start_training):
    # Steps of ~0.5 s: the second Ctrl-C lands while the step the first one let finish still
    # runs (with 25 ms steps it sometimes came after the save and the exit had begun).
    proc, dump, output = start_training("int2", PYTHON_TRAIN, extra=[
        "--training.seq_len", "256", "--training.local_batch_size", "24"])
    wait_until(lambda: len(logged_steps(dump)) >= 2, proc, output)
    done = len(logged_steps(dump))
    wait_until(lambda: len(logged_steps(dump)) > done, proc, output)  # a new step has begun
    proc.send_signal(signal.SIGINT)
    wait_until(lambda: "Ctrl-C again aborts" in output(), proc, output)  # the handler ran
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) != 0
    assert "KeyboardInterrupt" in output() and "received SIGINT" not in output(), output()
    assert not list((dump / "checkpoint").glob("step-*[0-9]"))


@pytest.mark.slow
@pytest.mark.parametrize("sig,to_every_process", [(signal.SIGTERM, False), (signal.SIGUSR1, True)],
                         ids=["SIGTERM-to-the-script", "SIGUSR1-to-every-process"])
def test_torchrun_launch_exits_0_after_a_clean_stop(start_training, sig, to_every_process):
    """scripts/run_train.sh with NGPU=2 (real torchrun, gloo): a stop signal to the script, or a
    SIGUSR1 to every process of the job at once (as SLURM signals a job step), ends with a
    checkpoint and exit 0 (torchrun signalled itself exits 1 after its trainers saved)."""
    proc, dump, output = start_training("tr", [str(ROOT / "scripts/run_train.sh")],
                                        env={"NGPU": "2", "CONFIG": DEBUG_CONFIG})
    wait_until(lambda: len(logged_steps(dump)) >= 2, proc, output)
    for pid in process_tree(proc.pid) if to_every_process else [proc.pid]:
        os.kill(pid, sig)
    assert proc.wait(timeout=120) == 0, output()
    last = logged_steps(dump)[-1]
    assert f"received {sig.name}: stopped after step {last}" in output()
    assert (dump / "checkpoint" / f"step-{last}" / ".metadata").is_file()
