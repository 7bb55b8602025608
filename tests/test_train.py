"""The trainer end to end on the CPU: the debug config trains, metrics are written, fused and
unfused losses agree, torchrun with gloo works, a resumed run follows its own optimizer config.
Non-finite steps are in test_train_non_finite.py, stop signals in test_train_signals.py."""

import json
import tomllib
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import train
from components.config.parse import refusal_line
from components.config.schema import ConfigError
from components.optim import lr_multiplier
from installed import needs_wandb
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread)

ROOT = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = str(ROOT / "configs/debug.toml")
OVERRIDES = ["--training.device", "cpu", "--training.seq_len", "64",
             "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--job.print_config",
             "false", "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2"]
SMALL = ["--config", DEBUG_CONFIG, *OVERRIDES]


def run(tmp_path, name, *overrides):
    dump = tmp_path / name
    code = train.main(SMALL + ["--job.dump_folder", str(dump), *overrides])
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return code, dump, rows


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_run_imports_only_what_it_uses(tmp_path):
    """Every rank of every run starts by importing the trainer: a run on synthetic windows (or
    token shards) does not import Hugging Face `datasets` (0.7 s a process, pandas with it)."""
    code = ("import sys, train; "
            f"assert train.main({SMALL + ['--data.synthetic', 'true', '--training.steps', '1']!r}"
            f" + ['--job.dump_folder', {str(tmp_path / 'run')!r}]) == 0; "
            "print([m for m in ('datasets', 'pandas') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
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


def test_float8_loss_trains_near_the_fused_loss(tmp_path, float8_at_any_size):
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


def test_logged_lr_is_the_lr_each_step_used(tmp_path):
    code, _, rows = run(tmp_path, "lr", "--training.steps", "6")
    assert code == 0
    assert [r["lr"] for r in rows] == pytest.approx(
        [3e-3 * lr_multiplier(step, 2, 6, "cosine", 0.1) for step in range(1, 7)])


def test_a_run_shorter_than_its_warmup_fits_the_schedule_into_it(tmp_path, capsys):
    """`--training.steps 3` under a config that warms up over 20 steps runs (it used to stop
    after building the model): the warmup ends one step before the run, with a warning."""
    code, _, rows = run(tmp_path, "short", "--training.steps", "3",
                        "--lr_scheduler.warmup_steps", "20")
    assert code == 0
    assert [r["lr"] for r in rows] == pytest.approx(
        [3e-3 * lr_multiplier(step, 2, 3, "cosine", 0.1) for step in (1, 2, 3)])
    assert ("warning: [lr_scheduler] warmup_steps = 20 does not fit in [training] steps = 3: "
            "warming up over 2 step(s)") in capsys.readouterr().out


@pytest.mark.parametrize("override,match", [
    (["--optimizer.lr", "-1"], r"\[optimizer\] lr = -1.0"),
    (["--optimizer.beta2", "1.5"], r"\[optimizer\] beta2"),
    (["--lr_scheduler.decay_ratio", "1.5"], r"\[lr_scheduler\] decay_ratio = 1.5"),
    (["--lr_scheduler.min_lr_factor", "2"], r"\[lr_scheduler\] min_lr_factor"),
    (["--lr_scheduler.min_lr_ratio", "2"], r"\[lr_scheduler\] min_lr_factor"),
    (["--checkpoint.enable", "true", "--checkpoint.load_step", "4"],
     r"\[checkpoint\] load_step = 4, but .* holds no complete checkpoint"),
])
def test_setting_errors_come_before_the_model_is_built(tmp_path, monkeypatch, override, match):
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        train.main(SMALL + ["--job.dump_folder", str(tmp_path), *override])


def test_a_missing_metrics_backend_is_named_before_the_model_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an uninstalled package looks like
    with pytest.raises(ImportError, match=r"\[metrics\] enable_wandb is set but wandb does not import"):
        train.main(SMALL + ["--job.dump_folder", str(tmp_path), "--metrics.enable_wandb", "true"])


def test_the_run_ends_with_a_summary_and_logs_each_save(tmp_path, capsys):
    code, dump, _ = run(tmp_path, "sum", "--training.steps", "4", "--validation.enable", "true",
                        "--validation.freq", "2", "--validation.steps", "1",
                        "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                        "--job.description", "lr sweep, run 3")
    assert code == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    best = min(val, key=val.get)
    for step in (2, 4):
        assert re.search(rf"^checkpoint: step {step} saved to {dump}/checkpoint/step-{step} in "
                         r"\d+\.\d s$", out, re.M), out
    summary = out[out.index("\ndone: "):].splitlines()[1:]
    assert re.fullmatch(r"done: steps 1-4 of 4 in 0:\d\d:\d\d, 1,024 tokens", summary[0])
    assert summary.pop(1) == "  run: lr sweep, run 3"  # [job] description, at the start too
    assert re.search(r"^run: lr sweep, run 3\nmodel llama3 debug: [\d,]+ parameters", out, re.M)
    assert summary[1] == (f"  final loss {rows[-2]['loss']:.4f} (step 4), validation loss "
                          f"{val[4]:.4f} (step 4), best {val[best]:.4f} (step {best})")
    assert summary[2:] == [f"  metrics: {dump}/metrics.jsonl",
                           f"  checkpoints: {dump}/checkpoint (latest step-4)"]
    assert "tok/s/device" in out


def test_a_fresh_run_starts_a_new_metrics_file_and_a_resumed_one_appends(tmp_path, capsys):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    run(tmp_path, "r", "--training.steps", "3", *ckpt)
    code, dump, rows = run(tmp_path, "r", "--training.steps", "4", *ckpt)  # resumes at step 4
    assert code == 0 and [r["step"] for r in rows] == [1, 2, 3, 4]
    capsys.readouterr()
    code, dump, rows = run(tmp_path, "r", "--training.steps", "3")  # a fresh run, same folder
    assert code == 0 and [r["step"] for r in rows] == [1, 2, 3]
    (earlier,) = dump.glob("metrics.*.jsonl")
    assert [json.loads(line)["step"] for line in earlier.read_text().splitlines()] == [1, 2, 3, 4]
    assert (f"{dump}/metrics.jsonl held an earlier run's metrics: renamed metrics.jsonl to "
            f"{earlier.name}, config.toml to config.{earlier.name[8:-6]}.toml;"
            in capsys.readouterr().out)
    steps = lambda name: tomllib.loads((dump / name).read_text())["training"]["steps"]  # noqa: E731
    assert steps(f"config.{earlier.name[8:-6]}.toml") == 4 and steps("config.toml") == 3


def test_a_resume_with_no_step_left_writes_over_nothing(tmp_path, capsys):
    """Launched again after its last step (another lr on the command line), the run trained
    nothing but wrote its own config.toml over the one that made the metrics, and an empty
    TensorBoard file."""
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "3",
            "--metrics.enable_tensorboard", "true", "--training.steps", "3"]
    run(tmp_path, "r", *ckpt)
    dump = tmp_path / "r"
    config, events = (dump / "config.toml").read_text(), sorted((dump / "tb").iterdir())
    capsys.readouterr()
    code, _, rows = run(tmp_path, "r", *ckpt, "--optimizer.lr", "0.5")
    assert code == 0 and [r["step"] for r in rows] == [1, 2, 3]
    assert "done: no step left to train (resumed after step 3 of 3)" in capsys.readouterr().out
    assert (dump / "config.toml").read_text() == config
    assert sorted((dump / "tb").iterdir()) == events
    (dump / "config.toml").unlink()  # every run leaves a config.toml
    assert run(tmp_path, "r", *ckpt, "--optimizer.lr", "0.5")[0] == 0
    assert "lr = 0.5" in (dump / "config.toml").read_text()


def test_a_resumed_run_does_not_append_to_another_runs_metrics(tmp_path, capsys):
    """A run checkpointed to step 4, then a fresh run in the same folder without checkpoints
    (its metrics.jsonl steps 1-2), then the first resumed: it appended steps 5-6 to the fresh
    run's file, two runs' lines in one."""
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "4"]
    run(tmp_path, "r", "--training.steps", "4", *ckpt)
    run(tmp_path, "r", "--training.steps", "2")
    fresh = (tmp_path / "r" / "metrics.jsonl").read_text()
    capsys.readouterr()
    code, dump, rows = run(tmp_path, "r", "--training.steps", "6", *ckpt)
    assert code == 0 and [r["step"] for r in rows] == [5, 6]
    (aside,) = [p for p in dump.glob("metrics.*.jsonl") if p.read_text() == fresh]
    assert (f"{dump}/metrics.jsonl held another run's metrics (its first line is not this run's, "
            f"resumed at step 5): renamed metrics.jsonl to {aside.name}") in capsys.readouterr().out
    code, dump, rows = run(tmp_path, "r", "--training.steps", "8", *ckpt)  # its own file: appended
    assert code == 0 and [r["step"] for r in rows] == [5, 6, 7, 8]


@pytest.mark.slow
@needs_wandb
def test_a_single_process_run_exits_through_the_interpreter(tmp_path):
    """Only a process that used gloo with several ranks skips the interpreter's teardown: a
    plain run's atexit handlers run (wandb's among them: an offline run's history is written)."""
    dump = tmp_path / "exit"
    code = ("import atexit, runpy, sys; atexit.register(print, 'atexit ran'); "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "train.py"), *SMALL,
                             "--training.steps", "3", "--job.dump_folder", str(dump),
                             "--metrics.enable_wandb", "true"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.endswith("atexit ran\n"), result.stdout
    (wandb_run,) = (dump / "wandb").glob("offline-run-*")
    assert f"  wandb (offline): {wandb_run}; upload it with: wandb sync {wandb_run}\n" in \
        result.stdout
    (history,) = wandb_run.glob("run-*.wandb")
    assert b"grad_norm" in history.read_bytes()


def test_resume_follows_the_changed_optimizer_config(tmp_path, capsys):
    """The checkpoint brings back the moments and step counts; lr, betas, eps, weight decay and
    the schedule's peak come from the resumed run's config, and the log names what changed."""
    ckpt = ["--training.steps", "6", "--checkpoint.enable", "true",
            "--checkpoint.interval", "3"]
    code, _, first = run(tmp_path, "first", *ckpt)
    assert code == 0

    def resume(name, *overrides):
        shutil.copytree(tmp_path / "first/checkpoint/step-3", tmp_path / name / "checkpoint/step-3")
        capsys.readouterr()
        code, _, rows = run(tmp_path, name, *ckpt, *overrides)
        assert code == 0 and [r["step"] for r in rows] == [4, 5, 6]
        return rows, capsys.readouterr().out

    plain, out = resume("plain")
    assert [r["loss"] for r in plain] == [r["loss"] for r in first[3:]]  # exact resume
    assert "resumed from" in out and "[optimizer]" not in out
    changed, out = resume("changed", "--optimizer.lr", "1e-5", "--optimizer.beta2", "0.99")
    assert [r["lr"] for r in changed] == pytest.approx(
        [1e-5 * lr_multiplier(step, 2, 6, "cosine", 0.1) for step in (4, 5, 6)])
    assert all(a["loss"] != b["loss"] for a, b in zip(changed[1:], plain[1:]))
    assert "  [optimizer] lr: 0.003 -> 1e-05\n" in out
    assert "  [optimizer] beta2: 0.95 -> 0.99\n" in out


@pytest.mark.slow
@needs_wandb
def test_torchrun_gloo_two_processes_match_one(tmp_path):
    """FSDP over 2 CPU processes (gloo): the same losses as one process (fp32). Synthetic
    tokens are drawn per global window, so 2 x 2 windows are the 4 windows of one process."""
    # 20 warmup steps in a 5-step run: fitted into it on every rank, as with one process
    args = SMALL + ["--training.steps", "5", "--training.local_batch_size", "2",
                    "--data.synthetic", "true", "--lr_scheduler.warmup_steps", "20"]
    single_dump = tmp_path / "single"
    assert train.main(args + ["--job.dump_folder", str(single_dump),
                              "--training.local_batch_size", "4"]) == 0
    dist_dump = tmp_path / "dist"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", str(ROOT / "train.py"), *args,
                    "--job.dump_folder", str(dist_dump), "--metrics.enable_wandb", "true"],
                   check=True, cwd=ROOT, env=env, timeout=300)
    load = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    single, both = load(single_dump), load(dist_dump)
    assert len(single) == len(both) == 5
    for key in ("loss", "grad_norm"):
        assert max(abs(a[key] - b[key]) for a, b in zip(single, both)) <= 1e-5, key
    # These processes leave through os._exit (components/process.py): only once wandb's
    # offline run is written out.
    (history,) = (dist_dump / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"grad_norm" in history.read_bytes()


def test_profiling_writes_a_trace(tmp_path):
    code, dump, _ = run(tmp_path, "prof", "--training.steps", "4", "--profiling.enable_profiling",
                        "true", "--profiling.profile_freq", "2")
    assert code == 0
    traces = list((dump / "profile_traces").glob("step-*/rank-0.json"))
    assert traces and json.loads(traces[0].read_text())["traceEvents"]
    # summarize_trace.py lists GPU kernels; a CPU trace has none, which it says.
    summary = subprocess.run([sys.executable, "-m", "scripts.bench.summarize_trace",
                              str(traces[0])], capture_output=True, text=True, cwd=ROOT)
    assert summary.returncode != 0 and "no GPU kernel events" in summary.stderr


@pytest.mark.parametrize("freq,steps,profiled", [(1, 3, [1, 2, 3]), (3, 5, [3]), (2, 5, [2, 4])])
def test_profiling_traces_every_profile_freq_th_step_and_nothing_after(tmp_path, freq, steps,
                                                                       profiled):
    """profile_freq 1 profiled every other step (a warm-up step in each cycle); and a run that
    ended in a warm-up step wrote a trace named after its last step holding only the time after
    the loop (no matmul, no optimizer)."""
    code, dump, _ = run(tmp_path, "prof", "--training.steps", str(steps),
                        "--profiling.enable_profiling", "true", "--profiling.profile_freq",
                        str(freq))
    assert code == 0
    folders = sorted(int(p.name[5:]) for p in (dump / "profile_traces").glob("step-*"))
    assert folders == profiled
    for step in profiled:
        names = {e.get("name", "") for e in json.loads(
            (dump / "profile_traces" / f"step-{step}" / "rank-0.json").read_text())["traceEvents"]}
        assert any("mm" in n for n in names), step  # a step's work, not the loop's end


def test_a_fresh_run_sets_the_earlier_runs_profile_traces_aside(tmp_path):
    """A second run in the same dump folder mixed its traces with the earlier run's (step-2 and
    step-4 of one run beside step-3 of the next) or overwrote those of the same steps."""
    profile = ["--profiling.enable_profiling", "true", "--profiling.profile_freq"]
    assert run(tmp_path, "prof", "--training.steps", "5", *profile, "2")[0] == 0
    assert run(tmp_path, "prof", "--training.steps", "3", *profile, "3")[0] == 0
    dump = tmp_path / "prof"
    assert sorted(p.name for p in (dump / "profile_traces").iterdir()) == ["step-3"]
    (aside,) = dump.glob("profile_traces.*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-2", "step-4"]
    assert aside.name.split(".", 1)[1] == next(dump.glob("metrics.*.jsonl")).name.split(".")[1]


def test_trace_summary_groups_kernels_by_name():
    from scripts.bench.summarize_trace import kernel_totals
    events = [{"ph": "X", "cat": "kernel", "name": "gemm_abc", "dur": 5.0},
              {"ph": "X", "cat": "kernel", "name": "gemm_abd", "dur": 2.5},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9.0},
              {"ph": "X", "cat": "kernel", "name": "softmax", "dur": 1.0}]
    totals = kernel_totals({"traceEvents": events}, width=4)
    assert {k: tuple(v) for k, v in totals.items()} == {"gemm": (7.5, 2), "soft": (1.0, 1)}


def test_trace_report_sums_kinds_and_names_its_sources(tmp_path, monkeypatch):
    """Each kernel counts once, under the first kind its name matches; the report records the
    trace, the command that made it and its own command."""
    from scripts.bench import summarize_trace
    names = {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop": 7.0, "nvjet_tst_128x256": 5.0,
             "flce_rows_kernel": 2.0, "multi_tensor_apply_kernel<adam>": 1.5,
             "ncclDevKernel_ReduceScatter": 1.0, "triton_red_fused_rms_norm": 0.5}
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": 1e5 * (i + len(names) * k), "dur": us * 1e3}
              for k in range(2) for i, (n, us) in enumerate(names.items())]
    trace = tmp_path / "rank-0.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "profile"
    monkeypatch.setattr(sys, "argv", ["summarize_trace", str(trace), "--top", "3", "--out",
                                      str(out), "--trace-command", "python3 train.py --x 1"])
    summarize_trace.main()
    report = json.loads(out.with_suffix(".json").read_text())
    kinds = {k["kind"]: k["ms"] for k in report["kinds"]}
    assert kinds == pytest.approx({"attention": 14.0, "GEMM": 10.0, "loss (flce kernels)": 4.0,
                                   "optimizer and gradient norm": 3.0, "collectives": 2.0,
                                   "the rest (norms, activations, casts, copies)": 1.0})
    assert sum(k["share"] for k in report["kinds"]) == pytest.approx(1.0)
    assert [k["calls"] for k in report["top"]] == [2, 2, 2] and len(report["top"]) == 3
    meta = report["meta"]
    assert meta["trace"] == str(trace) and meta["trace_command"] == "python3 train.py --x 1"
    # the timeline: kernels 100 ms apart, the collective alone, the rest idle
    tl = report["timeline"]
    assert (tl["step_ms"], tl["busy_ms"]) == (pytest.approx(1100.5), pytest.approx(32.0))
    assert tl["collectives_alone_ms"] == pytest.approx(2.0) and tl["gaps"] == 11
    assert "collectives alone" in out.with_suffix(".md").read_text()
    assert "python3 train.py --x 1" in out.with_suffix(".md").read_text()


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
        with pytest.raises(ConfigError, match=r"\[training\] device = \"cuda\""):
            train.main(SMALL + ["--training.device", "cuda", "--job.dump_folder", str(tmp_path)])


def test_the_allocator_default_keeps_a_users_setting():
    from components.allocator import ALLOCATOR_SETTINGS, default_allocator_settings
    env = {"PATH": "/bin"}
    default_allocator_settings(env)
    assert env == {"PATH": "/bin", "PYTORCH_ALLOC_CONF": ALLOCATOR_SETTINGS}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        env = {name: "expandable_segments:False"}
        default_allocator_settings(env)
        assert env == {name: "expandable_segments:False"}


@pytest.mark.slow
@pytest.mark.parametrize("user_setting", [None, "expandable_segments:False"])
def test_a_cuda_run_grows_its_segments_in_place_unless_its_user_says_otherwise(tmp_path,
                                                                               user_setting):
    import torch
    from components.allocator import ALLOCATOR_ENV
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = SMALL + ["--training.device", "cuda", "--training.steps", "2",
                    "--job.dump_folder", str(tmp_path / "run")]
    code = ("import torch, train; "
            f"assert train.main({args!r}) == 0; "
            "x = torch.empty(1 << 20, device='cuda'); "
            "print('EXPANDABLE', sorted({s['is_expandable'] for s in torch.cuda.memory_snapshot()}))")
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}
    if user_setting:
        env["PYTORCH_ALLOC_CONF"] = user_setting
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"EXPANDABLE [{user_setting is None}]" in out.stdout


def test_a_deterministic_run_sets_the_cublas_workspace_torch_asks_for(tmp_path, monkeypatch):
    """Under deterministic algorithms torch refuses a CUDA matmul unless CUBLAS_WORKSPACE_CONFIG
    was set before the first cuBLAS call; nothing set it, so [training] deterministic = true
    failed at the first step on a GPU. A user's own value stays."""
    import torch
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded, so teardown restores it...
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")  # ...from what train.main sets below
    try:
        steps = ["--training.steps", "1", "--training.deterministic", "true"]
        assert run(tmp_path, "a", *steps)[0] == 0
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        assert run(tmp_path, "b", *steps)[0] == 0
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:  # process-wide: the other tests of this worker run as before
        torch.use_deterministic_algorithms(False)


def test_a_run_leaves_torchs_deterministic_mode_as_it_found_it(tmp_path, monkeypatch):
    """train.main called in a process that goes on (a notebook, a sweep): a deterministic run
    left torch's deterministic mode on, so the caller's next op without a deterministic kernel
    raised; the caller's own mode (here warn-only) stays through a run that turns it off."""
    import torch
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # undone by monkeypatch's teardown
    one_step = ["--training.steps", "1", "--training.deterministic"]
    try:
        assert run(tmp_path, "a", *one_step, "true")[0] == 0
        assert not torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert run(tmp_path, "b", *one_step, "false")[0] == 0
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:  # process-wide: the other tests of this worker run as before
        torch.use_deterministic_algorithms(False)


@pytest.mark.slow
def test_a_deterministic_cuda_run_trains_and_repeats_itself(tmp_path):
    """The same in a fresh process on a GPU (cuBLAS reads the variable once): two deterministic
    runs of the same seed log the same losses, bit for bit."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    losses = []
    for name in ("a", "b"):
        args = SMALL + ["--training.device", "cuda", "--training.steps", "3",
                        "--training.deterministic", "true", "--job.dump_folder",
                        str(tmp_path / name)]
        out = subprocess.run([sys.executable, "-c", f"import train; exit(train.main({args!r}))"],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(r)["loss"] for r in rows if '"loss"' in r])
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_a_failed_run_leaves_no_process_group_behind(tmp_path):
    import torch.distributed as dist
    # Fails after the process group exists (a CUDA host) or before (the CPU): either way the next
    # run in this process must be able to start.
    with pytest.raises(ValueError, match=r"\[model\] vocab_size 3 is smaller than the "
                       r"tokenizer's 259 ids: set --model.vocab_size 259 or more"):
        train.main(SMALL + ["--model.vocab_size", "3", "--job.dump_folder", str(tmp_path / "a")])
    assert not dist.is_initialized()
    code, _, rows = run(tmp_path, "b", "--training.steps", "3")
    assert code == 0 and rows


def test_the_docs_own_data_and_tokenizer_example_runs(tmp_path, monkeypatch, capsys):
    """docs/data.md's "Your own data and tokenizer", verbatim: its train_tokenizer.py on a .jsonl,
    then its train.py command (shortened here), which finds the bos/eos and says so."""
    section = (ROOT / "docs/data.md").read_text().split("### Your own data and tokenizer")[1]
    script = section.split("```python\n")[1].split("```")[0]
    command = section.split("```bash\n")[1].split("```")[0].replace("\\\n", " ")
    argv = shlex.split(next(line for line in command.splitlines() if " train.py " in line))
    argv = argv[argv.index("train.py") + 1:]
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    with open(tmp_path / "my_corpus.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=60))}) + "\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train_tokenizer.py").write_text(script)
    subprocess.run([sys.executable, "train_tokenizer.py"], check=True, timeout=120)
    argv[argv.index("--config") + 1] = DEBUG_CONFIG
    assert train.main([*argv, *OVERRIDES, "--training.steps", "3",
                       "--data.cache_dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "tokenizer my_tokenizer.json: " in out and "bos '<s>' (id 0, a common name)" in out
    assert (tmp_path / "outputs/mine/metrics.jsonl").is_file()


@needs_wandb
def test_a_project_name_wandb_refuses_is_a_config_error_before_anything_moves(tmp_path):
    """[metrics] wandb_project = "a/b" was a wandb UsageError traceback after the model was
    built, once the earlier run's metrics.jsonl and config.toml had been set aside."""
    code, dump, rows = run(tmp_path, "r", "--training.steps", "2")
    before = sorted(p.name for p in dump.iterdir())
    with pytest.raises(ValueError) as refused:
        train.main(SMALL + ["--job.dump_folder", str(dump), "--training.steps", "2",
                            "--metrics.enable_wandb", "true", "--metrics.wandb_project", "a/b"])
    assert refusal_line(refused.value).startswith(
        "config error: [metrics] wandb_project = 'a/b': wandb refuses it (Invalid project name")
    assert sorted(p.name for p in dump.iterdir()) == before
