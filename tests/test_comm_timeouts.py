"""[comm] timeouts: the keys load (torchtitan's names and defaults), every process group of a run
has the timeout of its phase, and a rank that stalls after the first step fails the others' run
with a timeout error instead of hanging them, while a stall in the first step (compilation's
place) or in rank 0's part of a checkpoint save, longer than the train timeout, does not.

The multi-process tests are real gloo process groups on the CPU; the stalls are train.py's
FLCE_TEST_STALL sleeps, the collectives and their timeouts are torch's."""

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d as c10d

from components.config.parse import load_config
from components.config.schema import Comm, ConfigError
from components.config.toml_out import to_toml
from components.process import exit_without_teardown
from launches import errors
from ports import free_port
from test_parallelisms import BASE, ROOT, metrics, torchrun

TRAIN_TIMEOUT = 5  # s: a CPU step of the debug model takes a fraction of that, on a busy machine
STALL = 10  # s: longer than TRAIN_TIMEOUT, far shorter than the init timeout below
INIT_TIMEOUT = 120


# ---- the keys ---------------------------------------------------------------------------------

def test_comm_keys_load_with_torchtitans_defaults(tmp_path):
    assert (Comm().init_timeout_seconds, Comm().train_timeout_seconds) == (300, 100)
    path = tmp_path / "torchtitan.toml"  # a torchtitan v0.2 config's [comm] table
    path.write_text("[job]\ndump_folder = \"./outputs\"\n\n[comm]\ninit_timeout_seconds = 600\n"
                    "train_timeout_seconds = 60\n")
    cfg = load_config(["--config", str(path)])
    assert (cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds) == (600, 60)
    cfg = load_config(["--config", str(path), "--comm.train_timeout_seconds", "5"])
    assert cfg.comm.train_timeout_seconds == 5
    assert "[comm]\ninit_timeout_seconds = 600\ntrain_timeout_seconds = 5\n" in to_toml(cfg)


@pytest.mark.parametrize("key", ["init_timeout_seconds", "train_timeout_seconds"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_timeout_that_is_not_positive_is_named(key, value):
    with pytest.raises(ConfigError, match=rf"^\[comm\] {key} = {value}: must be >= 1$"):
        load_config([f"--comm.{key}", value])


@pytest.mark.parametrize("text,match", [
    ("train_timeout_seconds = 1.5", r"\[comm\] train_timeout_seconds: expected int, got float 1.5"),
    ('init_timeout_seconds = "300"', r"\[comm\] init_timeout_seconds: expected int, got str"),
    ("trainer_timeout_seconds = 5", r"unknown config key \[comm\] trainer_timeout_seconds \(did "
                                    r"you mean 'train_timeout_seconds'\?\)"),
])
def test_a_bad_comm_value_is_named(tmp_path, text, match):
    path = tmp_path / "c.toml"
    path.write_text(f"[comm]\n{text}\n")
    with pytest.raises(ConfigError, match=match):
        load_config(["--config", str(path)])


# ---- every group has its phase's timeout ------------------------------------------------------

def _timeouts() -> dict[str, float]:
    """{group description: its timeout in seconds} of this rank's process groups."""
    cpu = torch.device("cpu")
    return {group.group_desc: group._get_backend(cpu).options._timeout.total_seconds()
            for group in c10d._world.pg_map}


def _phases_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from components import process
    from parallelisms.mesh import ParallelDims

    seen = {}
    with (process.process_group("cpu", Comm(init_timeout_seconds=77, train_timeout_seconds=7)),
          warnings.catch_warnings(record=True) as caught):
        warnings.simplefilter("always")
        dims = ParallelDims.resolve(1, -1, 1, world, cp=world)  # dp_shard 1: flattened with cp
        dims.fsdp_mesh(dims.build_mesh("cpu"))
        own = dist.new_group(backend="gloo", group_desc="async_checkpoint")
        process.keep_own_timeout(own)  # as components/checkpoint.py's async group
        seen["init"] = _timeouts()
        process.start_train_timeout()
        seen["train"] = _timeouts()
        with process.init_timeout_phase():
            seen["phase"] = _timeouts()
        seen["after the phase"] = _timeouts()
        process.back_to_init_timeout()
        seen["end"] = _timeouts()
    # torch 2.15 warns on c10d._set_pg_timeout (deprecated for dist.set_timeout) at every switch
    seen["warnings from components/process.py"] = [
        str(w.message) for w in caught if w.filename.endswith("components/process.py")]
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(seen))
    exit_without_teardown(0)  # gloo's teardown at exit may abort (components/process.py)


@pytest.mark.slow
def test_every_group_has_the_timeout_of_its_phase(tmp_path):
    """The device mesh's subgroups and FSDP's flattened ones too (torch would give them gloo's
    default, 30 min, whatever the default group's); the async checkpoint's group keeps its own."""
    mp.spawn(_phases_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        groups = set(seen["init"])
        assert {"default_pg", "mesh_dp_replicate", "mesh_dp_shard", "mesh_tp"} <= groups
        assert "async_checkpoint" in groups
        assert seen.pop("warnings from components/process.py") == []
        expected = {"init": 77, "train": 7, "phase": 77, "after the phase": 7, "end": 77}
        for phase, seconds in expected.items():
            assert set(seen[phase]) == groups, phase
            assert seen[phase] == {g: 1800.0 if g == "async_checkpoint" else seconds
                                   for g in groups}, phase


# ---- a stalled rank fails the run; a stall where one is allowed does not ----------------------

TIMEOUTS = ["--comm.init_timeout_seconds", str(INIT_TIMEOUT),
            "--comm.train_timeout_seconds", str(TRAIN_TIMEOUT), "--training.local_batch_size", "2"]


def run_with_a_stalled_rank(tmp_path: Path, *overrides: str) -> tuple[int, float, str]:
    """Two ranks of the trainer, rank 1 stalled at step 3 (as long as a hang, for a test): rank 0's
    exit code, the seconds it ran, its output. The ranks are started by hand: torchrun would wait
    up to 30 s for the stalled rank after its SIGTERM, which the trainer takes as a stop request."""
    port, ranks = free_port(), []
    try:
        for rank in (0, 1):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "FLCE_TEST_STALL": "1:step@3:600"}
            with open(tmp_path / f"rank-{rank}.out", "w") as out:
                ranks.append(subprocess.Popen(
                    [sys.executable, str(ROOT / "train.py"), *BASE, *TIMEOUTS,
                     "--job.dump_folder", str(tmp_path / "run"), *overrides],
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
        started = time.monotonic()
        code = ranks[0].wait(timeout=180)  # without [comm]: gloo's 30 min, NCCL's 10
        waited = time.monotonic() - started
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return code, waited, (tmp_path / "rank-0.out").read_text()


@pytest.mark.slow
def test_a_rank_stalled_after_the_first_step_fails_the_run_with_a_timeout(tmp_path):
    """Rank 0 raises gloo's timeout error, with a note naming [comm] train_timeout_seconds,
    TRAIN_TIMEOUT s into step 3, instead of waiting for the stalled rank 1."""
    code, waited, output = run_with_a_stalled_rank(tmp_path)
    assert code != 0, output[-3000:]
    assert f"Timed out waiting {TRAIN_TIMEOUT * 1000}ms" in output, errors(output)  # gloo's
    assert (f"[comm] train_timeout_seconds = {TRAIN_TIMEOUT}: this rank waited that long"
            in output), errors(output)
    assert sorted(metrics(tmp_path / "run")) == [1, 2]  # steps 1 and 2 (and step 2's save) were fine
    assert waited < 90, waited


@pytest.mark.slow
def test_stalls_in_the_first_step_and_in_a_save_outlast_the_train_timeout(tmp_path, monkeypatch):
    """Rank 1 stalls in step 1 (where compilation runs) and rank 0 after step 2's save (where it
    commits and prunes alone while rank 1 waits), each for longer than the train timeout: both
    run under the init timeout, and the run finishes."""
    dump = tmp_path / "run"
    monkeypatch.setenv("FLCE_TEST_STALL", f"1:step@1:{STALL},0:save@2:{STALL}")  # torchrun's env
    started = time.monotonic()
    torchrun(2, dump, *TIMEOUTS)
    assert time.monotonic() - started >= 2 * STALL  # the stalls happened
    assert sorted(metrics(dump)) == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (dump / "checkpoint").glob("step-*")) == [
        "step-2", "step-4", "step-5"]
