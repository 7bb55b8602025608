"""The trainer's non-finite steps: stopped or skipped as configured, by every rank together."""

import json
import math
import os
import sys

import pytest

import forked_ranks  # the ranks of a launch forked: tests/forked_ranks.py
from test_train import ROOT, SMALL, run


@pytest.mark.parametrize("policy,expected_logged_steps", [("stop", 1), ("skip", 3)])
def test_non_finite_loss_policy(tmp_path, policy, expected_logged_steps):
    # A logit scale of 1e38 overflows fp32: every step's loss is non-finite.
    code, _, rows = run(tmp_path, policy, "--training.steps", "10", "--loss.logit_scale",
                        "1e38", "--training.nan_policy", policy, "--training.max_bad_steps", "3")
    assert code == 1
    assert len(rows) == expected_logged_steps


@pytest.mark.parametrize("policy,nan_steps,exit_code,logged,bad_steps,saved", [
    ("stop", "2", 1, [1, 3], [0, 1], []),  # one bad step between log steps: stop at the next
    ("skip", "2", 0, [1, 3, 6], [0, 1, 1], None),  # None: no checkpointing (saves take time)
    ("skip", "4,5", 1, [1, 3, 6], [0, 0, 2], None),  # max_bad_steps in a row between log steps
    ("skip", "3,4", 1, [1, 3, 6], [0, 1, 2], [3]),  # a run across a log step counts whole
])
def test_non_finite_steps_between_log_steps(tmp_path, monkeypatch, policy, nan_steps, exit_code,
                                            logged, bad_steps, saved):
    # FLCE_TEST_NAN_STEPS makes the loss (and so every gradient) NaN at those steps, as a bad
    # batch would; the counts live on the device and are read at log steps only.
    monkeypatch.setenv("FLCE_TEST_NAN_STEPS", nan_steps)
    code, dump, rows = run(tmp_path, "r", "--training.steps", "6", "--metrics.log_freq", "3",
                           "--training.nan_policy", policy, "--training.max_bad_steps", "2",
                           "--checkpoint.enable", str(saved is not None).lower(),
                           "--checkpoint.interval", "3")
    assert code == exit_code
    assert [r["step"] for r in rows] == logged
    assert [r["bad_steps"] for r in rows] == bad_steps
    assert [r["skipped_steps_since_last_log"] for r in rows] == [
        b - a for a, b in zip([0] + bad_steps, bad_steps)]
    # Skipped steps leave the weights finite; a run stopped for them saves nothing at that step.
    poisoned = [int(s) for s in nan_steps.split(",")]
    assert all(math.isfinite(r["loss"]) for r in rows if r["step"] not in poisoned)
    if saved is not None:
        assert sorted(int(p.name[5:]) for p in (dump / "checkpoint").glob("step-*")) == saved


def test_a_run_stopped_for_a_bad_last_step_says_stopped(tmp_path, monkeypatch, capsys):
    """nan_policy "stop" at the last step: the summary said "done: steps 1-4 of 4" (exit 1)."""
    monkeypatch.setenv("FLCE_TEST_NAN_STEPS", "4")
    code, _, _ = run(tmp_path, "r", "--training.steps", "4", "--metrics.log_freq", "10",
                     "--training.nan_policy", "stop")
    out = capsys.readouterr().out
    assert code == 1 and "stopped: steps 1-4 of 4" in out and "done:" not in out


@pytest.mark.slow
def test_ranks_skip_a_step_together(tmp_path):
    """FSDP over 2 processes, rank 1's loss alone non-finite at step 2 with finite gradients:
    every rank skips that update, as when every loss and gradient is NaN. Each rank decided
    alone before: rank 0 stepped its shards while rank 1 did not, so the weights went on from a
    half-updated state (step 3's loss differed), silently."""
    def run_2(name: str, **env) -> list[dict]:
        args = SMALL + ["--training.steps", "3", "--training.local_batch_size", "2",
                        "--data.synthetic", "true", "--job.dump_folder", str(tmp_path / name)]
        forked_ranks.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(ROOT / "train.py"), *args], check=True,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1",
                                        "FLCE_TEST_NAN_STEPS": "2", **env}, timeout=300)
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    one_rank, every_rank = run_2("one_rank", FLCE_TEST_NAN_RANK="1"), run_2("every_rank")
    assert [(r["step"], r["bad_steps"]) for r in one_rank] == [(1, 0), (2, 1), (3, 1)]
    assert math.isfinite(one_rank[1]["grad_norm"])  # the gradients were finite
    assert abs(one_rank[2]["loss"] - every_rank[2]["loss"]) <= 1e-6
