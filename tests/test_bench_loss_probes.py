"""The loss benchmarks beside the grid: chunk sizes, float8, row passes, kernels, GEMMs."""

import os

import pytest
import torch

from scripts.bench import chunk_sizes as bench_chunk_sizes, flce as bench_flce
from scripts.bench import float8_grid as bench_float8_grid, grad_gemms as bench_grad_gemms
from scripts.bench import logits_epilogue as bench_logits_epilogue
from scripts.bench import loss_kernels as bench_loss_kernels
from scripts.bench import row_order as bench_row_order
from scripts.bench import row_overlap as bench_row_overlap
from scripts.bench import tune_rows_kernel as bench_tune_rows
from scripts.lib import loss_grid
from test_report_provenance import (CLEAN, KERNEL_META, chunk_sizes_report, float8_grid_report,
                                    float8_grid_results)


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
    """On the GPU, or on the CPU through Triton's interpreter (torch >= 2.12 runs rowwise-scaled
    float8 GEMMs there)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and tuple(map(int, torch.__version__.split(".")[:2])) < (2, 12):
        pytest.skip("torch < 2.12 runs only per-tensor float8 scales on the CPU")
    monkeypatch.setattr(bench_float8_grid.flce.ops, "DX_BLOCK_TOKENS", 16)
    monkeypatch.setattr(bench_float8_grid.flce.ops, "FLOAT8_DX_BLOCK_TOKENS", 8)
    scaled_mm, dx_rows = torch._scaled_mm, []

    def recording_scaled_mm(a, b, *args, use_fast_accum, **kwargs):
        if not use_fast_accum:  # the dx GEMM (the logits one accumulates fast)
            dx_rows.append(a.shape[0])
        return scaled_mm(a, b, *args, use_fast_accum=use_fast_accum, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", recording_scaled_mm)
    torch.manual_seed(0)
    x = torch.randn(40, 32, device=device, dtype=torch.bfloat16)
    w = torch.randn(48, 32, device=device, dtype=torch.bfloat16) / 6
    run, (f8, logits, out, dx, dw) = bench_float8_grid.float8_floor(
        x, w, max_logits_bytes=16 * 48 * 2)
    run()
    assert logits.shape == (16, 48)  # blocks of 16, 16 and 8 rows
    # dx in the float8 loss's dx row blocks (of at most 8 rows here), not the bf16 loss's (16)
    assert dx_rows == [8, 8, 8, 8, 8]
    expected_dx = logits.float() @ w.float()
    torch.testing.assert_close(dx[:16].float(), expected_dx, rtol=0.1,
                               atol=0.1 * expected_dx.abs().max().item())  # e4m3 dlogits
    # dW is bf16 summed in place: each block's fp32 product is added to it and rounded to bf16
    expected = torch.zeros_like(dw)
    for s, n in ((0, 16), (16, 16), (32, 8)):
        expected = (expected.float() + logits[:n].float().t() @ x[s:s + n].float()).bfloat16()
    ulp = 2.0 ** -7 * expected.float().abs().max().item()
    torch.testing.assert_close(dw.float(), expected.float(), rtol=2 ** -7, atol=ulp)
    torch.testing.assert_close(out[:16].float(), logits.float(), rtol=0.1, atol=0.3)  # e4m3 logits


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
