"""MetricsLogger's outputs (jsonl, stdout, offline wandb, TensorBoard), StepMeter, FLOP counts."""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from components.config.schema import Metrics
from components.metrics import (MetricsLogger, StepMeter, bits_per_byte, peak_flops,
                                peak_flops_for_name)
from installed import needs_wandb

ROOT = Path(__file__).resolve().parents[1]

FULL_STEP_METRICS = {"loss": 3.45123, "grad_norm": 1.234, "lr": 3e-4, "tokens_per_second": 12345.4,
                     "mfu_percent": 41.23, "memory_max_reserved_gib": 10.24}


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_has_one_object_per_log_call(tmp_path):
    folder = tmp_path / "run"
    with MetricsLogger(folder, rank=0, total_steps=10) as logger:
        before = time.time()
        logger.log(1, {"loss": torch.tensor(2.5), "lr": 1e-4, "mfu_percent": None})
        logger.log(2, {"loss": 2.25, "grad_norm": torch.tensor(float("inf")), "tokens": 7})
        # flushed per line: readable before close()
        assert len(_read_jsonl(folder / "metrics.jsonl")) == 2
    first, second = _read_jsonl(folder / "metrics.jsonl")
    assert before <= first.pop("time") <= time.time()
    assert first == {"step": 1, "loss": 2.5, "lr": 1e-4}  # None: left out
    assert second["step"] == 2 and second["loss"] == 2.25 and second["tokens"] == 7.0
    assert second["grad_norm"] is None  # non-finite: null, so the line stays valid JSON


def test_jsonl_is_appended_to_on_resume(tmp_path):
    for step in (1, 2):
        with MetricsLogger(tmp_path, rank=0, total_steps=10, resumed=step > 1) as logger:
            logger.log(step, {"loss": 1.0})
    assert [r["step"] for r in _read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_a_fresh_run_sets_an_earlier_runs_jsonl_aside(tmp_path, capsys):
    for run in range(3):  # the same second: the names must still differ
        with MetricsLogger(tmp_path, rank=0, total_steps=10) as logger:
            logger.log(1, {"loss": float(run)})
            logger.log(2, {"loss": float(run)})
    assert [r["loss"] for r in _read_jsonl(tmp_path / "metrics.jsonl")] == [2.0, 2.0]
    earlier = sorted(tmp_path.glob("metrics.*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    assert len(earlier) == 2
    assert {r["loss"] for p in earlier for r in _read_jsonl(p)} == {0.0, 1.0}
    assert re.fullmatch(r"metrics\.\d{8}-\d{6}(-2)?\.jsonl", earlier[1].name)
    out = capsys.readouterr().out
    assert out.count("held an earlier run's metrics: renamed metrics.jsonl to metrics.") == 2


def test_the_earlier_runs_config_and_tensorboard_events_go_aside_with_its_metrics(tmp_path,
                                                                                 capsys):
    """A fresh run in a used dump folder kept the earlier run's metrics (renamed) but wrote its
    own config.toml over the one that said what made them, and its TensorBoard events went into
    the same tb/, one mixed curve of both runs."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (tmp_path / "config.toml").write_text("# the earlier run's\n")
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1").write_text("earlier")
    (tmp_path / "config.20000101-000000.toml").write_text("# older still\n")
    with MetricsLogger(tmp_path, rank=0, total_steps=10):
        pass
    stamp = re.fullmatch(r"metrics\.(\d{8}-\d{6})\.jsonl",
                         next(tmp_path.glob("metrics.*.jsonl")).name).group(1)
    assert (tmp_path / f"config.{stamp}.toml").read_text() == "# the earlier run's\n"
    assert (tmp_path / f"tb.{stamp}" / "events.out.tfevents.1").read_text() == "earlier"
    assert not (tmp_path / "config.toml").exists() and not (tmp_path / "tb").exists()
    assert (tmp_path / "config.20000101-000000.toml").read_text() == "# older still\n"
    assert (f"renamed metrics.jsonl to metrics.{stamp}.jsonl, config.toml to config.{stamp}.toml, "
            f"tb to tb.{stamp};") in capsys.readouterr().out


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_names_the_metrics_file_and_the_free_space(tmp_path):
    """Writing metrics.jsonl on a full disk (here /dev/full, where every write fails with
    ENOSPC) was a bare OSError from metrics.py."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    metrics = MetricsLogger(tmp_path, rank=0, total_steps=10)
    with pytest.raises(OSError, match=rf"\[metrics\] writing {tmp_path}/metrics.jsonl failed "
                                      r"\(No space left on device\); \d+\.\d GiB free"):
        metrics.log(1, {"loss": 2.0})
    metrics.close()


def test_summary_values_are_the_last_and_lowest(tmp_path):
    with MetricsLogger(tmp_path, rank=0, total_steps=10) as logger:
        for step, val in ((2, 3.0), (4, 2.5), (6, float("nan")), (8, 2.75)):
            logger.log(step, {"val_loss": val})
    assert logger.last["val_loss"] == (8, 2.75) and logger.lowest["val_loss"] == (4, 2.5)


def test_only_rank_zero_writes(tmp_path, capsys):
    folder = tmp_path / "run"
    logger = MetricsLogger(folder, rank=1, total_steps=10,
                           cfg=Metrics(enable_wandb=True, enable_tensorboard=True))
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not folder.exists()
    assert capsys.readouterr().out == ""


def test_stdout_line_format_and_eta(tmp_path, capsys):
    with MetricsLogger(tmp_path, rank=0, total_steps=100) as logger:
        logger.log(10, FULL_STEP_METRICS)
        logger.log(12, {"loss": 3.0, "data_wait_seconds": 0.5})
    first, second = capsys.readouterr().out.splitlines()
    # No ETA yet: the step time is averaged from the first logged step on.
    assert first == ("step 10/100 | loss 3.4512 | grad_norm 1.23 | lr 3.0e-04 | "
                     "tok/s/device 12,345 | mfu 41.2% | mem 10.2 GiB")
    # Keys not present are not shown; unprinted keys (data_wait_seconds) only go to the files.
    assert re.fullmatch(r"step 12/100 \| loss 3\.0000 \| eta \d+:\d\d:\d\d", second), second


def test_the_eta_of_a_resume_that_validates_first_leaves_out_the_warm_up(tmp_path, capsys,
                                                                         monkeypatch):
    """The resumed step's validation (step 4) started the ETA's clock, so the first training
    step's warm-up (100 s here, a compile) counted as a step's time: 50.5 s a step, not 1."""
    clock = iter([1000.0, 1100.0, 1101.0])
    monkeypatch.setattr("components.metrics.time.time", lambda: next(clock))
    with MetricsLogger(tmp_path, rank=0, total_steps=1006, first_step=5) as logger:
        logger.log(4, {"val_loss": 3.0})
        logger.log(5, {"loss": 3.0})
        logger.log(6, {"loss": 3.0})
    assert capsys.readouterr().out.splitlines()[-1].endswith("| eta 0:16:40")  # 1000 steps, 1 s


def test_bad_values_and_names_are_errors(tmp_path):
    with MetricsLogger(tmp_path, rank=0, total_steps=10) as logger:
        with pytest.raises(TypeError, match=r"metric 'loss'.*shape \(2,\)"):
            logger.log(1, {"loss": torch.ones(2)})
        with pytest.raises(TypeError, match="metric 'phase'"):
            logger.log(1, {"phase": "warmup"})
        with pytest.raises(ValueError, match="metric 'step'"):
            logger.log(1, {"step": 1})
    with pytest.raises(ValueError, match=r"\[metrics\] wandb_mode = 'cloud'"):
        MetricsLogger(tmp_path, rank=0, total_steps=10, cfg=Metrics(wandb_mode="cloud"))


@needs_wandb
def test_wandb_run_is_offline_and_under_dump_folder(tmp_path, monkeypatch):
    # The logger's explicit mode must win over an environment asking for online.
    monkeypatch.setenv("WANDB_MODE", "online")
    with MetricsLogger(tmp_path, rank=0, total_steps=10,
                       cfg=Metrics(enable_wandb=True, wandb_run_name="test-run"),
                       config={"lr": 3e-4}, notes="a run's [job] description") as logger:
        logger.log(1, {"loss": 2.5, "tokens_per_second": 12345.5})
    # run.finish() returns before wandb-core has written the run file out: close() waits for it
    # (a trainer that leaves through os._exit gets no teardown at exit).
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb").iterdir())
    assert logger.wandb_dir == runs[0]
    (run_file,) = runs[0].glob("run-*.wandb")
    history = run_file.read_bytes()  # protobuf records: keys and JSON values appear verbatim
    assert b"tokens_per_second" in history and b"12345.5" in history
    assert b"a run's [job] description" in history  # the run's notes


@needs_wandb
def test_a_disabled_wandb_run_names_no_folder(tmp_path):
    """With wandb_mode = "disabled" the summary named a folder under /tmp that was never made."""
    with MetricsLogger(tmp_path, rank=0, total_steps=10,
                       cfg=Metrics(enable_wandb=True, wandb_mode="disabled")) as logger:
        logger.log(1, {"loss": 2.5})
    assert logger.wandb_dir is None


def test_wandb_missing_is_an_import_error_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an uninstalled package looks like
    with pytest.raises(ImportError, match=r"\[metrics\] enable_wandb.*pip install wandb"):
        MetricsLogger(tmp_path, rank=0, total_steps=10, cfg=Metrics(enable_wandb=True))


def put_package_missing_a_dependency(folder, name: str, monkeypatch) -> None:
    """A package `name` on the path (first) whose import fails on a module that is not installed
    (click_not_installed_here), as a wheel installed with --no-deps can be."""
    package = folder / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import click_not_installed_here\n")
    monkeypatch.syspath_prepend(str(folder))


def test_a_wandb_missing_its_dependency_names_it(tmp_path, monkeypatch):
    """A wandb installed without its dependencies (pip install --no-deps) fails on import: the
    error names the module that is missing, not just "wandb"."""
    put_package_missing_a_dependency(tmp_path / "path", "wandb", monkeypatch)
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    with pytest.raises(ImportError, match=r"wandb does not import \(No module named "
                                          r"'click_not_installed_here'\).*pip install wandb"):
        MetricsLogger(tmp_path / "run", rank=0, total_steps=10, cfg=Metrics(enable_wandb=True))


def test_the_wandb_gate_asks_whether_it_imports_not_whether_it_is_there(tmp_path, monkeypatch):
    """needs_wandb (tests/installed.py) skips where wandb does not import: a package on the path
    whose dependency is missing counts as missing (on a GPU machine the wandb tests failed on
    its import where the gate asked only whether the package was found)."""
    from installed import import_error
    put_package_missing_a_dependency(tmp_path, "broken_package_here", monkeypatch)
    assert import_error("json") is None
    assert import_error("broken_package_here") == (
        "ModuleNotFoundError: No module named 'click_not_installed_here'")


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, rank=0, total_steps=10, cfg=Metrics(enable_tensorboard=True)) as logger:
        logger.log(1, {"loss": 2.5, "lr": 1e-4})
        logger.log(2, {"loss": 2.0, "lr": 2e-4})
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.5), (2, 2.0)]


def test_step_meter_on_cpu():
    start = time.perf_counter()
    meter = StepMeter("cpu", world_size=4, flops_per_token=1e6, peak_flops_per_device=1e9)
    for _ in range(2):
        with meter.waiting_for_data():
            time.sleep(0.02)
        meter.step_done(tokens=100)
    metrics = meter.read()
    elapsed = time.perf_counter() - start  # encloses the meter's window
    assert set(metrics) == {"step_seconds", "data_wait_seconds", "tokens_per_second",
                            "tokens_per_second_total", "tflops_per_device", "mfu_percent"}
    assert 0.02 <= metrics["data_wait_seconds"] <= metrics["step_seconds"] <= elapsed / 2
    assert 200 / elapsed <= metrics["tokens_per_second"] <= 200 / 0.04
    assert metrics["tokens_per_second_total"] == pytest.approx(4 * metrics["tokens_per_second"])
    assert metrics["tflops_per_device"] == pytest.approx(1e6 * metrics["tokens_per_second"] / 1e12)
    assert metrics["mfu_percent"] == pytest.approx(100 * 1e6 * metrics["tokens_per_second"] / 1e9)

    with pytest.raises(RuntimeError, match="no step_done"):
        meter.read()  # the window restarted


def test_step_meter_leaves_out_mfu_without_a_peak():
    meter = StepMeter("cpu", world_size=1, flops_per_token=1e6,
                      peak_flops_per_device=peak_flops("cpu"))
    meter.step_done(tokens=10)
    metrics = meter.read()
    assert "mfu_percent" not in metrics and "memory_max_reserved_gib" not in metrics


def test_peak_flops():
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_name("NVIDIA H200") == 989e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("NVIDIA H100 PCIe") == 756e12  # the longer key wins
    assert peak_flops_for_name("NVIDIA GeForce RTX 4090") is None


def test_validation_line_and_bits_per_byte(tmp_path, capsys):
    # 2.0 nats per token over tokens of 4 bytes each: 2 / (4 ln 2) bits per byte
    assert bits_per_byte(2.0 * 100, 400) == pytest.approx(2.0 / (4 * math.log(2)))
    with pytest.raises(ValueError, match="0 bytes"):
        bits_per_byte(1.0, 0)
    with MetricsLogger(tmp_path, rank=0, total_steps=100, cfg=Metrics(enable_tensorboard=True)) as logger:
        logger.log(50, {"val_loss": 2.5, "val_bpb": 0.90123})
    assert capsys.readouterr().out.splitlines()[-1] == \
        "step 50/100 | val_loss 2.5000 | val_bpb 0.9012"
    assert _read_jsonl(tmp_path / "metrics.jsonl")[0]["val_bpb"] == 0.90123
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("val_bpb")] == [50]


def test_only_outputs_inside_the_dump_folder_go_aside(tmp_path):
    """A profiling folder named by an absolute path, "..", "" or "." was renamed with the
    metrics (a user's folder outside the run, or the dump folder itself: a traceback after the
    metrics had moved)."""
    dump, outside = tmp_path / "run", tmp_path / "userdata"
    (dump / "traces" / "step-2").mkdir(parents=True)
    outside.mkdir()
    (outside / "notes.txt").write_text("important")
    (dump / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    outputs = ("traces", str(outside), "../userdata", "", ".", "traces/..")
    with MetricsLogger(dump, rank=0, total_steps=10, outputs=outputs):
        pass
    assert (outside / "notes.txt").read_text() == "important"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "userdata"]
    assert not (dump / "traces").exists() and len(list(dump.glob("traces.*"))) == 1
    assert len(list(dump.glob("metrics.*.jsonl"))) == 1


def test_a_resumed_run_knows_the_best_validation_before_it(tmp_path):
    """The summary's "best" validation loss covered only the steps since the resume (14.88 at
    step 6 where the file held 6.17 at step 2)."""
    lines = [{"step": 1, "loss": 9.0}, {"step": 2, "val_loss": 2.0}, {"step": 3, "loss": 8.0},
             {"step": 4, "val_loss": 3.0}, {"step": 6, "val_loss": 1.0},  # a rollback's, gone
             {"step": 4, "val_loss": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with MetricsLogger(tmp_path, rank=0, total_steps=10, first_step=5) as metrics:
        assert metrics.lowest["val_loss"] == (2, 2.0) and metrics.last["val_loss"] == (4, 3.0)
        assert metrics.last["loss"] == (3, 8.0)
        metrics.log(5, {"val_loss": 14.0})
        assert metrics.lowest["val_loss"] == (2, 2.0) and metrics.last["val_loss"] == (5, 14.0)


def test_a_resumed_run_leaves_a_rolled_back_timeline_out_of_its_summary(tmp_path):
    """Run A validated 4.30 at step 5 and went on; run B rolled back to step 3 (load_step) and
    validated 5.29 at step 5; run C resumed B at step 7: its summary's best was A's 4.30, a
    timeline no longer in the model."""
    a = [{"step": 5, "loss": 5.0}, {"step": 5, "val_loss": 4.30}, {"step": 10, "loss": 4.0},
         {"step": 10, "val_loss": 4.10}]
    b = [{"step": 5, "loss": 6.0}, {"step": 5, "val_loss": 5.29}, {"step": 7, "loss": 5.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in a + b))
    with MetricsLogger(tmp_path, rank=0, total_steps=10, first_step=8) as metrics:
        assert metrics.lowest["val_loss"] == (5, 5.29) and metrics.last["loss"] == (7, 5.9)
        assert metrics.lowest["loss"] == (7, 5.9)
        assert metrics.recorded(5, "val_loss") and not metrics.recorded(10, "val_loss")


def test_a_resumed_run_marks_where_its_timeline_goes_back_to(tmp_path):
    """Run A logged every 10 steps to 40 and validated 3.0 at step 20; run B resumed A's step-10
    checkpoint and stopped at step 20 before validating. B's first line (step 20) went back only
    to 20: A's validation at 20 stayed in the timeline, and run C, resuming B's step 20, took it
    for B's (no validation of its resumed step; A's value in the summary), as did the scripts."""
    from scripts.lib.runs import read_metrics
    path = tmp_path / "metrics.jsonl"
    cfg = Metrics(log_freq=10)
    with MetricsLogger(tmp_path, rank=0, total_steps=40, cfg=cfg) as a:
        for step in (1, 10, 20, 30, 40):
            a.log(step, {"loss": 9.0 - step / 10, "tokens_per_second": 1.0})
            if step == 20:
                a.log(step, {"val_loss": 3.0})
    with MetricsLogger(tmp_path, rank=0, total_steps=40, cfg=cfg, first_step=11) as b:
        assert not b.recorded(20, "val_loss")
        b.log(20, {"loss": 5.0, "tokens_per_second": 2.0})
    marker = json.loads(path.read_text().splitlines()[6])
    assert (marker["step"], marker["resumed"]) == (10, True)
    with MetricsLogger(tmp_path, rank=0, total_steps=40, cfg=cfg, first_step=21) as c:
        assert not c.recorded(20, "val_loss") and "val_loss" not in c.lowest
        assert c.last["loss"] == (20, 5.0)
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 8.9), (10, 8.0),
                                                                    (20, 5.0)]
    compare = subprocess.run([sys.executable, "scripts/compare_losses.py", str(path), str(path),
                              "--metric", "val_loss"], cwd=ROOT, capture_output=True, text=True)
    assert compare.returncode == 2 and "no line has the metric 'val_loss'" in compare.stderr


def test_a_run_resumed_after_a_cut_short_line_starts_its_lines_on_a_new_line(tmp_path):
    """A run whose last metrics.jsonl line was cut short (a full disk, a kill mid-write: the
    case compare_losses skips as "a partial last line") was resumed in its folder: the resumed
    run appended its first line to the partial one, so that line was lost to every reader
    (metrics_timeline skips it) and compare_losses refused the file (a line that is not JSON
    in the middle, exit 2). The partial line stays, and the resumed run's first line says where
    it resumed (also where it abandons no logged step)."""
    from components.metrics_timeline import records
    path = tmp_path / "metrics.jsonl"
    for checkpoint, killed_at in ((4, 6), (6, 6)):
        with MetricsLogger(tmp_path, rank=0, total_steps=8) as logger:
            for step in range(1, killed_at + 1):
                logger.log(step, {"loss": 9.0 - step})
        partial = '{"step": 7, "time": 1.0, "lo'
        path.write_text(path.read_text() + partial)
        with MetricsLogger(tmp_path, rank=0, total_steps=8, first_step=checkpoint + 1) as logger:
            for step in range(checkpoint + 1, 9):
                logger.log(step, {"loss": 9.0 - step})
        lines = path.read_text().splitlines()
        assert lines[killed_at] == partial  # kept as it was
        assert json.loads(lines[killed_at + 1])["step"] == checkpoint  # {"resumed": true}
        logged = [r["step"] for r in records(path) if "loss" in r or r.get("resumed")]
        assert logged == [*range(1, killed_at + 1), *range(checkpoint, 9)]
        compare = subprocess.run([sys.executable, "scripts/compare_losses.py", str(path),
                                  str(path)], cwd=ROOT, capture_output=True, text=True)
        assert compare.returncode == 0, compare.stdout + compare.stderr
        assert (f"{path}:{killed_at + 1}: skipping a partial line, the last of a run stopped "
                "mid-write") in compare.stderr


def test_a_resume_with_nothing_abandoned_adds_no_line(tmp_path):
    with MetricsLogger(tmp_path, rank=0, total_steps=8) as a:
        for step in range(1, 5):
            a.log(step, {"loss": 1.0})
    with MetricsLogger(tmp_path, rank=0, total_steps=8, first_step=5) as b:
        b.log(5, {"loss": 1.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5]


def test_a_resumed_run_hides_the_abandoned_steps_in_tensorboard(tmp_path):
    """A run killed after step 6 and resumed from its step-4 checkpoint logged steps 5 and 6
    twice in TensorBoard, both timelines' values side by side."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = Metrics(enable_tensorboard=True)
    with MetricsLogger(tmp_path, rank=0, total_steps=8, cfg=cfg) as logger:
        for step in range(1, 7):
            logger.log(step, {"loss": 10.0 - step})
    with MetricsLogger(tmp_path, rank=0, total_steps=8, cfg=cfg, resumed=True,
                       first_step=5) as logger:
        for step in range(5, 9):
            logger.log(step, {"loss": 20.0 - step})
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("loss")]
    assert got == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 15.0), (6, 14.0), (7, 13.0),
                   (8, 12.0)]
