"""Tokenizer worker processes and the trainer's life: they must not outlive it."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from components import lock

ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed worker re-parented to a PID 1 that does not reap stays a zombie, which holds no file.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
@pytest.mark.filterwarnings("ignore:taking over")  # the killed trainer's lock: expected here
def test_workers_of_a_killed_trainer_die_and_free_the_dump_folder(tmp_path):
    """kill -9 of a trainer with [data] num_workers > 0 left its idle workers waiting under PID 1,
    holding run.lock, so the same command could not resume ("in use by another run")."""
    code = textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        from components import lock
        from components.data.document_tokens import TokenizerPool
        from components.tokenizer import ByteTokenizer
        lock.acquire(Path({str(tmp_path)!r}))
        pool = TokenizerPool(ByteTokenizer(), 2)
        Path({str(tmp_path / "workers")!r}).write_text(" ".join(map(str, pool._executor._processes)))
        for _ in range(50):  # a worker may not have run its initializer yet
            held = [pid for pid in pool._executor._processes for fd in os.listdir(f"/proc/{{pid}}/fd")
                    if os.path.realpath(f"/proc/{{pid}}/fd/{{fd}}").endswith("run.lock")]
            if not held:
                break
            time.sleep(0.1)
        Path({str(tmp_path / "held")!r}).write_text(" ".join(map(str, held)))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    log = tmp_path / "log"
    with open(log, "w") as out:  # a file, not a pipe: workers that live on would hold a pipe open
        returncode = subprocess.run([sys.executable, "-c", code], stdout=out, stderr=out, cwd=ROOT,
                                    timeout=120).returncode
    assert returncode == -signal.SIGKILL, log.read_text()
    workers = [int(pid) for pid in (tmp_path / "workers").read_text().split()]
    try:
        assert len(workers) == 2
        assert not (tmp_path / "held").read_text(), "workers hold run.lock while the trainer lives"
        deadline = time.monotonic() + 5
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, workers)), "tokenizer workers outlived the killed trainer"
        lock.release(lock.acquire(tmp_path))  # raises DumpFolderInUse while a worker holds it
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
