"""scripts.bench.flce and its grid (scripts/lib/loss_grid.py): methods, floors, verdicts, memory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.bench import flce as bench_flce
from scripts.lib import loss_grid
from test_report_provenance import CLEAN, KERNEL_META, flce_report

REPO = Path(__file__).resolve().parents[1]


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
