"""The 8-GPU node's layouts, as gloo processes on the CPU (fp32): FSDP=8, FSDP=4 x TP=2 with the
sequence-parallel loss, FSDP=2 x CP=2 x TP=2, and HSDP 2 x 4 started as two
"nodes" (two torchrun launchers with a c10d rendezvous on localhost, each built by
scripts/slurm/torchrun_cmd.sh as train.sbatch starts them) give the losses, gradient norms and weights of one process; a
checkpoint saved by 8 processes resumes at 2 and at 1 with the same losses.

The tiniest runs that show it (debug flavor, seq_len 32, 4 steps): each launch of 8 processes
costs 15-20 s on 2 idle CPU cores, nearly all of it starting them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from launches import errors
from ports import free_port
from test_parallelisms import BASE, metrics, torchrun, weights

pytestmark = pytest.mark.slow  # multi-process runs: not in the fast subset

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 8
STEPS = 4  # checkpoints at 2 and 4 (BASE: interval 2)
SMALL = ["--training.seq_len", "32", "--training.steps", str(STEPS)]


def local_batch(dp: int) -> list[str]:
    return ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]


def assert_trains_like(ref: Path, got: Path, tmp: Path, steps=range(1, STEPS + 1)) -> None:
    """Same losses and gradient norms at every step, same weights after the last (fp32; as in
    test_parallelisms.py: AdamW's division by sqrt(v) turns ~1e-9 summation-order differences
    of near-zero gradients into up to ~1e-5 of lr after a few steps)."""
    a, b = metrics(ref), metrics(got)
    assert sorted(b) == list(steps)
    for step in steps:
        for key in ("loss", "grad_norm"):
            assert abs(a[step][key] - b[step][key]) <= 1e-5, (step, key, a[step][key], b[step][key])
    w_ref, w_got = weights(ref, steps[-1], tmp), weights(got, steps[-1], tmp)
    assert w_ref.keys() == w_got.keys()
    for name in w_ref:
        torch.testing.assert_close(w_got[name], w_ref[name], rtol=1e-5, atol=3e-5, msg=name)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("single")
    assert train.main(BASE + SMALL + local_batch(1) + ["--job.dump_folder", str(dump)]) == 0
    return dump


@pytest.fixture(scope="module")
def fsdp8(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("fsdp8")
    torchrun(8, dump, *SMALL, *local_batch(8))
    return dump


def test_fsdp_over_8_matches_one_process(single, fsdp8, tmp_path):
    assert_trains_like(single, fsdp8, tmp_path)


def test_fsdp4_tp2_matches_one_process(single, tmp_path):
    """The sequence-parallel loss; the vocab-parallel one at FSDP x TP is test_parallelisms.py's
    (4 processes)."""
    dump = tmp_path / "run"
    torchrun(8, dump, *SMALL, *local_batch(4), "--parallelism.tensor_parallel_degree", "2",
             "--loss.parallel", "sequence")
    assert_trains_like(single, dump, tmp_path)


def test_fsdp2_cp2_tp2_matches_one_process(single, tmp_path):
    """Context parallelism inside the node's layout: FSDP over dp_shard x cp = 4, each sequence
    split over 2 ranks and each of their halves over 2 tensor-parallel ranks."""
    dump = tmp_path / "run"
    torchrun(8, dump, *SMALL, *local_batch(2), "--parallelism.context_parallel_degree", "2",
             "--parallelism.tensor_parallel_degree", "2")
    assert_trains_like(single, dump, tmp_path)


@pytest.mark.parametrize("nproc", [2, 1])
def test_checkpoint_of_8_resumes_at_fewer(fsdp8, tmp_path, nproc):
    dump = tmp_path / "run"
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(fsdp8 / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    if nproc == 1:
        assert train.main(BASE + SMALL + local_batch(1) + ["--job.dump_folder", str(dump)]) == 0
    else:
        torchrun(nproc, dump, *SMALL, *local_batch(nproc))
    assert_trains_like(fsdp8, dump, tmp_path, steps=range(3, STEPS + 1))


def test_two_nodes_of_4_hsdp_matches_one_process(single, tmp_path):
    """HSDP 2 x 4: a replica per "node", FSDP inside it, as on two 4-GPU nodes. Each node is
    scripts/slurm/torchrun_cmd.sh with the variables SLURM gives a task of a 2-node job."""
    shim = tmp_path / "bin" / "torchrun"  # this interpreter's torchrun, whatever PATH holds
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
    shim.chmod(0o755)
    dump = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(PATH=f"{shim.parent}:{env['PATH']}", OMP_NUM_THREADS="1", SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="localhost", SLURM_NNODES="2", GPUS_PER_NODE="4",
               MASTER_PORT=str(free_port()), CONFIG=BASE[1])
    overrides = [*BASE[2:], *SMALL, *local_batch(8), "--job.dump_folder", str(dump),
                 "--parallelism.data_parallel_replicate_degree", "2"]
    nodes = [subprocess.Popen([str(ROOT / "scripts/slurm/torchrun_cmd.sh"), *overrides],
                              cwd=ROOT, env={**env, "SLURM_NODEID": str(node)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=400)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, errors(output)
    # c10d's rendezvous numbers the nodes in the order they join: global rank 0, which logs,
    # can be on either launcher
    assert "world 8 (dp_replicate 2, dp_shard 4, tp 1)" in outputs[0] + outputs[1]
    assert_trains_like(single, dump, tmp_path)
