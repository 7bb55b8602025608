"""One run per dump folder: a second run refuses before writing anything, on every rank; two
runs started together cannot both train; a killed run's lock is taken over."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import train
from components.lock import LOCK_FILE, DumpFolderInUse, acquire, release

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
        "--loss.impl", "unfused", "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--metrics.log_freq", "1", "--job.print_config", "false", "--validation.enable", "false",
        "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable_checkpoint", "true"]


def in_use(folder: Path, pid: int) -> str:
    return (rf"dump folder {re.escape(str(folder))} is in use by another run \(pid {pid} on "
            rf"{re.escape(socket.gethostname())}, started ")


@pytest.mark.slow
def test_a_second_run_refuses_and_writes_nothing(tmp_path):
    dump = tmp_path / "run"
    held = acquire(dump)  # as a run in progress holds it
    try:
        with pytest.raises(DumpFolderInUse, match=in_use(dump, os.getpid())):
            train.main(ARGS + ["--training.steps", "3", "--job.dump_folder", str(dump)])
        assert os.listdir(dump) == [LOCK_FILE]  # no config.toml, metrics.jsonl or checkpoint
    finally:
        release(held)
    assert train.main(ARGS + ["--training.steps", "3", "--job.dump_folder", str(dump)]) == 0
    assert (dump / LOCK_FILE).read_text() == ""  # released: no holder named


@pytest.mark.slow
def test_every_rank_of_a_second_torchrun_run_exits(tmp_path):
    dump = tmp_path / "run"
    held = acquire(dump)
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node", "2", str(ROOT / "train.py"), *ARGS,
                               "--training.steps", "3", "--data.synthetic", "true",
                               "--job.dump_folder", str(dump)], cwd=ROOT, capture_output=True,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    finally:
        release(held)
    assert proc.returncode != 0  # both ranks ended: torchrun waits for every one
    # one line for the node (every rank exits 2 with it, local rank 0 prints it)
    assert len(re.findall(in_use(dump, os.getpid()), proc.stdout + proc.stderr)) == 1
    assert "exitcode: 2" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_runs_started_together_do_not_share_a_folder(tmp_path):
    dump = tmp_path / "run"
    command = [sys.executable, str(ROOT / "train.py"), *ARGS, "--training.steps", "3",
               "--job.dump_folder", str(dump)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=240), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    codes = sorted(code for code, _ in results)
    assert codes[0] == 0 and codes[1] != 0, results
    refused = next(err for code, err in results if code != 0)
    # the holder named by its pid, or, when the second run looked before the first wrote it,
    # as such (a GPU machine's loaded suite met both)
    assert re.search(rf"dump folder {re.escape(str(dump))} is in use by another run "
                     r"\((pid \d+ |a process that has not written its pid yet;)",
                     refused), refused[-2000:]
    steps = [json.loads(x)["step"] for x in (dump / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_a_killed_run_s_lock_is_taken_over(tmp_path):
    dump = tmp_path / "run"
    killed = subprocess.Popen([sys.executable, "-c", "import os, sys; from pathlib import Path; "
                               "from components.lock import acquire; acquire(Path(sys.argv[1])); "
                               "os.kill(os.getpid(), 9)", str(dump)], cwd=ROOT)
    assert killed.wait(timeout=120) == -9
    assert json.loads((dump / LOCK_FILE).read_text())["pid"] == killed.pid  # its text stays
    with pytest.warns(UserWarning, match=rf"taking over .*run.lock from pid {killed.pid} on .*, "
                                         r"which ended without releasing it"):
        held = acquire(dump)
    try:
        assert json.loads((dump / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        release(held)


def test_a_dump_folder_that_is_a_file_or_a_dangling_link_says_so(tmp_path):
    """Both said "cannot be written (File exists: .../run.lock): a run writes there"."""
    from components.lock import FolderNotWritable
    afile, link = tmp_path / "afile", tmp_path / "link"
    afile.write_text("notes")
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(FolderNotWritable, match=rf"dump folder {afile} is a file, not a folder: "
                                                r"set another --job.dump_folder"):
        acquire(afile)
    with pytest.raises(FolderNotWritable, match=rf"dump folder {link} is a symbolic link to "
                                                rf"{tmp_path / 'gone'}, which does not exist"):
        acquire(link)
    assert afile.read_text() == "notes" and not (tmp_path / "gone").exists()
    release(acquire(tmp_path / "made" / "here"))  # a folder not there yet is made
