"""scripts/lib/: the commit a report records (a dirty tree flagged, $FLCE_GIT_REVISION honoured),
the report files, the timer, the loud first line of every benchmark's markdown, and the run
folders that scripts clear only when they made them."""

import collections
import importlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scripts.bench import attention as bench_attention, flce as bench_flce, peers as bench_peers
from scripts.bench import chunk_sizes as bench_chunk_sizes, float8_grid as bench_float8_grid
from scripts.bench import grad_gemms as bench_grad_gemms
from scripts.bench import logits_epilogue as bench_logits_epilogue
from scripts.bench import loss_kernels as bench_loss_kernels
from scripts.bench import row_order as bench_row_order
from scripts.bench import row_overlap as bench_row_overlap
from scripts.bench import tune_rows_kernel as bench_tune_rows
from scripts.lib import loss_grid, report, run_folders, timing
from scripts.lib.timing import median_ms

REPO = Path(__file__).resolve().parents[1]
PEER_RUN_LISTS = sorted((REPO / "scripts/bench/peer_runs").glob("*.args"))


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv("FLCE_GIT_REVISION", raising=False)
    git(tmp_path, "init", "-q")
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "old.md").write_text("old\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def head(repo) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_clean_tree_records_its_commit(repo):
    # Results written into benchmarks/ by earlier runs are not code: the tree stays clean.
    (repo / "benchmarks" / "new.json").write_text("{}\n")
    assert report.git_revision(repo) == {"git": head(repo), "dirty": False}


@pytest.mark.parametrize("change", ["tracked file edited", "untracked code", "staged"])
def test_a_dirty_tree_is_flagged(repo, change):
    if change == "tracked file edited":
        (repo / "train.py").write_text("print(2)\n")
    elif change == "untracked code":
        (repo / "models").mkdir()
        (repo / "models" / "new.py").write_text("x = 1\n")
    else:
        (repo / "benchmarks" / "old.md").write_text("changed\n")  # tracked, so it counts
        git(repo, "add", "benchmarks/old.md")
    assert report.git_revision(repo) == {"git": head(repo) + "+dirty", "dirty": True}


def test_the_sent_revision_wins_over_a_stale_git(repo, monkeypatch):
    """A tree copied to a GPU machine carries a stale .git: its sender names the commit."""
    (repo / "train.py").write_text("print(2)\n")
    monkeypatch.setenv("FLCE_GIT_REVISION", "0123abc")
    assert report.git_revision(repo) == {"git": "0123abc", "dirty": False}
    monkeypatch.setenv("FLCE_GIT_REVISION", "0123abc+dirty")
    assert report.git_revision(repo) == {"git": "0123abc+dirty", "dirty": True}


def test_no_git_checkout_is_an_unknown_revision(tmp_path, monkeypatch):
    monkeypatch.delenv("FLCE_GIT_REVISION", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above
    assert report.git_revision(tmp_path) == {"git": None, "dirty": None}


def test_warning_lines():
    assert report.warning_lines({"git": "abc1234", "dirty": False}) == []
    assert report.warning_lines({"git": "abc1234+dirty", "dirty": True})[0].startswith(
        "**DIRTY TREE: not reproducible from a commit** (git abc1234+dirty")
    assert report.warning_lines({"git": None, "dirty": None})[0].startswith(
        "**UNKNOWN REVISION: not reproducible from a commit**")


def test_provenance_warns_at_once(monkeypatch, capsys):
    monkeypatch.setenv("FLCE_GIT_REVISION", "abc1234+dirty")
    meta = report.provenance()
    assert meta["git"] == "abc1234+dirty" and meta["dirty"] is True and meta["date"]
    assert "warning: DIRTY TREE: not reproducible from a commit" in capsys.readouterr().err


def test_write_report_writes_both_files_whole(tmp_path):
    out = tmp_path / "deep" / "bench_x"
    report.write_report(out, {"meta": {"git": "abc"}, "results": [1.5]}, "# x\n")
    assert json.loads((tmp_path / "deep" / "bench_x.json").read_text())["results"] == [1.5]
    assert (tmp_path / "deep" / "bench_x.md").read_text() == "# x\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["bench_x.json", "bench_x.md"]


def test_the_timer_on_the_cpu():
    calls, barriers = [], []
    ms = median_ms(lambda: (calls.append(1), time.sleep(0.02)), warmup=2, reps=3, cuda=False,
                   before_each=lambda: barriers.append(1))
    assert len(calls) == 5 and len(barriers) == 3
    assert 20 <= ms < 200


DIRTY = {"git": "abc1234+dirty", "dirty": True}
CLEAN = {"git": "abc1234", "dirty": False}
# the provenance a kernel benchmark's report heads with; KERNEL_META: from a clean commit
REPORT_META = {"gpu": "G", "torch": "t", "triton": "tr", "date": "d", "command": "c"}
KERNEL_META = {**REPORT_META, **CLEAN}


def flce_report(meta):
    meta = {**REPORT_META, "dtype": "bfloat16", **meta}
    return bench_flce.markdown(meta, [{"shape": "8x4x16", "method": "flce", "ms": 1.0,
                                       "extra_mib": 2.0, "vs_gemms": 1.1}], {})


def test_flce_float8_report_says_when_the_threshold_was_lifted():
    """--ungated times the float8 GEMMs below flce's threshold (what sets it); its report says
    so, and the flag without --float8 is refused before any GPU is asked for."""
    assert "float8 ungated" in flce_report({**CLEAN, "float8": "ungated: every shape"})
    assert "ungated" not in flce_report(CLEAN)
    run = subprocess.run([sys.executable, "-m", "scripts.bench.flce", "--ungated"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 2 and "--ungated applies to --float8" in run.stderr


def test_the_compiled_peer_gets_a_graph_of_its_own_at_each_shape():
    """bench.flce times torch.compile's unfused loss as a training run (one shape) compiles it:
    a static graph per shape. It used to make the second shape of a call recompile with N and V
    symbolic (automatic dynamic shapes), and every later shape ran that generic graph."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    import flce
    torch.manual_seed(0)
    for n, h, v in ((24, 16, 40), (40, 16, 72)):
        loss = bench_flce.methods(n, h, v, sweep=False)["unfused_compile"]
        x, w = torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
        loss(x, torch.randint(0, v, (n,)), w).backward()
        graphs = _debug_get_cache_entry_list(flce.linear_cross_entropy.__code__)
        assert len(graphs) == 1, f"{len(graphs)} graphs at {n}x{h}x{v}: one recompiled"


def test_lean_paths_force_each_path_and_restore_the_bounds(monkeypatch):
    """bench.flce --lean-paths times memory_lean over token chunks and over vocabulary slices at
    one shape whichever it would take itself; both against float64, the bounds as they were."""
    import flce.vocab_sweep
    from flce_cases import float64_reference, loss_and_grads, make_inputs, rel_err
    swept, stats = [], flce.vocab_sweep.sweep_stats
    monkeypatch.setattr(flce.vocab_sweep, "sweep_stats",
                        lambda *a, **kw: swept.append(1) or stats(*a, **kw))
    bounds = flce.vocab_sweep.SWEEP_MAX_TOKENS, flce.vocab_sweep.SWEEP_MIN_WEIGHT
    paths = bench_flce.methods(67, 24, 101, sweep=False, lean=True)
    for name, sweeps in (("flce_lean_chunks", False), ("flce_lean_slices", True)):
        swept.clear()
        x, t, w, _ = make_inputs(67, 24, 101, "cpu", torch.float32, bias=False)
        loss, grads, up = loss_and_grads(lambda x, t, w, b: paths[name](x, t, w), x, t, w, None)
        assert bool(swept) == sweeps, name
        ref_loss, ref = float64_reference(x, t, w, None, up)
        assert rel_err(loss, ref_loss) <= 1e-5 and all(
            rel_err(g, r) <= 1e-5 for g, r in zip(grads, ref))
        assert (flce.vocab_sweep.SWEEP_MAX_TOKENS, flce.vocab_sweep.SWEEP_MIN_WEIGHT) == bounds


def test_a_loss_report_says_how_the_compiled_peer_was_compiled():
    """Reports written since the compiled peer got a static graph per shape say so; older ones
    (their JSON without the key) render as they were written."""
    said = "for that one shape"
    assert said in flce_report({**CLEAN, "compiled_peer": bench_flce.COMPILED_PEER})
    assert said not in flce_report(CLEAN)
    grid = json.loads((REPO / "benchmarks" / "flce_grid.json").read_text())
    meta = {**grid["meta"], "compiled_peer": bench_flce.COMPILED_PEER}
    assert said in loss_grid.grid_markdown(meta, grid["results"])


def chunk_sizes_report(meta):
    meta = {**REPORT_META, **meta}
    runs = [{"run": "default", "chunk_size": None, "path": "chunks of 8192", "ms": 11.0,
             "extra_mib": 300.0}, {"run": "c16384", "chunk_size": 16384, "path": "one block",
                                   "ms": 10.0, "extra_mib": 500.0},
            {"run": "c4096", "chunk_size": 4096, "path": "chunks of 4096", "ms": None,
             "extra_mib": None}]
    return bench_chunk_sizes.markdown(meta, [{"shape": "16384x8x16", "gemms_ms": 8.0,
                                              "runs": runs}])


def test_grad_gemms_bench_reads_its_chunks_and_sets_each_variant_beside_its_bf16_twin():
    from argparse import ArgumentTypeError
    chunks = loss_grid.parse_shapes("4096x4096x256000,8x4x2", "CxHxV")
    assert [loss_grid.parse_shape(c, "CxHxV") for c in chunks] == [(4096, 4096, 256000),
                                                                   (8, 4, 2)]
    for bad in ("4096x4096", "4096x4096x0", "ax4x2"):
        with pytest.raises(ArgumentTypeError, match=f"'{bad}' (is not CxHxV|has a size below 1)"):
            loss_grid.parse_shapes(bad, "CxHxV")
    ms = {"logits": 5.0, "dx_bf16": 4.0, "dx_fp32": 4.2, "dw_bf16_acc": 2.0, "dw_fp32_acc": 2.5,
          "dw_fp32_first": 2.2, "dwt_fp32_acc": 3.0}
    text = bench_grad_gemms.markdown(KERNEL_META, [{"chunk": "8x4x2", "ms": ms}])
    assert ("| 8x4x2 | 5.000 | 4.000 | 4.200 (1.050×) | 2.000 | 2.500 (1.250×) | 2.200 (1.100×) "
            "| 3.000 (1.500×) |") in text


def test_chunk_sizes_bench_reads_its_points_and_reports_each_run():
    from argparse import ArgumentTypeError
    form = bench_chunk_sizes.POINT
    points = loss_grid.parse_shapes("16384x1024x128256:4096/16384,8x4x2:1", form)
    assert [loss_grid.parse_shape(p, form) for p in points] == [
        (16384, 1024, 128256, [4096, 16384]), (8, 4, 2, [1])]
    for bad in ("16384x1024:4096", "16384x1024x128256", "8x4x2:0", "8x4x2:a/4"):
        with pytest.raises(ArgumentTypeError, match=f"'{bad}' (is not NxHxV:C1/C2/|has a size)"):
            loss_grid.parse_shapes(bad, form)
    # the path flce takes for a forced chunk size: N or more is the one-block path
    assert bench_chunk_sizes.path_name(16384, 1024, 128256, 16384) == "one block"
    assert bench_chunk_sizes.path_name(16384, 1024, 128256, 4096) == "chunks of 4096"
    assert bench_chunk_sizes.path_name(65536, 2048, 128256, None) == "chunks of 8192"
    text = chunk_sizes_report(CLEAN)
    assert "| 16384x8x16 | default | chunks of 8192 | 11.00 | 1.375 | 1.100 | 300 |" in text
    assert "| 16384x8x16 | c16384 | one block | 10.00 | 1.250 | 1.000 | 500 |" in text
    assert "| 16384x8x16 | c4096 | chunks of 4096 | OOM | - | - | - |" in text
    assert "host ahead" not in text  # synchronised unless asked; with --host-ahead it says so
    ahead = chunk_sizes_report({**CLEAN, **bench_flce.timing_meta(True)})
    assert bench_flce.HOST_AHEAD in ahead


def test_chunk_sizes_bench_times_each_forced_size_through_flce(monkeypatch):
    """measure_point on the CPU (its GPU timing and memory replaced): every forced chunk size and
    flce's own choice run forward+backward through the loss, and a size that runs out of memory
    is reported as such, not dropped."""
    seen = []
    real = bench_chunk_sizes.flce.fused_linear_cross_entropy

    def loss(x, t, w, chunk_size=None, memory_lean=False, float8="none"):
        seen.append((chunk_size, memory_lean) if float8 == "none" else
                    (chunk_size, memory_lean, float8))
        if chunk_size == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(x, t, w, chunk_size=chunk_size, memory_lean=memory_lean, impl="torch",
                    float8=float8)

    torch.manual_seed(0)
    monkeypatch.setattr(bench_chunk_sizes.flce, "fused_linear_cross_entropy", loss)
    monkeypatch.setattr(bench_chunk_sizes, "make_inputs", lambda N, H, V, dtype: (
        torch.randn(N, H, requires_grad=True), torch.randint(0, V, (N,)),
        torch.randn(V, H, requires_grad=True)))
    monkeypatch.setattr(bench_flce, "peak_extra_mib", lambda run, x, w: run() or 5.0)
    ahead = []
    monkeypatch.setattr(bench_chunk_sizes, "interleaved_rounds", lambda runs, s, r, host_ahead: (
        ahead.append(host_ahead) or {name: [run() or 2.0] for name, run in runs.items()}))
    point = bench_chunk_sizes.measure_point(16, 8, 12, [4, 16, 3], 0.1, 3)
    assert set(seen) == {(None, False), (4, False), (16, False), (3, False)}
    assert [(r["run"], r["path"], r["ms"], r["extra_mib"]) for r in point["runs"]] == [
        ("default", "one block", 2.0, 5.0), ("c4", "chunks of 4", 2.0, 5.0),
        ("c16", "one block", 2.0, 5.0), ("c3", "chunks of 3", None, None)]
    assert "| c3 | chunks of 3 | OOM |" in bench_chunk_sizes.markdown(
        KERNEL_META, [point])
    seen.clear()
    point = bench_chunk_sizes.measure_point(16, 8, 12, [4], 0.1, 3, lean=True, host_ahead=True)
    assert ahead == [False, True]  # --host-ahead reaches the rounds
    assert set(seen) == {(None, False), (4, False), (None, True), (4, True)}
    assert [(r["run"], r["path"]) for r in point["runs"]] == [
        ("default", "one block"), ("c4", "chunks of 4"), ("lean", "chunks of 8 (lean)"),
        ("c4_lean", "chunks of 4 (lean)")]
    # --float8: every flce run in that mode, the bf16 loss at its own choice beside them
    seen.clear()
    point = bench_chunk_sizes.measure_point(16, 8, 12, [4], 0.1, 3, float8="logits+dx")
    assert set(seen) == {(None, False), (None, False, "logits+dx"), (4, False, "logits+dx")}
    assert [(r["run"], r["float8"]) for r in point["runs"]] == [
        ("bf16", "none"), ("default", "logits+dx"), ("c4", "logits+dx")]
    text = bench_chunk_sizes.markdown({**KERNEL_META, "float8": "logits+dx"}, [point])
    assert 'every run but bf16 (the bf16 loss at its own choice) with float8 "logits+dx"' in text


def float8_grid_results():
    def r(shape, method, ms, rounds, **extra):
        return {"shape": shape, "method": method, "ms": ms, "rounds_ms": rounds, **extra}
    results = []
    # a: float8 used, faster, 1.10x its floor; b: float8 used, slower in every round, 1.30x its
    # floor; c: below the threshold (the same code), a hair slower within the rounds' spread
    for shape, used, gemms, floor8, bf16, f8, bf16_rounds, f8_rounds in (
            ("a", "logits+dx", 20.0, 12.0, 21.0, 13.2, [20.8, 21.0, 21.4], [13.0, 13.2, 13.3]),
            ("b", "logits+dx", 20.0, 12.0, 15.0, 15.6, [14.9, 15.0, 15.1], [15.5, 15.6, 15.9]),
            ("c", "none", 2.0, 1.5, 2.2, 2.21, [2.1, 2.2, 2.3], [2.15, 2.21, 2.25])):
        results += [r(shape, "bare_gemms", gemms, [gemms], float8_used=used),
                    r(shape, "float8_floor", floor8, [floor8], vs_gemms=floor8 / gemms)]
        for name, ms, rounds in (("flce", bf16, bf16_rounds), ("flce_float8", f8, f8_rounds)):
            results.append(r(shape, name, ms, rounds, extra_mib=100.0, vs_gemms=ms / gemms,
                             vs_float8_floor=ms / floor8))
    return results


def float8_grid_report(meta):
    meta = {**REPORT_META, "dtype": "bfloat16", **meta}
    return bench_float8_grid.markdown(meta, float8_grid_results())


def test_float8_grid_verdict_checks_both_targets():
    text = "\n".join(bench_float8_grid.verdict(float8_grid_results()))
    assert "float8 GEMMs used at 2 of 3 points" in text
    assert ("no slower than the bf16 loss: 1 of 3 points; at 1 of the 2 others slower in every "
            "round than bf16 in its slowest: b") in text
    assert "its float8 floor where the bf16 GEMMs take ≥ 10 ms: 1 of 2 (worst 1.300×" in text
    report = float8_grid_report(CLEAN)
    assert "| c | no (below the threshold) | 2.00 | 0.750× | 1.100× | 1.105× | 1.473× |" in report
    assert "| a | yes | 20.00 | 0.600× | 1.050× | 0.660× | 1.100× | 100 / 100 |" in report


def test_float8_grid_ceiling_names_the_points_no_row_pass_brings_to_the_target():
    # the least row traffic at 4.8 TB/s: 5·65536·32000 bytes = 2.185 ms, 5·16384·128256 = 2.189 ms
    def point(shape, floor8, f8):
        return [{"shape": shape, "method": "bare_gemms", "ms": 20.0, "rounds_ms": [20.0],
                 "float8_used": "logits+dx"},
                {"shape": shape, "method": "float8_floor", "ms": floor8, "rounds_ms": [floor8],
                 "vs_gemms": floor8 / 20.0},
                *({"shape": shape, "method": name, "ms": ms, "rounds_ms": [ms],
                   "vs_gemms": ms / 20.0, "vs_float8_floor": ms / floor8, "extra_mib": 1.0}
                  for name, ms in (("flce", 30.0), ("flce_float8", f8)))]
    results = point("65536x1024x32000", 14.0, 18.0) + point("16384x8192x128256", 110.0, 113.0)
    text = "\n".join(bench_float8_grid.verdict(results, "NVIDIA H200"))
    assert ("puts the float8 loss at 1.020-1.156× its floor at those 2 points; ≤ 1.15× is out of "
            "reach at 1 (65536x1024x32000: 1.156-1.156×)") in text
    # above the floor: 4.0 ms / 2.185 = 1.83 and 3.0 / 2.189 = 1.37; the median of two: the upper
    assert "a median 1.83× those passes' time" in text
    assert "ceiling" not in "\n".join(bench_float8_grid.verdict(results, "some other GPU"))


def test_float8_grid_point_on_the_cpu(monkeypatch):
    """measure_point with its GPU parts replaced (inputs on the CPU, the float8 floor a bf16
    one, fixed timings): both losses run through flce with their float8 mode, and the records
    carry what the verdict and the report read."""
    modes = []
    real = bench_float8_grid.flce.fused_linear_cross_entropy

    def loss(x, t, w, float8):
        modes.append(float8)
        return real(x, t, w, impl="torch")

    monkeypatch.setattr(bench_float8_grid.flce, "fused_linear_cross_entropy", loss)
    monkeypatch.setattr(bench_float8_grid, "make_inputs", lambda N, H, V, dtype: (
        torch.randn(N, H, requires_grad=True), torch.randint(0, V, (N,)),
        torch.randn(V, H, requires_grad=True)))
    monkeypatch.setattr(bench_float8_grid, "float8_floor", bench_flce.gemm_floor)
    monkeypatch.setattr(bench_flce, "peak_extra_mib", lambda run, x, w: run() or 7.0)
    times = {"bare_gemms": 4.0, "float8_floor": 2.0, "flce": 5.0, "flce_float8": 3.0}
    monkeypatch.setattr(bench_float8_grid, "interleaved_rounds", lambda runs, s, r: {
        name: [run() or times[name]] for name, run in runs.items()})
    point = bench_float8_grid.measure_point("16x8x12", torch.float32, 0.1, 3)
    assert set(modes) == {"none", "logits+dx"}
    assert [r["method"] for r in point] == ["bare_gemms", "float8_floor", "flce", "flce_float8"]
    assert point[0]["float8_used"] == "none"  # 16 tokens: below flce's threshold
    assert point[3]["vs_gemms"] == 0.75 and point[3]["vs_float8_floor"] == 1.5
    assert "| 16x8x12 | no (below the threshold) | 4.00 | 0.500× | 1.250× | 0.750× | 1.500× | " \
        "7 / 7 |" in bench_float8_grid.markdown(
            {**KERNEL_META, "dtype": "bfloat16"}, point)


def test_row_overlap_report_rates_each_variant_against_flce():
    point = {"shape": "64x8x40", "path": "chunks of 16", "gemms_ms": 2.0, "runs": [
        {"run": "flce", "ms": 2.5, "extra_mib": 3.0, "bitwise_same": True},
        {"run": "overlap", "ms": 2.4, "extra_mib": 4.0, "bitwise_same": True},
        {"run": "overlap_high_priority", "ms": None, "extra_mib": None, "bitwise_same": False}]}
    text = bench_row_overlap.markdown(
        KERNEL_META, [point])
    assert "| 64x8x40 | chunks of 16 | overlap | 2.40 | 1.200× | 0.960× | 4 | yes |" in text
    assert "| 64x8x40 | chunks of 16 | overlap_high_priority | OOM |" in text
    assert "Overlap over flce: 0.960-0.960× at 1 points." in text


def test_loss_kernels_report_splits_each_run_by_kind_against_the_bare_gemms():
    def run(name, *kernels):
        return {"shape": "64x8x40", "run": name, "calls": 3, "wall_ms": 2.25,
                "allocator": {"num_device_alloc": 1, "num_device_free": 0, "num_alloc_retries": 0},
                "kernels": [{"name": k, "launches": n, "us": us} for k, n, us in kernels]}
    results = [run("bare_gemms", ("nvjet_tst_128x256", 3, 1500.0)),
               run("flce", ("nvjet_tst_128x256", 3, 1500.0), ("flce_rows_kernel", 1, 300.0),
                   ("triton_red_fused_abc|x", 2, 100.0)),
               {"shape": "64x8x40", "run": "liger", "calls": 3, "kernels": None}]
    text = bench_loss_kernels.markdown(
        KERNEL_META, results)
    assert "| 64x8x40 | flce | 1.90 | 1.50 | 0.30 | 0.10 | 1.267× | 2.25 | 1 / 0 / 0 | " \
        "nvjet_tst_128x256 1500 (3); flce_rows_kernel 300 (1); triton_red_fused_abc/x 100 (2) |" \
        in text
    assert "| 64x8x40 | bare_gemms | 1.50 | 1.50 | 0.00 | 0.00 | 1.000× | 2.25 |" in text
    assert "| 64x8x40 | liger | OOM |" in text


def test_loss_kernels_report_gives_the_host_time_where_it_was_measured():
    run = {"shape": "64x8x40", "run": "flce", "calls": 3, "wall_ms": 2.25, "host_ms": 1.5,
           "allocator": {"num_device_alloc": 0, "num_device_free": 0, "num_alloc_retries": 0},
           "kernels": [{"name": "nvjet_tst_128x256", "launches": 3, "us": 1500.0}]}
    text = bench_loss_kernels.markdown(KERNEL_META, [{**run, "run": "bare_gemms"}, run])
    assert "| wall ms | host ms | driver allocs" in text
    assert "| 64x8x40 | flce | 1.50 | 1.50 | 0.00 | 0.00 | 1.000× | 2.25 | 1.50 | 0 / 0 / 0 |" \
        in text
    del run["host_ms"]  # a report measured before the column: rendered as it was
    assert "host ms" not in bench_loss_kernels.markdown(KERNEL_META, [run])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the profiler's kernels)")
def test_loss_kernels_finds_flces_row_kernel_and_the_gemms():
    fns = {"flce": bench_loss_kernels.methods(512, 64, 1000, False)["flce"]}
    point = bench_loss_kernels.measure_point("512x64x1000", fns, calls=2)
    kinds = {r["run"]: bench_loss_kernels.by_kind(r["kernels"]) for r in point}
    assert kinds["flce"]["loss (flce kernels)"] > 0 and kinds["flce"]["GEMM"] > 0
    assert kinds["bare_gemms"]["loss (flce kernels)"] == 0
    flce_run = point[1]
    assert flce_run["wall_ms"] > 0 and set(flce_run["allocator"]) == set(
        bench_loss_kernels.ALLOCATOR_EVENTS)
    # host time, well under the GPU sleep each call is queued behind: the loss never syncs
    assert 0 < flce_run["host_ms"] < 10


def test_row_order_report_rates_each_variant_against_flce():
    point = {"shape": "64x8x40", "path": "chunks of 16", "gemms_ms": 2.0, "runs": [
        {"run": "flce", "ms": 2.5, "extra_mib": 3.0, "bitwise_same": True},
        {"run": "forward_order", "ms": 2.75, "extra_mib": 3.0, "bitwise_same": True}]}
    text = bench_row_order.markdown(
        KERNEL_META, [point])
    assert "| 64x8x40 | chunks of 16 | forward_order | 2.75 | 1.375× | 1.100× | 3 | yes |" in text
    assert "forward_order over flce: 1.100-1.100× at 1 points." in text


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_row_order_variant_sets_the_order_only_where_both_passes_run_in_one(monkeypatch):
    """The benchmark's launcher sets the order of pass 2 only where both passes run in one
    kernel without the e4m3 copy (there flce walks backwards: `walks_back`), and changes no
    result."""
    from flce.kernels import launch_rows, walks_back
    from flce.options import LossOptions
    seen = []

    def recorded(*args, **kwargs):
        seen.append(kwargs.get("reverse_grad"))
        return launch_rows(*args, **kwargs)
    monkeypatch.setattr(bench_row_order, "LAUNCH_ROWS", recorded)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(48, 40, device=device) * 3
    target = torch.randint(0, 40, (48,), device=device)
    weight = torch.tensor(0.5, device=device)
    outs = []
    for launch in (launch_rows, bench_row_order.launch_rows_ordered(False)):
        work, loss = logits.clone(), torch.empty(48, device=device)
        stats = tuple(torch.empty(48, device=device) for _ in range(2))
        launch(work, target, loss, stats, weight, LossOptions(), False, True, block_v=16)
        outs.append((work, loss, *stats))
    assert all(map(torch.equal, *outs))
    forward = bench_row_order.launch_rows_ordered(False)
    forward(logits.clone(), target, loss, stats, weight, LossOptions(), True, True, block_v=16)
    assert seen == [False, None]  # the gradient pass after a statistics pass: untouched
    ref = bench_row_order.flce.reference.chunk_rows
    work, loss = logits.clone(), torch.empty(48, device=device)
    ref(work, target, loss, None, weight, LossOptions(), False, True)
    torch.testing.assert_close(outs[0][0], work, rtol=2e-6, atol=2e-6)
    assert walks_back("full") and not walks_back("full+e4m3") and not walks_back("grad")


def test_rows_kernel_tuning_report_sets_the_default_against_the_fastest_and_the_order():
    def timed(*pairs):
        return [{"config": list(c), "ms": ms} for c, ms in pairs]
    point = {"rows": 64, "vocab": 40, "copy_gbs": 3000.0, "passes": [
        {"pass": "full", "bytes": 3e9, "default": [8192, 16, True], "configs": timed(
            ((None, None, None), 2.0), ((8192, 16, True), 2.0), ((8192, 16, False), 2.2),
            ((4096, 8, True), 1.6))},
        {"pass": "stats", "bytes": 1e9, "default": [4096, 4, None], "configs": timed(
            ((None, None, None), 0.5), ((4096, 4, None), 0.5))}]}
    assert bench_tune_rows.configs("full", 600)[:3] == [(None, None, None), (1024, 4, True),
                                                       (1024, 4, False)]
    assert all(c[2] is None for c in bench_tune_rows.configs("grad", 600))
    assert bench_tune_rows.tuned("full", 2048, 32000)[2] is True  # the loss walks backwards
    assert bench_tune_rows.tuned("full+e4m3", 2048, 32000)[2] is False
    assert max(c[0] or 0 for c in bench_tune_rows.configs("stats", 600)) == 1024  # <= 2 V
    text = bench_tune_rows.markdown(
        KERNEL_META, [point])
    assert "| 64x40 | 3000 | full | 8192/16 rev | 2.000 | 1500 | 4096/8 rev | 1.600 | 1875 | " \
        "1.250 | 1.100 |" in text
    assert "| 64x40 | 3000 | stats | 4096/4 | 0.500 | 2000 | 4096/4 | 0.500 | 2000 | 1.000 | - |" \
        in text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (streams)")
@pytest.mark.parametrize("priority", [0, -1])
def test_row_overlap_variant_is_bitwise_flces_chunked_sweep(priority):
    """Two buffers, row passes on a side stream: the same loss, dx and dW bit for bit, at an odd
    token count whose last chunk is short."""
    torch.manual_seed(0)
    x = torch.randn(203, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    t = torch.randint(0, 1000, (203,), device="cuda")
    t[::7] = -100
    side = torch.cuda.Stream(priority=priority)
    got = []
    for loop in (bench_row_overlap.SEQUENTIAL, bench_row_overlap.overlapped_chunk_loop(side)):
        x.grad = w.grad = None
        with bench_row_overlap.chunk_loop(loop):
            loss = bench_row_overlap.flce.fused_linear_cross_entropy(x, t, w, chunk_size=48)
        loss.backward()
        got.append((loss.detach(), x.grad, w.grad))
    assert bench_row_overlap.flce.ops.chunk_loop is bench_row_overlap.SEQUENTIAL
    for a, b in zip(*got):
        assert torch.equal(a, b)


def test_float8_floor_in_row_blocks_sums_dw_over_the_blocks(monkeypatch):
    """On the GPU, or on the CPU through Triton's interpreter (the float8 GEMMs run there too)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(bench_float8_grid.flce.ops, "DX_BLOCK_TOKENS", 8)
    scaled_mm, dx_rows = torch._scaled_mm, []

    def recording_scaled_mm(a, b, *args, use_fast_accum, **kwargs):
        if not use_fast_accum:  # the dx GEMM (the logits one accumulates fast)
            dx_rows.append(a.shape[0])
        return scaled_mm(a, b, *args, use_fast_accum=use_fast_accum, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", recording_scaled_mm)
    torch.manual_seed(0)
    x = torch.randn(40, 32, device=device, dtype=torch.bfloat16)
    w = torch.randn(48, 32, device=device, dtype=torch.bfloat16) / 6
    run, (f8, logits, out, dw) = bench_float8_grid.float8_floor(x, w, max_logits_bytes=16 * 48 * 2)
    run()
    assert logits.shape == (16, 48)  # blocks of 16, 16 and 8 rows
    # dx in flce's dx row blocks (of at most 8 rows here), as the bf16 floor's
    assert dx_rows == [8, 8, 8, 8, 8]
    expected_dx = logits.float() @ w.float()
    torch.testing.assert_close(f8.dx_out[:16].float(), expected_dx, rtol=0.1,
                               atol=0.1 * expected_dx.abs().max().item())  # e4m3 dlogits
    # dW is bf16 summed in place: each block's fp32 product is added to it and rounded to bf16
    expected = torch.zeros_like(dw)
    for s, n in ((0, 16), (16, 16), (32, 8)):
        expected = (expected.float() + logits[:n].float().t() @ x[s:s + n].float()).bfloat16()
    ulp = 2.0 ** -7 * expected.float().abs().max().item()
    torch.testing.assert_close(dw.float(), expected.float(), rtol=2 ** -7, atol=ulp)
    torch.testing.assert_close(out[:16].float(), logits.float(), rtol=0.1, atol=0.3)  # e4m3 logits


def attention_report(meta):
    meta = {"gpu": "G", "torch": "t", "cudnn": 1, "date": "d", "command": "c", **meta}
    return bench_attention.markdown(meta, [{"shape": "1x2x1x8x4", "backend": "cudnn", "ms": 1.0,
                                            "tflops": 3.0}])


def peers_report(meta):
    meta = {"config": "c.toml", "flavor": "f", "seq_len": 8, "nproc": 1, "gpu": "G", "torch": "t",
            "triton": "tr", "date": "d", "command": "c", "warmup_steps": 1, **meta}
    return bench_peers.markdown(meta, [], None)


def logits_epilogue_report(meta):
    meta = {**REPORT_META, **meta}
    tiles = [{"config": list(c), "plain_ms": 1.0, "stats_ms": 1.2, "logits_max_abs_diff": 0.0,
              "lse_max_abs_diff": 1e-6} for c in bench_logits_epilogue.CONFIGS]
    return bench_logits_epilogue.markdown(meta, [{
        "shape": "8x4x16", "cublas_ms": 1.0, "stats_pass_ms": 0.2, "cublas_tflops": 5.0,
        "triton": tiles, "best_plain_ms": 1.0, "best_stats_ms": 1.2}])


@pytest.mark.parametrize("render", [flce_report, attention_report, peers_report,
                                    logits_epilogue_report, chunk_sizes_report,
                                    float8_grid_report])
def test_benchmark_reports_name_the_commit_and_flag_a_dirty_tree(render):
    """The GPU benchmarks' markdown (their runs need CUDA; bench_train, compare_layouts and
    bench_loss_parallel are run for real in test_bench_train.py and test_scripts.py)."""
    dirty, clean = render(DIRTY), render(CLEAN)
    assert dirty.startswith("**DIRTY TREE: not reproducible from a commit** (git abc1234+dirty")
    assert "DIRTY" not in clean and "git abc1234" in clean


def test_flce_grid_verdict_tells_clear_losses_from_the_rounds_spread():
    """With each round's time kept, a loss is clear where a peer's slowest round beat flce's
    fastest; overlapping rounds are a loss within the spread; points without rounds (older
    grids) are counted apart."""
    def r(shape, method, rounds):
        ms = sorted(rounds)[len(rounds) // 2] if rounds else None
        return {"shape": shape, "method": method, "ms": ms, "extra_mib": 1.0, "tflops": 1.0,
                "vs_gemms": None if ms is None else ms / 10.0, "rounds_ms": rounds}
    results = [r("a", "bare_gemms", [10.0] * 3), r("a", "flce", [10.2, 10.3, 10.4]),
               r("a", "liger", [10.0, 10.1, 10.1]), r("a", "flce_lean", [10.5, 10.6, 10.7]),
               r("b", "bare_gemms", [10.0] * 3), r("b", "flce", [10.2, 10.3, 10.6]),
               r("b", "liger", [10.1, 10.2, 10.5]), r("b", "flce_lean", [10.0, 10.4, 10.4]),
               r("c", "bare_gemms", [10.0] * 3), r("c", "flce", [10.0, 10.1, 10.2]),
               r("c", "liger", [11.0, 11.1, 11.2]), r("c", "flce_lean", []),
               r("d", "bare_gemms", [10.0] * 3), r("d", "flce", [10.3]), r("d", "liger", [10.0])]
    del results[-2]["rounds_ms"], results[-1]["rounds_ms"]  # d: a point from an older grid
    text = "\n".join(loss_grid.grid_verdict(results))
    assert ("flce, flce_lean, unfused_compile, liger, cce: 1 of 4 points; at 1 of the 3 others "
            "a peer was faster in every round than flce in its fastest (1 of them measured "
            "without rounds): a\n") in text, text
    assert ("flce_lean time ≤ Liger's: 0 of 2 points; at 1 of the 2 others a peer was faster "
            "in every round than flce_lean in its fastest: a") in text, text
    assert loss_grid._clear_losses({("x", "flce"): {"ms": 2.0}, ("x", "cce"): {"ms": 1.0}},
                                    ["x"], "flce", ["cce"]) == ""  # no rounds: nothing to add


def test_flce_grid_floor_in_row_blocks_equals_the_whole_gemms():
    """The grid's floor runs the GEMMs in row blocks where the logits would not fit: the same
    three products (dW summed over the blocks), so the same work is timed."""
    torch.manual_seed(0)
    x, w = torch.randn(37, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64)
    whole_run, (logits, dx, dw) = bench_flce.gemm_floor(x, w)
    whole_run()
    block_run, (block, bdx, bdw) = bench_flce.gemm_floor(x, w, max_logits_bytes=5 * 12 * 8)
    block_run()
    assert block.shape == (5, 12)
    torch.testing.assert_close(bdx, logits @ w)
    torch.testing.assert_close(bdw, logits.t() @ x)
    torch.testing.assert_close(dx, bdx)
    # an odd vocabulary (11 rows of 8 bytes: not whole 16-byte words) runs at flce's width, 16
    odd_run, (odd, odx, odw) = bench_flce.gemm_floor(x, w[:11])
    odd_run()
    assert odd.shape == (37, 16) and odd[:, 11:].abs().max() == 0
    torch.testing.assert_close(odw[:11], odd[:, :11].t() @ x)


def test_flce_grid_floor_runs_dx_in_the_row_blocks_flce_does(monkeypatch):
    """dx in flce's row blocks (one 16384-row dx GEMM at H = 8192 ran up to 1.35x two of 8192,
    a floor flce ran under: 0.937x at 16384x8192x128256): every row once, each block at most
    DX_BLOCK_TOKENS rows, in one block of all tokens and in the logits' row blocks."""
    import flce.ops
    monkeypatch.setattr(flce.ops, "DX_BLOCK_TOKENS", 16)
    torch.manual_seed(0)
    x, w = torch.randn(37, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64)
    mm, shapes = torch.mm, []
    monkeypatch.setattr(bench_flce.torch, "mm", lambda a, b, **kw: shapes.append(
        (a.shape, b.shape)) or mm(a, b, **kw))
    for max_bytes, heights in [(None, [37]), (30 * 12 * 8, [30, 7])]:
        run, (logits, dx, dw) = bench_flce.gemm_floor(x, w, max_logits_bytes=max_bytes)
        shapes.clear()
        run()
        dx_rows = [a[0] for a, b in shapes if b == (12, 8)]  # dlogits [rows, V] @ W [V, H]
        assert dx_rows == [b - a for h in heights for a, b in flce.ops.dx_row_blocks(h)]
        assert max(dx_rows) <= 16 and sum(dx_rows) == 37
        torch.testing.assert_close(dx[-7:], logits[:7] @ w if max_bytes else logits[-7:] @ w)


def test_flce_grid_floor_is_one_read_and_one_write_of_the_logits_at_the_hbm_peak():
    # 4 bytes a logit at 4.8 TB/s: 2400000x5000 logits take 10 ms, 1200000x1000 1 ms,
    # 12000x1000 0.01 ms; over GEMMs of 100, 50 and 5 ms: 1.10 (out of reach), 1.02, 1.002
    def point(shape, gemms, flce_ms):
        return [{"shape": shape, "method": "bare_gemms", "ms": gemms, "tflops": 1.0},
                {"shape": shape, "method": "flce", "ms": flce_ms, "vs_gemms": flce_ms / gemms,
                 "extra_mib": 1.0}]
    results = (point("2400000x8x5000", 100.0, 115.0) + point("1200000x8x1000", 50.0, 51.5)
               + point("12000x8x1000", 5.0, 5.02))
    text = "\n".join(loss_grid.grid_verdict(results, "NVIDIA H200"))
    geomean = (1.10 * 1.02 * 1.002) ** (1 / 3)
    assert (f"put any loss that leaves the GEMMs to cuBLAS at 1.002-1.100× its GEMMs (geometric "
            f"mean {geomean:.3f}×); ≤ 1.05× is out of reach at 1 of the 2 points whose GEMMs "
            "take ≥ 10 ms, and flce is within it at 1 of the other 1") in text
    # above the GEMMs over the floor: 15/10, 1.5/1, 0.02/0.01: the median 1.5
    assert text.endswith("a median 1.50× the floor's")
    assert "the floor" not in "\n".join(loss_grid.grid_verdict(results, "some other GPU"))
    # a run under the floor (GEMMs faster than the bare ones back to back) is counted, any method
    results[1]["ms"] = 109.0  # under 100 ms x 1.10
    results += [{"shape": "2400000x8x5000", "method": "liger", "ms": 108.0},
                {"shape": "12000x8x1000", "method": "liger", "ms": 5.005}]
    text = "\n".join(loss_grid.grid_verdict(results, "NVIDIA H200"))
    assert text.endswith("; 3 runs at 2 points came in under it, their GEMMs faster than the "
                         "bare GEMMs back to back")


def test_flce_grid_verdict_counts_each_target():
    def r(shape, method, ms, mib, floor=10.0):
        return {"shape": shape, "method": method, "ms": ms, "extra_mib": mib,
                "vs_gemms": None if ms is None else ms / floor, "tflops": 1.0}
    results = [r("a", "bare_gemms", 10.0, None), r("a", "flce", 10.4, 100),
               r("a", "flce_lean", 11.0, 50), r("a", "unfused_compile", 11.0, 400),
               r("a", "liger", 12.0, 60), r("a", "cce", None, None),
               {**r("b", "bare_gemms", 10.0, None), "flce_path": "one block"},
               r("b", "flce", 10.8, 300),
               r("b", "flce_lean", 13.0, 80), r("b", "unfused_compile", 10.5, 200),
               r("b", "liger", 12.0, 70), r("b", "cce", 10.0, 10)]
    text = "\n".join(loss_grid.grid_verdict(results))
    assert "1 of 2 (worst 1.080×)" in text
    assert f"geometric mean {(1.04 * 1.08) ** 0.5:.3f}×" in text
    assert "faster than unfused_compile: 1 of 2" in text
    assert "where they take ≥ 10 ms: 1 of 2" in text
    assert "the fastest of flce, flce_lean, unfused_compile, liger, cce: 1 of 2 points" in text
    assert "faster than cce: 1 of 2" in text  # a peer that does not fit loses that point
    assert "≤ torch.compile's: 1 of 2 points; median ratio 0.88" in text
    assert "flce_lean memory ≤ Liger's: 1 of 2 points\n" in text + "\n"  # 10 MiB over: no slack
    assert "flce_lean time ≤ Liger's: 1 of 2" in text
    # 0.9 MiB over at b: within the caching allocator's slack, said so
    results[8]["extra_mib"] = 70.9
    slack = "\n".join(loss_grid.grid_verdict(results))
    assert ("flce_lean memory ≤ Liger's: 1 of 2 points; at 1 of the 1 others by 1 MiB or less, "
            "the caching allocator's slack") in slack
    results[8]["extra_mib"] = 80
    meta = {**KERNEL_META, "dtype": "bfloat16"}
    table = loss_grid.grid_markdown(meta, results)
    assert "| b | one block | 10.00 (1 TFLOP/s) | 1.080× / 300 |" in table and "| OOM |" in table
    assert "| a | - | 10.00" in table  # a report from before the path was recorded
    by_tokens = "\n".join(loss_grid.grid_by_tokens(results))
    assert "| a | 1.040 | 1/1 | 1/1 | 1/1 | 1/1 |" in by_tokens
    assert "| b | 1.080 | 0/1 | 0/1 | 1/1 | 0/1 |" in by_tokens
    assert "| all | 1.060 | 1/2 | 1/2 | 2/2 | 1/2 |" in by_tokens
    assert "not the fastest (1 of 2 points) the fastest is 8.0% faster" in by_tokens
    assert by_tokens in table
    assert bench_flce.flce_path(8192, 4096, 128256, 2) == "one block"
    assert bench_flce.flce_path(65536, 2048, 128256, 2) == "chunks of 8192"


def test_interleaved_rounds_balance_the_order_and_settle_each_run(monkeypatch):
    """Rounds come in balanced blocks: each run takes each position and follows each other run
    equally often (rounds shuffled from one seed gave a slot the same predecessor at every point,
    and a run right after the heavy bare GEMMs times slower), and each visit calls its run
    untimed until settle_ms have passed before the one timed call."""
    calls, clock = [], [0.0]

    def run_of(name):
        def run():  # a call that takes 2 ms of a clock of the test's own: a loaded machine's
            calls.append(name)  # sleeps overran and let fewer calls into the settling time
            clock[0] += 0.002
        return run
    runs = {name: run_of(name) for name in "abcde"}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "median_ms", lambda fn, warmup, reps: (fn(), 1.0)[1])
    ms = timing.interleaved_ms(runs, seconds=0.0, max_reps=6, settle_ms=10.0)
    assert ms == dict.fromkeys("abcde", 1.0)
    visits = [(name, len(list(run))) for name, run in itertools.groupby(calls)]
    assert len(visits) == 10 * 5  # one block of an odd count: 10 rounds, beyond max_reps
    assert all(n == 6 for _, n in visits)  # 10 ms of 2 ms calls, then the timed one
    orders = [tuple(name for name, _ in visits[i:i + 5]) for i in range(0, 50, 5)]
    assert all(sorted(order) == list("abcde") for order in orders)
    positions = collections.Counter((name, i) for order in orders for i, name in enumerate(order))
    pairs = collections.Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert set(positions.values()) == {2} and len(positions) == 25
    assert set(pairs.values()) == {2} and len(pairs) == 20


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 7, 8])
def test_balanced_orders_are_a_williams_design_in_every_block(n):
    orders = timing.balanced_orders(n, seed=5)
    block = timing.block_rounds(n)
    for _ in range(2):  # the labels change between blocks, the balance does not
        rows = [next(orders) for _ in range(block)]
        assert all(sorted(row) == list(range(n)) for row in rows)
        positions = collections.Counter((r, i) for row in rows for i, r in enumerate(row))
        pairs = collections.Counter(pair for row in rows for pair in zip(row, row[1:]))
        assert len(positions) == n * n and len(set(positions.values())) == 1
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1


def test_interleaved_rounds_fill_whole_blocks_up_to_max_reps(monkeypatch):
    clock = [0.0]

    def run():
        clock[0] += 0.001
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "median_ms", lambda fn, warmup, reps: (fn(), 1.0)[1])
    runs = dict.fromkeys("abcd", run)
    assert len(timing.interleaved_rounds(runs, 0.0, 20, settle_ms=0.0)["a"]) == 4
    # 1 ms a run: 0.01 s asks for 10 rounds, 3 blocks of 4 (12) within max_reps 20
    assert len(timing.interleaved_rounds(runs, 0.01, 20, settle_ms=0.0)["a"]) == 12
    assert len(timing.interleaved_rounds(runs, 1.0, 20, settle_ms=0.0)["a"]) == 20


def test_interleaved_rounds_with_the_host_ahead_time_the_gpu_behind_long_enough_gemms(
        monkeypatch):
    """host_ahead: each timed call is ahead_ms's, whose GEMMs ahead of it last 3x the longest
    host time of a call of any run at the point, as long for all (5 ms at least); the rounds get
    its GPU time
    and `host` its host time. Without host_ahead the timed call is a synchronised one
    (median_ms), as before."""
    clock, led = [0.0], []
    host_s = {"fast": 0.0005, "slow": 0.004}

    def run_of(name):
        def run():
            clock[0] += host_s[name]
        return run
    runs = {name: run_of(name) for name in host_s}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "median_ms", lambda fn, warmup, reps: pytest.fail("synchronised"))

    def ahead(fn, lead_ms):
        led.append(lead_ms)
        fn()
        return 0.25, 0.75
    monkeypatch.setattr(timing, "ahead_ms", ahead)
    host = {}
    rounds = timing.interleaved_rounds(runs, 0.0, 4, settle_ms=10.0, host_ahead=True, host=host)
    assert rounds == {"fast": [0.25] * 4, "slow": [0.25] * 4}  # 3 rounds at least: 2 blocks
    assert host == {"fast": [0.75] * 4, "slow": [0.75] * 4}
    assert led == pytest.approx([12.0] * 8)  # 3 x the slow run's 4 ms, for the fast one too
    monkeypatch.setattr(timing, "median_ms", lambda fn, warmup, reps: (fn(), 1.0)[1])
    monkeypatch.setattr(timing, "ahead_ms", lambda fn, lead_ms: pytest.fail("host ahead"))
    assert timing.interleaved_rounds(runs, 0.0, 4, settle_ms=10.0) == {"fast": [1.0] * 4,
                                                                       "slow": [1.0] * 4}


@pytest.mark.parametrize("host_s, lead_ms", [(0.0005, 5.0), (0.01, 30.0), (0.35, 60.0)])
def test_the_gemms_ahead_of_every_timed_call_are_as_long_for_every_run_within_5_and_60_ms(
        monkeypatch, host_s, lead_ms):
    """A run whose call synchronises (its host time its GPU time) had its own sleep 3x that, a
    second at 350 ms, against the others' few ms: Liger-Kernel then timed 10.7% faster than flce
    on an H100, and 1.0% with one sleep for both (their kernels 0.8% apart)."""
    clock, led = [0.0], []
    runs = {"short": lambda: clock.__setitem__(0, clock[0] + 0.0001),
            "long": lambda: clock.__setitem__(0, clock[0] + host_s)}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "ahead_ms", lambda fn, ms: (led.append(ms), fn(), (1.0, 0.1))[2])
    timing.interleaved_rounds(runs, 0.0, 4, settle_ms=0.0, host_ahead=True)
    assert led == pytest.approx([lead_ms] * 8)


@pytest.mark.parametrize("host_ahead", [False, True])
def test_a_run_out_of_memory_in_the_rounds_is_timed_alone_after_them(monkeypatch, host_ahead):
    """A run that does not fit beside the others' cached blocks is timed alone after the rounds,
    as the rounds time it: synchronised (timed_ms), or with the host ahead (three visits)."""
    clock, calls = [0.0], {"small": 0, "big": 0}

    def run_of(name):
        def run():
            calls[name] += 1
            if name == "big" and calls[name] <= 1 + host_ahead:  # with the lead's own call
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            clock[0] += 0.001
        return run
    runs = {name: run_of(name) for name in calls}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(timing, "median_ms", lambda fn, warmup, reps: (fn(), 1.0)[1])
    monkeypatch.setattr(timing, "timed_ms", lambda fn, seconds, max_reps: (fn(), 7.0)[1])
    monkeypatch.setattr(timing, "ahead_ms", lambda fn, lead_ms: (fn(), (2.0, 0.5))[1])
    host = {}
    rounds = timing.interleaved_rounds(runs, 0.0, 4, settle_ms=0.0, host_ahead=host_ahead,
                                       host=host)
    assert rounds["big"] == ([2.0] if host_ahead else [7.0])
    assert rounds["small"] == [2.0 if host_ahead else 1.0] * 4
    assert host == ({"small": [0.5] * 4, "big": [0.5] * 3} if host_ahead else
                    {"small": [], "big": []})


def test_a_grid_timed_with_the_host_ahead_says_so_and_gives_the_hosts_time():
    def r(method, ms, host):
        return {"shape": "a", "method": method, "ms": ms, "extra_mib": 1.0, "vs_gemms": ms / 2,
                "tflops": 1.0, "host_ms": host}
    results = [r("bare_gemms", 2.0, 0.05), r("flce", 2.2, 0.4), r("unfused_compile", 2.4, 0.3)]
    meta = {**KERNEL_META, "dtype": "bfloat16", **bench_flce.timing_meta(True)}
    table = loss_grid.grid_markdown(meta, results)
    assert "with the host ahead" in table and "the GPU's alone" in table
    assert "(the largest): bare_gemms 0.05 (0.05), flce 0.40 (0.40), unfused_compile 0.30" in table
    synced = loss_grid.grid_markdown({**KERNEL_META, "dtype": "bfloat16"},
                                      [{k: v for k, v in x.items() if k != "host_ms"}
                                       for x in results])
    assert "host ahead" not in synced and "host's ms" not in synced
    assert bench_flce.timing_meta(False) == {"timing": bench_flce.TIMING, "host_ahead": False}


def test_fresh_run_folder_makes_clears_its_own_and_refuses_the_rest(tmp_path):
    made = run_folders.fresh_run_folder(tmp_path / "a" / "run")
    assert sorted(p.name for p in made.iterdir()) == [run_folders.MARKER]
    (made / "metrics.jsonl").write_text("{}\n")
    (made / "checkpoint").mkdir()
    assert sorted(p.name for p in run_folders.fresh_run_folder(made).iterdir()) == [
        run_folders.MARKER]
    (tmp_path / "empty").mkdir()
    run_folders.fresh_run_folder(tmp_path / "empty")
    mine = tmp_path / "mine"
    (mine / "checkpoint").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="holds files that no script run made"):
        run_folders.fresh_run_folder(mine)
    assert (mine / "checkpoint").is_dir() and not (mine / run_folders.MARKER).exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        run_folders.fresh_run_folder(tmp_path / "file")


@pytest.mark.parametrize("target", ["marked", "missing"])
def test_a_symlinked_run_folder_is_refused_in_one_line(tmp_path, target):
    """`run_folders fresh LINK` to a marked folder was rmtree's traceback ("Cannot call rmtree
    on a symbolic link"); to a missing one it made the folder through the link."""
    real = tmp_path / "real"
    if target == "marked":
        run_folders.fresh_run_folder(real)
        (real / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "link").symlink_to(real)
    result = subprocess.run([sys.executable, "-m", "scripts.lib.run_folders", "fresh",
                             str(tmp_path / "link")], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr == (f"error: {tmp_path / 'link'} is a symbolic link (to {real}), not a "
                             "run folder: not clearing it; name the folder itself\n")
    assert (real / "metrics.jsonl").is_file() if target == "marked" else not real.exists()


def test_run_folders_command_checks_every_folder_before_clearing_any(tmp_path):
    ours = run_folders.fresh_run_folder(tmp_path / "ours")
    (ours / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes").write_text("x")
    cmd = [sys.executable, "-m", "scripts.lib.run_folders", "fresh", str(ours),
           str(tmp_path / "mine")]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and result.stderr.startswith(f"error: {tmp_path / 'mine'}")
    assert (ours / "metrics.jsonl").is_file()  # nothing cleared: one folder was refused
    result = subprocess.run(cmd[:-1] + [str(tmp_path / "new")], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert not (ours / "metrics.jsonl").exists() and (tmp_path / "new" / run_folders.MARKER).is_file()


def test_claim_folder_keeps_its_own_folder_and_refuses_a_users(tmp_path):
    work = run_folders.claim_folder(tmp_path / "work")
    (work / "corpus.txt").write_text("kept across runs")
    assert run_folders.claim_folder(work) == work and (work / "corpus.txt").is_file()
    mine = tmp_path / "mine"
    (mine / "shards").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="holds files that no script run made"):
        run_folders.claim_folder(mine)
    assert not (mine / run_folders.MARKER).exists()


def test_bench_data_refuses_a_work_dir_it_did_not_make(tmp_path):
    """A rerun of bench.data clears work/shards: pointed at a user's folder, it deleted the
    user's shards there before anything was checked."""
    from scripts.bench import data as bench_data
    mine = tmp_path / "corpus"
    (mine / "shards").mkdir(parents=True)
    (mine / "shards" / "index.json").write_text("{}")
    with pytest.raises(SystemExit, match="--work-dir: .*no script run made"):
        bench_data.main(["--work-dir", str(mine), "--out", str(tmp_path / "out")])
    assert (mine / "shards" / "index.json").read_text() == "{}"


def test_the_logits_epilogue_kernel_writes_the_logits_and_their_tile_statistics():
    """scripts.bench.logits_epilogue's Triton GEMM (fp32 in the interpreter on the CPU, bf16 on
    CUDA): the logits and, from its per-tile max and sum of exp, each row's log-sum-exp, at a
    shape whose last row and column tiles are partial."""
    torch.manual_seed(0)
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    x = torch.randn(45, 32, device=device).to(dtype)
    w = torch.randn(152, 32, device=device).to(dtype)  # TMA: rows of a multiple of 16 bytes
    run, (out, tile_max, tile_sum) = bench_logits_epilogue.triton_logits(
        x, w, (16, 64, 16, 1, 4), stats=True)
    run()
    ref = x.double() @ w.double().t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol)
    assert tile_max.shape == (45, 3)
    m = tile_max.double().max(dim=1).values
    lse = m + torch.log((tile_sum.double() * torch.exp(tile_max.double() - m[:, None])).sum(1))
    assert torch.allclose(lse, torch.logsumexp(out.double(), dim=1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("runs_file", PEER_RUN_LISTS, ids=lambda p: p.stem)
def test_a_shipped_peer_run_list_parses_and_its_runs_configs_load(runs_file, tmp_path):
    """Each run list in scripts/bench/peer_runs/ is read as @FILE (comments and quoted --run
    values as a shell reads them), names both trainers, and every run of this repo's loads as a
    train.py config (a key renamed since would fail here, not on the GPU machine)."""
    from components.config.parse import load_config
    args = bench_peers.parse_args([f"@{runs_file}", "--runs-dir", str(tmp_path)])
    assert {kind for _, kind, _ in args.runs} == {"ours", "titan"}
    assert len({name for name, _, _ in args.runs}) == len(args.runs)
    for name, kind, extra in args.runs:
        if kind == "ours":
            cmd, _ = bench_peers.ours_command(args, extra, tmp_path / name)
            cfg = load_config(cmd[cmd.index("--config"):])
            assert cfg.training.seq_len == args.seq_len


def test_bench_peers_names_a_bad_config_in_one_line(tmp_path, capsys):
    """A missing or invalid --config was a traceback, and one without [model] a KeyError,
    though train.py runs it on the default flavor."""
    from components.config.parse import load_config
    bare = tmp_path / "bare.toml"
    bare.write_text("[training]\nsteps = 3\n")
    assert bench_peers.parse_args(["--run", "a=ours", "--config", str(bare)]).flavor == \
        load_config([]).model.flavor
    missing, bad = tmp_path / "missing.toml", tmp_path / "bad.toml"
    bad.write_text("[model\n")
    for path, said in ((missing, f"--config {missing}: no such file"),
                       (bad, f"{bad}: invalid TOML")):
        with pytest.raises(SystemExit) as e:
            bench_peers.parse_args(["--run", "a=ours", "--config", str(path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err
        assert f"error: {said}" in err.splitlines()[-1]


def test_a_peer_run_file_line_is_split_as_a_shell_would(tmp_path):
    runs = tmp_path / "runs.args"
    runs.write_text("# a comment line\n--steps 7  # seven\n"
                    "--run \"a=ours:--training.local_batch_size 2 --loss.impl unfused\"\n")
    args = bench_peers.parse_args([f"@{runs}"])
    assert args.steps == 7
    assert args.runs == [("a", "ours", ["--training.local_batch_size", "2", "--loss.impl",
                                        "unfused"])]


def test_bench_peers_resume_keeps_the_finished_runs_and_runs_the_others(tmp_path, monkeypatch):
    """--resume keeps a run an earlier call finished (its record, commit and folder untouched)
    and runs the ones it lacks; a report of another setup is refused. Real train.py runs of the
    debug model on the CPU."""
    monkeypatch.setenv("FLCE_GIT_REVISION", "aaaaaaa")
    common = ["--config", "configs/debug.toml", "--seq-len", "64", "--steps", "5",
              "--warmup-steps", "2", "--log-freq", "1", "--runs-dir", str(tmp_path / "runs"),
              "--out", str(tmp_path / "peers")]
    a, b = "a=ours:--training.local_batch_size 2", "b=ours:--training.local_batch_size 3"
    assert bench_peers.main([*common, "--run", a]) == 0
    first = json.loads((tmp_path / "peers.json").read_text())["runs"][0]
    metrics = tmp_path / "runs/a/metrics.jsonl"
    written = metrics.stat().st_mtime_ns
    monkeypatch.setenv("FLCE_GIT_REVISION", "bbbbbbb")
    assert bench_peers.main([*common, "--resume", "--run", a, "--run", b]) == 0
    report = json.loads((tmp_path / "peers.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["a", "b"]
    assert report["runs"][0] == first and first["git"] == "aaaaaaa"
    assert report["runs"][1]["status"] == "ok" and report["runs"][1]["git"] == "bbbbbbb"
    assert metrics.stat().st_mtime_ns == written
    assert "Kept from earlier calls (--resume): a (git aaaaaaa" in (
        tmp_path / "peers.md").read_text()
    with pytest.raises(SystemExit, match="another setup .*steps=5"):
        bench_peers.main([*common[:5], "7", *common[6:], "--resume", "--run", a])


@pytest.mark.parametrize("runs_file", PEER_RUN_LISTS, ids=lambda p: p.stem)
def test_a_shipped_peer_run_lists_torchtitan_runs_parse_as_torchtitan_reads_them(runs_file,
                                                                                 tmp_path):
    """Where torchtitan 0.2.2 is importable (it is no CI dependency: the peer runs on the GPU
    machine), every titan run of a shipped list parses with its config manager and sets what
    its name says (float8 converters, the float8 all-gather)."""
    manager = pytest.importorskip("torchtitan.config.manager")
    args = bench_peers.parse_args([f"@{runs_file}", "--runs-dir", str(tmp_path)])
    for name, kind, extra in args.runs:
        if kind != "titan":
            continue
        cmd, _ = bench_peers.titan_command(args, extra, tmp_path / name)
        cfg = manager.ConfigManager().parse_args(cmd[cmd.index("--model.name"):])
        float8 = cfg.quantize.linear.float8
        assert ("float8" in name) == (cfg.model.converters == ["quantize.linear.float8"])
        assert float8.enable_fsdp_float8_all_gather == name.endswith("_ag")
        assert cfg.training.seq_len == args.seq_len and cfg.compile.enable


def test_the_peak_extra_memory_is_the_bytes_asked_for_not_the_blocks_handed_out(monkeypatch):
    """The caching allocator may hand out a cached block up to 1 MiB larger than asked for; the
    allocated-bytes peak counted it, so two losses asking for the same buffers came out up to
    0.9 MiB apart. The requested-bytes peak above the bytes requested before the call is what
    the call asked for."""
    MiB = 1 << 20
    stats = {"requested_bytes.all.current": 100 * MiB, "requested_bytes.all.peak": 100 * MiB,
             "allocated_bytes.all.current": 101 * MiB, "allocated_bytes.all.peak": 101 * MiB}

    def run():  # asks for 40 MiB, handed a 41 MiB block, then frees it
        stats["requested_bytes.all.peak"] = stats["requested_bytes.all.current"] + 40 * MiB
        stats["allocated_bytes.all.peak"] = stats["allocated_bytes.all.current"] + 41 * MiB
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: dict(stats))
    monkeypatch.setattr(torch.cuda, "memory_allocated",
                        lambda *a, **k: stats["allocated_bytes.all.current"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda *a, **k: stats["allocated_bytes.all.peak"])
    x = torch.ones(2, requires_grad=True)
    x.grad = torch.ones(2)
    assert bench_flce.peak_extra_mib(run, x) == 40.0
    assert x.grad is None  # the run's gradients count as its own


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the caching allocator)")
def test_the_peak_extra_memory_on_cuda_is_what_the_call_asked_for():
    """On the real allocator: a call that asks for 3 MiB + 1 byte and 5 MiB + 3 bytes at once,
    beside a tensor kept from before, peaks at their sum to the byte."""
    kept = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")

    def run():
        a = torch.empty(3 * (1 << 20) + 1, dtype=torch.uint8, device="cuda")
        b = torch.empty(5 * (1 << 20) + 3, dtype=torch.uint8, device="cuda")
        del a, b
    assert bench_flce.peak_extra_mib(run) == (8 * (1 << 20) + 4) / (1 << 20)
    del kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (GEMMs)")
def test_the_gemms_ahead_of_a_timed_call_keep_the_gpu_busy_about_as_long_as_asked():
    """The host-ahead timing's lead: GEMMs that last about the ms asked for, so that a call
    queued behind them is timed alone (the host's time to queue it not counted). scripts/test_gpu.sh
    shares the GPU among its workers: another's kernels can lengthen a lead, never shorten it,
    and a GEMM timed while they ran must not shorten the leads after (the calibration did, once:
    a 5 ms lead measured 2.08 ms)."""
    timing.gpu_fill(1.0)  # the operands made and one GEMM timed
    for ms in (5.0, 30.0):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        timing.gpu_fill(ms)
        end.record()
        torch.cuda.synchronize()
        assert 0.5 * ms < start.elapsed_time(end) < 4.0 * ms  # longer: another worker's kernels
    x = torch.ones(8, device="cuda")
    gpu, host = timing.ahead_ms(lambda: x.add_(1), 20.0)
    assert gpu < 5.0 and host < 20.0


@pytest.mark.parametrize("module, args", [("flce", ["--grid"]), ("float8_grid", [])])
def test_a_grid_without_resume_leaves_an_existing_report_alone(module, args, tmp_path,
                                                               monkeypatch, capsys):
    """The grids' default --out is the committed report: a run without --resume rewrote it
    point by point, one point at the first."""
    report = tmp_path / "report.json"
    report.write_text('{"meta": {}, "results": []}')
    monkeypatch.setattr(sys, "argv", [module, *args, "--out", str(tmp_path / "report")])
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"scripts.bench.{module}").main()
    assert exit_.value.code == 2 and report.read_text() == '{"meta": {}, "results": []}'
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: {report} exists: --resume measures the points it lacks, --out names a new "
        "report (a fresh grid would replace it point by point)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize("module, args", [
    ("attention", []), ("chunk_sizes", ["--points", "64x8x32:16"]), ("flce", []),
    ("float8_grid", []), ("grad_gemms", ["--chunks", "16x8x32"]), ("logits_epilogue", []),
    ("loss_kernels", ["--shapes", "64x8x32"]), ("row_overlap", ["--shapes", "64x8x32"]),
    ("step_floor", []), ("tune_rows_kernel", [])])
def test_a_gpu_benchmark_without_a_gpu_says_so_in_one_line(module, args, tmp_path, monkeypatch,
                                                           capsys):
    """Each said it with an AssertionError's traceback (and under python3 -O, with the assert
    gone, failed later in CUDA's generator). In this process (a subprocess apiece spent most of
    the time importing torch), but for one under python3 -O: no assert does the check."""
    message = (f"error: scripts.bench.{module} times CUDA kernels and needs a CUDA GPU; torch "
               f"{torch.__version__} sees none\n")
    command = [*args, "--out", str(tmp_path / "report")]
    if module == "flce":
        result = subprocess.run([sys.executable, "-O", "-m", "scripts.bench.flce", *command],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stderr == message
    monkeypatch.setattr(sys, "argv", [module, *command])
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"scripts.bench.{module}").main()
    assert exit_.value.code == 2 and capsys.readouterr().err == message



def test_bench_runs_read_the_timeline_a_rollback_left(tmp_path):
    """A benchmark's run resumed from step 2 after logging to step 4 (its steps 3-4 abandoned)
    and stopped at step 3: its throughput rows are steps 1-3, step 3 the resumed run's."""
    from scripts.lib.runs import read_metrics
    lines = [{"step": s, "time": 0.0, "loss": 5.0 - s, "tokens_per_second": 100.0 * s}
             for s in (1, 2, 3, 4)]
    lines += [{"step": 2, "time": 0.0, "val_loss": 3.5},  # a validation line has no throughput
              {"step": 3, "time": 1.0, "loss": 0.5, "tokens_per_second": 777.0},
              "{cut short by a ki"]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["tokens_per_second"] for r in rows] == [100.0, 200.0, 777.0]
    assert rows[2]["loss"] == 0.5


def test_the_benchmarks_read_their_shapes_with_one_parser(tmp_path, monkeypatch, capsys):
    """bench.flce, float8_grid, logits_epilogue, loss_kernels, loss_parallel, row_overlap,
    row_order (NxHxV), attention (BxHQxHKVxTxD), grad_gemms (CxHxV) and chunk_sizes
    (NxHxV:C1/C2/...) each split their shapes themselves; most with a ValueError's traceback for
    a bad one (after measuring the shapes before it), and those that checked refused a size
    below 1 (a rule all of them keep now). A list keeps each shape as given: the reports' key."""
    from argparse import ArgumentTypeError
    parse_shape, parse_shapes = loss_grid.parse_shape, loss_grid.parse_shapes
    assert parse_shape("16384x8192x256000") == (16384, 8192, 256000)
    assert parse_shape("4x32x8x8192x64", "BxHQxHKVxTxD") == (4, 32, 8, 8192, 64)
    assert parse_shape("64x8x32:16/8", "NxHxV:C1/C2/...") == (64, 8, 32, [16, 8])
    assert parse_shapes("8192x2048x128256,64x8x32") == ["8192x2048x128256", "64x8x32"]
    assert parse_shapes(" 64x8x32") == [" 64x8x32"]  # int()'s spaces, accepted as before
    assert [parse_shape(s) for s in loss_grid.grid_shapes()] == list(itertools.product(
        loss_grid.GRID_N, loss_grid.GRID_H, loss_grid.GRID_V))
    assert loss_grid.parse_sizes("8192,32768") == [8192, 32768]
    for bad, form, why in [("16384x8192", "NxHxV", "is not NxHxV"),
                           ("16384x8192x256000x1", "NxHxV", "is not NxHxV"),
                           ("8x4xa", "NxHxV", "is not NxHxV"), ("", "NxHxV", "is not NxHxV"),
                           ("8x4x2:16", "NxHxV", "is not NxHxV"),
                           ("8x0x2", "NxHxV", "has a size below 1"),
                           ("8x-4x2", "CxHxV", "has a size below 1"),
                           ("4x32x8x8192", "BxHQxHKVxTxD", "is not BxHQxHKVxTxD"),
                           ("8x4x2", "NxHxV:C1/C2/...", "is not NxHxV:C1/C2/..."),
                           ("8x4x2:16:8", "NxHxV:C1/C2/...", "is not NxHxV:C1/C2/..."),
                           ("8x4x2:16/", "NxHxV:C1/C2/...", "is not NxHxV:C1/C2/..."),
                           ("8x4x2:16/-1", "NxHxV:C1/C2/...", "has a size below 1")]:
        good = {"BxHQxHKVxTxD": "1x2x1x8x4", "NxHxV:C1/C2/...": "64x8x32:16"}.get(form, "64x8x32")
        with pytest.raises(ArgumentTypeError) as error:
            parse_shapes(f"{good},{bad}", form)  # the bad one named, not the list
        assert str(error.value) == f"{bad!r} {why}"
    # on the command line: argparse's one-line error naming the option and the value, exit 2
    for module, args, line in [
            ("flce", ["--shapes", "8192x2048x128256,16384x8192"],
             "error: argument --shapes: '16384x8192' is not NxHxV"),
            ("grad_gemms", ["--chunks", "16x8x0"],
             "error: argument --chunks: '16x8x0' has a size below 1"),
            ("chunk_sizes", ["--points", "64x8x32"],
             "error: argument --points: '64x8x32' is not NxHxV:C1/C2/..."),
            ("attention", ["--shapes", "4x32x8x8192"],
             "error: argument --shapes: '4x32x8x8192' is not BxHQxHKVxTxD"),
            ("tune_rows_kernel", ["--vocab", "32000,0"],
             "error: argument --vocab: '0' has a size below 1"),
            ("tune_rows_kernel", ["--rows", "8192,4k"],
             "error: argument --rows: '4k' is not a size")]:
        # in this process (each module's main parses before it asks for a GPU): a subprocess
        # apiece spent most of this test importing torch again
        bench = importlib.import_module(f"scripts.bench.{module}")
        monkeypatch.setattr(sys, "argv", [module, *args, "--out", str(tmp_path / "report")])
        with pytest.raises(SystemExit) as exit_:
            bench.main()
        assert exit_.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(line)
