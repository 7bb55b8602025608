"""tests/forked_ranks.py gives what torchrun gives: the same metrics for a 2-rank run, the
test's environment and torchrun's variables in each rank, a failed rank's status and words,
and a timeout."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import forked_ranks
from launches import NATIVE_CRASH, errors

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
ARGS = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
        "--training.seq_len", "64", "--metrics.log_freq", "1", "--job.print_config", "false",
        "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2",
        "--training.steps", "4", "--data.synthetic", "true", "--training.local_batch_size", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def script(tmp_path: Path, code: str) -> str:
    path = tmp_path / "probe.py"
    path.write_text(textwrap.dedent(code))
    return str(path)


@pytest.mark.slow
def test_two_ranks_train_as_under_torchrun(tmp_path):
    rows = {}
    for how, launch in (("torchrun", subprocess.run), ("forked", forked_ranks.run)):
        dump = tmp_path / how
        launch(TORCHRUN + ["2", str(ROOT / "train.py"), *ARGS, "--job.dump_folder", str(dump)],
               cwd=ROOT, env=ENV, timeout=300, check=True, stdout=subprocess.DEVNULL)
        rows[how] = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "grad_norm")
    got, ref = ([{k: r[k] for k in keys if k in r} for r in rows[how]]
                for how in ("forked", "torchrun"))
    assert len(got) == len(ref) >= 4 and any("loss" in r for r in got)
    for a, b in zip(got, ref):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-6 for k in a), (a, b)


def test_each_rank_has_the_tests_environment_and_torchruns(tmp_path):
    probe = script(tmp_path, """
        import os, sys, torch
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "PROBE", "MASTER_ADDR")
        print(*(os.environ[k] for k in keys), torch.get_num_threads(), os.getcwd(), sys.argv[1:])
        """)
    run = forked_ranks.run(TORCHRUN + ["2", probe, "--x", "1"], cwd=tmp_path,
                           env={**ENV, "PROBE": "from-the-test"}, timeout=60,
                           capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    # the loopback address as torchrun names it: 127.0.0.1 (torch 2.13), localhost (2.11, and
    # the real torchrun a GPU machine's tests launch)
    lines = sorted(run.stdout.replace(" localhost ", " 127.0.0.1 ").splitlines())
    assert lines == [
        f"{r} {r} 2 2 from-the-test 127.0.0.1 1 {tmp_path} ['--x', '1']" for r in (0, 1)]


def test_a_failed_rank_fails_the_launch_and_ends_the_others(tmp_path):
    probe = script(tmp_path, """
        import os, time
        if os.environ["RANK"] == "1":
            raise ValueError("rank 1 gives up")
        time.sleep(120)
        """)
    start = time.monotonic()
    run = forked_ranks.run(TORCHRUN + ["2", probe], cwd=tmp_path, env=ENV, timeout=100,
                           capture_output=True, text=True)
    assert run.returncode == 1  # torchrun's, whatever the rank's status
    assert "ValueError: rank 1 gives up" in run.stderr
    assert time.monotonic() - start < 60  # rank 0 was ended (SIGTERM), not waited for


def test_a_config_error_exits_as_under_torchrun(tmp_path):
    run = forked_ranks.run(TORCHRUN + ["2", str(ROOT / "train.py"), *ARGS, "--job.dump_folder",
                                       str(tmp_path), "--training.seq_len", "63",
                                       "--parallelism.tensor_parallel_degree", "2"],
                           cwd=ROOT, env=ENV, timeout=300, capture_output=True, text=True)
    assert run.returncode == 1
    assert "config error: [parallelism] tensor_parallel_degree = 2 does not divide" in run.stderr


def test_a_timeout_ends_the_ranks(tmp_path):
    marker = tmp_path / "still-running"
    probe = script(tmp_path, f"""
        import time
        time.sleep(5)
        open({str(marker)!r}, "w").close()
        """)
    with pytest.raises(subprocess.TimeoutExpired):
        forked_ranks.run(TORCHRUN + ["2", probe], cwd=tmp_path, env=ENV, timeout=1)
    time.sleep(6)
    if not forked_ranks._forkable(TORCHRUN + ["2", probe], ENV):
        return  # subprocess.run's timeout ends torchrun, and its ranks may go on
    assert not marker.exists()


def test_a_rank_that_crashes_says_where(tmp_path):
    """A rank dying of a signal: its Python stack (PYTHONFAULTHANDLER) and the signal's name, which
    launches.launch reads to launch once more."""
    probe = script(tmp_path, """
        import ctypes, os
        if os.environ["RANK"] == "1":
            ctypes.string_at(0)
        """)
    run = forked_ranks.run(TORCHRUN + ["2", probe], cwd=tmp_path, timeout=60, text=True,
                           env={**ENV, "PYTHONFAULTHANDLER": "1"}, capture_output=True)
    assert run.returncode == 1
    assert NATIVE_CRASH.search(run.stderr), run.stderr
    assert "SIGSEGV" in errors(run.stderr), run.stderr


def test_an_environment_the_zygote_cannot_give_runs_on_torchrun(tmp_path):
    command = TORCHRUN + ["2", str(ROOT / "train.py")]
    assert not forked_ranks._forkable(command, {**ENV, "OMP_NUM_THREADS": "2"})
    one = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    assert not forked_ranks._forkable(command[:5] + ["1", *command[6:]], one)
    real = forked_ranks.torch_cuda() or os.environ.get("FLCE_TEST_REAL_TORCHRUN") == "1"
    assert forked_ranks._forkable(command, ENV) != real  # the tests' launches do fork here
    # A variable read at import that differs from the running zygote's (an in-process
    # train.main leaves CUBLAS_WORKSPACE_CONFIG and TORCH_FR_* behind; here the hash seed): a
    # zygote of its own, started with it, forks those ranks. Before, every later launch of
    # that test process ran on real torchrun.
    probe = script(tmp_path, """
        import os
        print(os.environ["MASTER_ADDR"], hash("forked"))
        """)
    for seed in ("1", "2"):
        env = {**ENV, "PYTHONHASHSEED": seed}
        run = forked_ranks.run(TORCHRUN + ["2", probe], cwd=tmp_path, env=env, timeout=60,
                               capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        fresh = subprocess.run([sys.executable, "-c", 'print(hash("forked"))'], env=env,
                               capture_output=True, text=True, check=True).stdout.strip()
        addr = "localhost" if real else "127.0.0.1"  # torchrun's --standalone, or the fork's
        assert run.stdout.splitlines() == [f"{addr} {fresh}"] * 2
