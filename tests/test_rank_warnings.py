"""A warning every rank gives alike (SameOnEveryRank) prints once per run, from rank 0; one about
a rank's own share prints on that rank: components/rank_warnings.py."""

import os
import sys
import warnings
from pathlib import Path

import pytest

import forked_ranks
from components.rank_warnings import SameOnEveryRank, said_by_rank_zero

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("rank", [0, 1, 5])
def test_other_ranks_drop_only_the_warnings_every_rank_gives(rank):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with said_by_rank_zero(rank):
            warnings.warn("the same everywhere", SameOnEveryRank)
            warnings.warn("this rank's shard")
        warnings.warn("after the run", SameOnEveryRank)  # the caller's filters are back
    said = [str(w.message) for w in caught]
    assert said == (["the same everywhere"] if rank == 0 else []) + ["this rank's shard",
                                                                     "after the run"]


@pytest.mark.slow
def test_a_skipped_checkpoint_folder_is_named_once_by_two_ranks(tmp_path):
    """Both ranks list the checkpoint folder and skip an incomplete step folder: the warning
    printed twice (once a rank) before."""
    dump = tmp_path / "run"
    (dump / "checkpoint" / "step-7").mkdir(parents=True)  # no metadata: an incomplete save
    run = forked_ranks.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "debug.toml"),
         "--training.device", "cpu", "--loss.impl", "unfused", "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--training.steps", "1", "--data.synthetic",
         "true", "--validation.enable", "false", "--job.print_config", "false",
         "--checkpoint.enable", "true", "--job.dump_folder", str(dump)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180,
        capture_output=True, text=True)
    said = run.stdout + run.stderr
    assert run.returncode == 0, said[-3000:]
    assert said.count("SameOnEveryRank: skipping incomplete checkpoint folder") == 1, said[-3000:]
