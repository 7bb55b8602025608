"""The trainer end to end on the CPU: the debug config trains, metrics are written, fused and
unfused losses agree, non-finite steps follow the configured policy, torchrun with gloo works."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import train

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--config", str(ROOT / "configs/debug.toml"), "--training.device", "cpu",
         "--training.seq_len", "64",
         "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--job.print_config",
         "false", "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2"]


def run(tmp_path, name, *overrides):
    dump = tmp_path / name
    code = train.main(SMALL + ["--job.dump_folder", str(dump), *overrides])
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return code, dump, rows


def test_debug_config_trains_and_writes_metrics(tmp_path):
    code, dump, rows = run(tmp_path, "run", "--training.steps", "30", "--validation.enable",
                           "true", "--validation.freq", "30", "--validation.steps", "2")
    assert code == 0
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for key in ("loss", "grad_norm", "lr", "tokens_per_second", "tokens_per_second_total",
                "step_seconds", "data_wait_seconds", "time"):
        assert all(key in r for r in steps), key
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0  # byte-level loss falls from ~6.2
    val = [r for r in rows if "val_loss" in r]
    assert len(val) == 1 and val[0]["step"] == 30 and 0 < val[0]["val_loss"] < steps[0]["loss"]
    assert (dump / "config.toml").read_text().count("steps = 30") == 1


def test_fused_and_unfused_losses_agree(tmp_path):
    """Same seed and data: equal at step 1, within 1e-4 after 50 steps (fp32)."""
    curves = {}
    for impl in ("flce", "unfused", "torch_chunked"):
        code, _, rows = run(tmp_path, impl, "--training.steps", "50", "--loss.impl", impl,
                            "--loss.label_smoothing", "0.05")
        assert code == 0
        curves[impl] = [r["loss"] for r in rows]
    for impl in ("unfused", "torch_chunked"):
        assert abs(curves[impl][0] - curves["flce"][0]) <= 1e-6
        assert max(abs(a - b) for a, b in zip(curves[impl], curves["flce"])) <= 1e-4


def test_float8_loss_trains_near_the_fused_loss(tmp_path):
    """[loss] float8 end to end (fp32 on the CPU: the float8 GEMMs round x, W and dlogits to
    e4m3, the logits to bf16): the curve stays near the fused loss's (0.006 apart at most over
    30 steps when measured)."""
    curves = {}
    for float8 in ("none", "logits+dx"):
        code, _, rows = run(tmp_path, float8, "--training.steps", "12", "--loss.float8", float8)
        assert code == 0
        curves[float8] = [r["loss"] for r in rows]
    assert max(abs(a - b) for a, b in zip(curves["logits+dx"], curves["none"])) <= 0.03
    assert curves["logits+dx"][-1] < curves["logits+dx"][0] - 0.5


@pytest.mark.parametrize("policy,expected_logged_steps", [("stop", 1), ("skip", 3)])
def test_non_finite_loss_policy(tmp_path, policy, expected_logged_steps):
    # A logit scale of 1e38 overflows fp32: every step's loss is non-finite.
    code, _, rows = run(tmp_path, policy, "--training.steps", "10", "--loss.logit_scale",
                        "1e38", "--training.nan_policy", policy, "--training.max_bad_steps", "3")
    assert code == 1
    assert len(rows) == expected_logged_steps


def test_torchrun_gloo_two_processes_match_one(tmp_path):
    """FSDP over 2 CPU processes (gloo): the same losses as one process (fp32). Synthetic
    tokens are drawn per global window, so 2 x 2 windows are the 4 windows of one process."""
    args = SMALL + ["--training.steps", "5", "--training.local_batch_size", "2",
                    "--data.synthetic", "true"]
    single_dump = tmp_path / "single"
    assert train.main(args + ["--job.dump_folder", str(single_dump),
                              "--training.local_batch_size", "4"]) == 0
    dist_dump = tmp_path / "dist"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", str(ROOT / "train.py"), *args,
                    "--job.dump_folder", str(dist_dump)], check=True, cwd=ROOT, env=env,
                   timeout=300)
    load = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    single, both = load(single_dump), load(dist_dump)
    assert len(single) == len(both) == 5
    for key in ("loss", "grad_norm"):
        assert max(abs(a[key] - b[key]) for a, b in zip(single, both)) <= 1e-5, key


def test_profiling_writes_a_trace(tmp_path):
    code, dump, _ = run(tmp_path, "prof", "--training.steps", "4", "--profiling.enable_profiling",
                        "true", "--profiling.profile_freq", "2")
    assert code == 0
    traces = list((dump / "profile_traces").glob("step-*/rank-0.json"))
    assert traces and json.loads(traces[0].read_text())["traceEvents"]
    # summarize_trace.py lists GPU kernels; a CPU trace has none, which it says.
    summary = subprocess.run([sys.executable, str(ROOT / "scripts/summarize_trace.py"),
                              str(traces[0])], capture_output=True, text=True)
    assert summary.returncode != 0 and "no GPU kernel events" in summary.stderr


def test_trace_summary_groups_kernels_by_name():
    sys.path.insert(0, str(ROOT / "scripts"))
    from summarize_trace import kernel_totals
    events = [{"ph": "X", "cat": "kernel", "name": "gemm_abc", "dur": 5.0},
              {"ph": "X", "cat": "kernel", "name": "gemm_abd", "dur": 2.5},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9.0},
              {"ph": "X", "cat": "kernel", "name": "softmax", "dur": 1.0}]
    totals = kernel_totals({"traceEvents": events}, width=4)
    assert {k: tuple(v) for k, v in totals.items()} == {"gemm": (7.5, 2), "soft": (1.0, 1)}


def test_device_and_attention_choices_fail_clearly(tmp_path):
    from models.sdpa import set_sdpa_backend
    import torch
    with pytest.raises(ValueError, match=r"sdpa_backend = 'cudnn' selects a CUDA kernel"):
        set_sdpa_backend("cudnn", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"sdpa_backend = 'fast'"):
        set_sdpa_backend("fast", torch.device("cpu"))
    torch.backends.cuda.enable_flash_sdp(False)  # as an earlier "cudnn" run would leave it
    set_sdpa_backend("auto", torch.device("cpu"))
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"\[training\] device = \"cuda\""):
            train.main(SMALL + ["--training.device", "cuda", "--job.dump_folder", str(tmp_path)])


def test_a_failed_run_leaves_no_process_group_behind(tmp_path):
    import torch.distributed as dist
    # Fails after the process group exists (a CUDA host) or before (the CPU): either way the next
    # run in this process must be able to start.
    with pytest.raises(ValueError, match="vocab_size"):
        train.main(SMALL + ["--model.vocab_size", "3", "--job.dump_folder", str(tmp_path / "a")])
    assert not dist.is_initialized()
    code, _, rows = run(tmp_path, "b", "--training.steps", "3")
    assert code == 0 and rows
