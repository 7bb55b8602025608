"""TokenWindows with num_workers > 0, tokenizing in worker processes: the same windows and
resumes as inline, errors and a dead worker reach the loop, forked workers finalize nothing, and
the workers do not outlive a killed trainer."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import datasets
import pytest
import torch

from components import lock
from components.data import windows as data_windows
from components.data.sources import load_documents
from components.data.windows import Batches, TokenWindows
from test_data_windows import BYTE, plain, random_texts, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("streaming", [False, True])
def test_tokenizer_workers_give_the_same_windows_and_resume(tmp_path, rng, monkeypatch, streaming):
    """num_workers > 0 tokenizes in worker processes ahead of the loop: the same windows and states
    as on the calling thread, across batches of documents, epochs and resumes; close() ends them."""
    monkeypatch.setattr(data_windows, "DOCUMENTS_PER_TASK", 3)  # many batches of documents per epoch
    path = write_jsonl(tmp_path / "docs.jsonl", random_texts(rng, 50, max_length=30))
    documents = load_documents(str(path), "train", streaming=streaming, val_every=5,
                               cache_dir=tmp_path / "cache")

    def fresh(workers: int) -> Batches:
        return Batches(TokenWindows(documents, BYTE, seq_len=9, dp_rank=1, dp_world=2, num_workers=workers),
                       local_batch_size=3)

    children = set(multiprocessing.active_children())
    inline, pooled = fresh(0), fresh(2)
    states, batches = [], []
    while len(states) < 40 or states[-1]["epoch"] < 2:  # a random corpus: epochs vary in length
        assert len(states) < 1000, "two epochs never came"
        states.append(plain(pooled.state_dict()))
        assert states[-1] == plain(inline.state_dict())
        batches.append(next(pooled))
        expected = next(inline)
        assert torch.equal(batches[-1][0], expected[0]) and torch.equal(batches[-1][1], expected[1])
    for k in rng.sample(range(len(states) - 3), 3):
        pooled.load_state_dict(states[k])
        for n in range(k, k + 3):
            assert torch.equal(next(pooled)[0], batches[n][0]), (k, n)
    assert len(set(multiprocessing.active_children()) - children) == 2
    pooled.close()
    assert not set(multiprocessing.active_children()) - children


def test_errors_in_tokenizer_workers_reach_the_training_loop():
    documents = datasets.Dataset.from_dict({"text": ["abc", None, "xyz"]})
    windows = TokenWindows(documents, BYTE, 4, num_workers=1)
    with pytest.raises(TypeError, match="document 1: field 'text' holds NoneType, not text"):
        next(windows)
    windows.close()
    windows = TokenWindows(datasets.Dataset.from_dict({"text": ["abc", "xyz"]}), BYTE, 4, max_token_id=200,
                           num_workers=1)
    with pytest.raises(ValueError, match=r"document 0: token id 256 .* vocab size 200"):
        next(windows)
    windows.close()


def test_a_tokenizer_worker_that_dies_is_an_error_not_a_hang(rng, monkeypatch):
    monkeypatch.setattr(data_windows, "DOCUMENTS_PER_TASK", 2)
    children = set(multiprocessing.active_children())
    windows = TokenWindows(datasets.Dataset.from_dict({"text": random_texts(rng, 200)}), BYTE, 8, num_workers=1)
    next(windows)
    (worker,) = set(multiprocessing.active_children()) - children
    os.kill(worker.pid, signal.SIGKILL)
    signal.alarm(120)  # a hang fails the test instead of the whole run
    try:
        with pytest.raises(RuntimeError, match="a tokenizer worker process died"):
            for _ in range(2000):
                next(windows)
    finally:
        signal.alarm(0)
    windows.close()


class _FinalizedIn:
    """Cyclic garbage whose finalizer records the process that ran it."""

    def __init__(self, path):
        self.path, self.me = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def _collect():
    import gc
    gc.collect()


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
@pytest.mark.parametrize("frozen", [True, False])
def test_forked_workers_do_not_finalize_what_they_inherit(tmp_path, frozen):
    """A forked tokenizer worker that garbage-collected its parent's objects ran their
    finalizers without the parent's threads, and a telemetry library's aborted the worker
    (prepare_data: "a worker process died"). Forked under `inherited_objects_frozen` it leaves
    them alone; the unfrozen run shows the test can tell."""
    import contextlib
    import gc
    from components.data.document_tokens import inherited_objects_frozen, worker_context
    marks = tmp_path / "finalized"
    marks.touch()
    gc.disable()  # the garbage must still exist when the worker is forked
    try:
        _FinalizedIn(marks)
        child = worker_context().Process(target=_collect)
        with inherited_objects_frozen() if frozen else contextlib.nullcontext():
            child.start()
        child.join(60)
    finally:
        gc.enable()
        gc.collect()
    by = marks.read_text().split()
    assert (str(child.pid) in by) is not frozen and str(os.getpid()) in by


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
