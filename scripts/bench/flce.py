"""Benchmark the fused loss against its peers and the bare-GEMM floor on one GPU.

Times forward+backward of lm_head + cross-entropy and the peak memory above the inputs, for:
this FLCE (default and memory-lean settings), the unfused loss eager and under torch.compile,
Liger-Kernel and Cut-Cross-Entropy when importable, and the three bare GEMMs (logits, dx, dW) at
the same shape, all of a shape in interleaved rounds of balanced orders (`TIMING`; with
--float8 each bare bf16 and float8 GEMM and the quantizations too). Writes JSON and a markdown
table into benchmarks/.

    python3 -m scripts.bench.flce                     # the three standard shapes
    python3 -m scripts.bench.flce --sweep             # plus chunk-size / accumulation variants
    python3 -m scripts.bench.flce --lean-paths        # plus memory_lean over token chunks and
                                                      # over vocabulary slices, each forced
    python3 -m scripts.bench.flce --float8            # the float8 loss against the bf16 one, the
                                                      # bare bf16 and float8 GEMMs, quantization
    python3 -m scripts.bench.flce --grid [--resume]   # N x H x V grid against the targets
                                                      # (benchmarks/flce_grid; resumable)

--grid times flce, flce_lean and the peers (compiled unfused, Liger, CCE) at every point of
the grid (`scripts/lib/loss_grid.py`, which also renders its report), each for about --seconds
(3 rounds at least, at most --reps in whole blocks), in rounds that visit the bare GEMMs and
every method once, in balanced orders (each run in each position and after each other run
equally often), each settled by 50 ms of untimed calls before its timed one
(`interleaved_rounds`; the JSON keeps every round's time, and the verdict says at which lost
points a peer was faster in every round), and writes the report after every point: a run cut
short by a time limit keeps what it measured, and --resume skips the points already in
<out>.json (with --remeasure --shapes S, measures S again in their place: after a change that
moves only those points). Where the logits do not fit, the bare-GEMM floor runs in row blocks
of at most 4 GiB of logits (dW summed in place, as a chunked loss must).
"""

import argparse
import json
import sys

if not __package__:  # run as a file: the repository root, scripts.lib with it, is not importable
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.flce ...")

import torch  # noqa: E402

import flce  # noqa: E402
from flce.ops import dx_row_blocks, gemm_operands, pick_chunk_size, uses_one_block  # noqa: E402
from scripts.lib.loss_grid import (GRID_METHODS, HOST_AHEAD, grid_markdown,  # noqa: E402
                                   grid_shapes, parse_shape, parse_shapes)
from scripts.lib.report import (grid_table, kernel_report_head, provenance,  # noqa: E402
                                report_file, write_report)
from scripts.lib.timing import (AHEAD_FILL, SETTLE_MS, interleaved_rounds,  # noqa: E402
                                medians, require_cuda)

SHAPES = "8192x2048x128256,16384x4096x128256,32768x2048x128256"
FLOOR_LOGITS_BYTES = 4 << 30
MiB = 1 << 20
TIMING = ("interleaved rounds: each round visits the bare GEMMs and every method once, in "
          "balanced orders (each in each position and after each other equally often), calls "
          f"each untimed for {SETTLE_MS:.0f} ms (once at least), then times one call; the "
          "median of the rounds")
COMPILED_PEER = ("unfused_compile is torch.compile's graph of the unfused loss for that one shape "
                 "(static, as a training run compiles it; `compiled_for_one_shape`)")
FLOAT8_METHODS = {"flce": "none", "flce_float8_logits": "logits",
                  "flce_float8_logits_dx": "logits+dx"}


def lean_paths(N, H, V) -> dict:
    """memory_lean at one N x H x V over its token chunks and over vocabulary slices, whichever
    it would take itself (`flce.vocab_sweep.uses_vocab_sweep`): where those bounds should fall.
    The slices need chunks shorter than N (else there is one chunk, which both take)."""
    import flce.vocab_sweep as sweep
    chunk = pick_chunk_size(N, H, V, 2, None, lean=True)  # lean's: whatever the element size

    def slices(x, t, w):  # the bounds read at the call; backward follows forward's path
        bounds = sweep.SWEEP_MAX_TOKENS, sweep.SWEEP_MIN_WEIGHT
        sweep.SWEEP_MAX_TOKENS, sweep.SWEEP_MIN_WEIGHT = N, 0
        try:
            return flce.fused_linear_cross_entropy(x, t, w, memory_lean=True)
        finally:
            sweep.SWEEP_MAX_TOKENS, sweep.SWEEP_MIN_WEIGHT = bounds

    return {"flce_lean_chunks": lambda x, t, w: flce.fused_linear_cross_entropy(
                x, t, w, memory_lean=True, chunk_size=chunk),  # a chunk size: no sweep
            "flce_lean_slices": slices}


def methods(N, H, V, sweep, float8=False, lean=False):
    """{name: loss(x, targets, w)} to time at one N x H x V; call it once per shape (lean: with
    memory_lean's two paths forced, `lean_paths`)."""
    if float8:
        return {name: (lambda f8: lambda x, t, w: flce.fused_linear_cross_entropy(
            x, t, w, float8=f8))(f8) for name, f8 in FLOAT8_METHODS.items()}
    m = {
        "flce": lambda x, t, w: flce.fused_linear_cross_entropy(x, t, w),
        "flce_lean": lambda x, t, w: flce.fused_linear_cross_entropy(x, t, w, memory_lean=True),
        "unfused_eager": lambda x, t, w: flce.linear_cross_entropy(x, t, w),
        "unfused_compile": compiled_for_one_shape(flce.linear_cross_entropy),
    }
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import \
            LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        m["liger"] = lambda x, t, w: liger(w, x, t)
    except ImportError as e:
        print(f"liger-kernel not importable ({e}); skipped")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        m["cce"] = lambda x, t, w: cce(x, w, t)
    except ImportError as e:
        print(f"cut-cross-entropy not importable ({e}); skipped")
    if lean:
        m |= lean_paths(N, H, V)
    if sweep:
        for c in (1024, 2048, 4096, 8192):
            for lean in (False, True):
                name = f"flce_c{c}" + ("_lean" if lean else "")
                m[name] = (lambda c, lean: lambda x, t, w: flce.fused_linear_cross_entropy(
                    x, t, w, chunk_size=c, memory_lean=lean))(c, lean)
    return m


def compiled_for_one_shape(fn):
    """torch.compile's best at one shape, as a training run (one shape) compiles it: a static
    graph. Without the reset, a process's second shape recompiles with N and V symbolic
    (automatic dynamic shapes) and every later shape runs that generic graph; with dynamic=False
    alone, the ninth shape would pass the recompile limit and run eagerly."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def first_calls(fns: dict, x, t, w) -> tuple[dict, dict]:
    """({name: forward+backward run} of the loss functions that fit in memory, {name: peak extra
    MiB, None where it did not fit}), each called once first: compilation and autotuning stay
    out of the measurements."""
    runs, mib = {}, {}
    for name, f in fns.items():
        run = fwd_bwd(f, x, t, w)
        try:
            run()
            mib[name] = peak_extra_mib(run, x, w)
            runs[name] = run
        except torch.OutOfMemoryError:
            mib[name] = None
        x.grad = w.grad = None
        torch.cuda.empty_cache()
    return runs, mib


def peak_extra_mib(fn, *params):
    """The peak of the bytes fn's allocations asked for, above what was allocated before it.
    Not the allocated bytes: the caching allocator hands out a cached block up to 1 MiB larger
    than asked for whole, and which block a call gets varies, so memory_lean and Liger, asking
    for the same buffers, came out up to 0.9 MiB apart either way."""
    for p in params:  # gradients are produced by the run, so they count as extra memory
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.memory_stats()["requested_bytes.all.peak"] - base) / MiB


def make_inputs(N, H, V, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, H, device="cuda", dtype=dtype, generator=g)
    w = (torch.randn(V, H, device="cuda", dtype=dtype, generator=g) / H ** 0.5)
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    t[torch.rand(N, device="cuda", generator=g) < 0.1] = -100
    return x.requires_grad_(), t, w.requires_grad_()


def fwd_bwd(f, x, t, w):
    def run():
        x.grad = w.grad = None
        f(x, t, w).backward()
    return run


def floor_row_blocks(N: int, V: int, elem_bytes: int, max_logits_bytes=None,
                     dx_block_tokens=None):
    """The floors' row blocks: (rows of the largest, [(start, rows, its `dx_row_blocks`)]),
    blocks of N rows or of as many as max_logits_bytes of logits hold; dx in blocks of at most
    dx_block_tokens rows (the bf16 loss's unless given)."""
    rows = N if max_logits_bytes is None else max(
        1, min(N, max_logits_bytes // (V * elem_bytes)))
    return rows, [(start, min(rows, N - start),
                   dx_row_blocks(min(rows, N - start), dx_block_tokens))
                  for start in range(0, N, rows)]


def gemm_floor(x, w, max_logits_bytes=None):
    """The three GEMMs of the loss (logits, dx, dW) at full size, or in row blocks whose logits
    take at most max_logits_bytes (dW summed in place over the blocks). dx runs in flce's dx row
    blocks (`flce.ops.dx_row_blocks`): one GEMM of 16384 rows at H = 8192 took up to 1.35x two of
    8192 on an H100, a floor the loss itself ran under. At an odd vocabulary they run at the
    width flce gives them (`flce.ops.gemm_operands`: W with zero rows up to a multiple of 16),
    where cuBLAS is fastest."""
    w = gemm_operands(w.detach(), None)[0]
    N, V = x.shape[0], w.shape[0]
    rows, row_blocks = floor_row_blocks(N, V, x.element_size(), max_logits_bytes)
    logits = torch.empty(rows, V, device=x.device, dtype=x.dtype)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    blocks = []  # (x's rows, their logits, [(logits rows, dx rows) of each dx block])
    for start, n, dx_bounds in row_blocks:
        block = logits[:n]
        dx_parts = [(block[lo:hi], dx[start + lo:start + hi]) for lo, hi in dx_bounds]
        blocks.append((x[start:start + n], block, dx_parts))

    def run():
        for i, (xs, block, dx_parts) in enumerate(blocks):
            torch.mm(xs, w.t(), out=block)
            for part, dx_rows in dx_parts:
                torch.mm(part, w, out=dx_rows)
            if i == 0:
                torch.mm(block.t(), xs, out=dw)
            else:
                dw.addmm_(block.t(), xs)
    return run, (logits, dx, dw)


def float8_gemm_runs(x, w, logits):
    """Each bare GEMM of the loss alone at full size, in bf16 and in float8 (rowwise scales,
    bf16 out, operands quantized beforehand, as flce/float8.py calls them), the float8 floor
    (float8 logits and dx, bf16 dW) and the quantizations the float8 loss adds."""
    from flce.float8 import Float8Gemms
    from flce.quantize_kernels import quantize_rows, quantize_scaled
    N, H = x.shape
    V = w.shape[0]
    target = torch.zeros(N, dtype=torch.long, device=x.device)
    f8 = Float8Gemms(w, None, target, N, dx=True, use_triton=True)  # W quantized, both ways
    col_absmax = torch.empty(H, device=x.device)
    quantize_rows(x, f8.x[:, :H], f8.x_scale[:, 0])
    quantize_rows(logits, f8.g[:, :V], f8.g_scale[:, 0])  # stand-in dlogits: timing only
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    fp8_logits_out = torch.empty(N, f8.width, device=x.device, dtype=torch.bfloat16)
    fp8_dx_out = torch.empty(N, f8.wt.shape[0], device=x.device, dtype=torch.bfloat16)
    bf16 = torch.bfloat16
    fp8_logits = lambda: torch._scaled_mm(f8.x, f8.w.t(), f8.x_scale, f8.w_scale, out_dtype=bf16,
                                          use_fast_accum=True, out=fp8_logits_out)
    fp8_dx = lambda: torch._scaled_mm(f8.g, f8.wt.t(), f8.g_scale, f8.wt_scale, out_dtype=bf16,
                                      use_fast_accum=False, out=fp8_dx_out)
    bf16_dw = lambda: torch.mm(logits.t(), x, out=dw)
    runs = {
        "bare_bf16_logits": (lambda: torch.mm(x, w.t(), out=logits), 1),
        "bare_bf16_dx": (lambda: torch.mm(logits, w, out=dx), 1),
        "bare_bf16_dW": (bf16_dw, 1),
        "bare_fp8_logits": (fp8_logits, 1),
        "bare_fp8_dx": (fp8_dx, 1),
        "bare_fp8_floor": (lambda: (fp8_logits(), fp8_dx(), bf16_dw()), 3),
        "quantize_W_rows": (lambda: quantize_rows(w, f8.w[:V, :H], f8.w_scale[0, :V],
                                                  col_absmax), 0),
        "quantize_W_cols": (lambda: quantize_scaled(w.t(), f8.wt[:H, :V], f8.wt_scale[0, :H]),
                            0),
        "quantize_x": (lambda: quantize_rows(x, f8.x[:, :H], f8.x_scale[:, 0]), 0),
    }
    return runs, (f8, dx, dw, fp8_logits_out)


def errors_vs_float64(fns, N, H, V, dtype):
    """Relative error of loss, dx, dW against float64 at [N, H] x [V, H] (fresh inputs)."""
    x, t, w = make_inputs(N, H, V, dtype, seed=1)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = flce.linear_cross_entropy(xr, t, wr)
    ref.backward()
    out = {}
    for name, f in fns.items():
        x.grad = w.grad = None
        loss = f(x, t, w)
        loss.backward()
        rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()
        out[name] = {"loss": rel(loss.detach(), ref.detach()), "dx": rel(x.grad, xr.grad),
                     "dW": rel(w.grad, wr.grad)}
    x.grad = w.grad = None
    return out


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.flce", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=None, type=parse_shapes,
                   help=f"comma-separated NxHxV (default {SHAPES}; with --grid: the grid's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=12,
                   help="at most this many rounds, in whole blocks of balanced orders")
    p.add_argument("--sweep", action="store_true", help="also time chunk/accumulation variants")
    p.add_argument("--lean-paths", action="store_true",
                   help="also time memory_lean over its token chunks and over vocabulary slices, "
                        "each forced (flce_lean_chunks, flce_lean_slices)")
    p.add_argument("--float8", action="store_true",
                   help="the float8 loss (flce float8=logits, logits+dx) against flce in bf16, "
                        "and each bare GEMM in bf16 and float8")
    p.add_argument("--ungated", action="store_true",
                   help="with --float8: the float8 GEMMs at every shape, below flce's threshold "
                        "(flce.ops.FLOAT8_MIN_TOKENS, FLOAT8_MIN_WORK) too: what sets it")
    p.add_argument("--only", default="", help="comma-separated method names to run")
    p.add_argument("--accuracy-tokens", type=int, default=4096,
                   help="tokens for the error-vs-float64 check at the first shape (0: skip)")
    p.add_argument("--grid", action="store_true",
                   help="flce, flce_lean and the peers at every point of the N x H x V grid")
    p.add_argument("--resume", action="store_true",
                   help="with --grid: keep the points already in <out>.json, measure the rest")
    p.add_argument("--remeasure", action="store_true",
                   help="with --grid --resume --shapes: measure those shapes again, replacing "
                        "their records in <out>.json (a change that moves only some points)")
    p.add_argument("--host-ahead", action="store_true",
                   help="time each call with its kernels queued behind GEMMs that keep the "
                        "GPU busy: its time alone, as in a step whose host runs ahead (at a "
                        "few thousand tokens a synchronised call also times the host's launches);"
                        " the records get the host's ms a call")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="about this long timing each method at each shape")
    p.add_argument("--out", default=None, help="output path without suffix (default: "
                   "benchmarks/flce_bench, benchmarks/flce_float8 with --float8, "
                   "benchmarks/flce_grid with --grid)")
    args = p.parse_args()
    if args.ungated and not args.float8:
        p.error("--ungated applies to --float8")
    if args.remeasure and not (args.grid and args.resume and args.shapes):
        p.error("--remeasure applies to --grid --resume with --shapes (the points to measure again)")
    args.out = args.out or ("benchmarks/flce_float8" if args.float8 else
                            "benchmarks/flce_grid" if args.grid else "benchmarks/flce_bench")
    if args.grid and not args.resume and report_file(args.out, ".json").exists():
        p.error(GRID_EXISTS.format(out=report_file(args.out, ".json")))
    require_cuda("scripts.bench.flce")
    origin = provenance()  # the commit (a dirty tree flagged) of the code that runs
    dtype = getattr(torch, args.dtype)
    if args.ungated:
        import flce.ops  # float8_used reads these at each call
        flce.ops.FLOAT8_MIN_TOKENS = flce.ops.FLOAT8_MIN_WORK = 0
    if args.grid:
        return run_grid(args, origin, dtype)
    args.shapes = args.shapes or parse_shapes(SHAPES)
    results, accuracy = [], {}
    for i, shape in enumerate(args.shapes):
        N, H, V = parse_shape(shape)
        fns = methods(N, H, V, args.sweep, args.float8, args.lean_paths)
        if args.only:
            fns = {k: v for k, v in fns.items() if k in args.only.split(",")}
        x, t, w = make_inputs(N, H, V, dtype)
        floor_run, bufs = gemm_floor(x.detach(), w.detach())
        bare, gemm_counts, keep = {"bare_gemms": floor_run}, {}, None
        if args.float8:
            f8_runs, keep = float8_gemm_runs(x.detach(), w.detach(), bufs[0][:, :V])
            bare |= {name: run for name, (run, _) in f8_runs.items()}
            gemm_counts = {name: n for name, (_, n) in f8_runs.items()}
        rounds, ms, mib, host = time_point(bare, fns, x, t, w, args.seconds, args.reps,
                                           args.host_ahead)
        floor_ms, flops = ms["bare_gemms"], 6 * N * H * V
        results.append({"shape": shape, "method": "bare_gemms", "ms": floor_ms,
                        "tflops": flops / floor_ms / 1e9, "extra_mib": None,
                        "rounds_ms": rounds["bare_gemms"]})
        print(f"{shape} bare_gemms {floor_ms:.2f} ms ({flops / floor_ms / 1e9:.0f} TFLOP/s)")
        for name, n_gemms in gemm_counts.items():
            tflops = n_gemms * 2 * N * H * V / ms[name] / 1e9 if n_gemms else None
            results.append({"shape": shape, "method": name, "ms": ms[name], "tflops": tflops,
                            "extra_mib": None, "vs_gemms": ms[name] / floor_ms,
                            "rounds_ms": rounds[name]})
            print(f"{shape} {name:22s} {ms[name]:8.2f} ms" +
                  (f" ({tflops:.0f} TFLOP/s)" if tflops else ""))
        for r in method_records(shape, fns, ms, mib, rounds, floor_ms, host):
            results.append(r)
            print(f"{shape} {r['method']:22s} " + ("OOM" if r["ms"] is None else
                  f"{r['ms']:8.2f} ms {r['vs_gemms']:5.2f}x gemms {r['extra_mib']:9.0f} MiB"))
        del x, t, w, floor_run, bufs, bare, keep
        torch.cuda.empty_cache()
        if i == 0 and args.accuracy_tokens:
            accuracy = errors_vs_float64(fns, args.accuracy_tokens, H, V, dtype)
            accuracy["shape"] = f"{args.accuracy_tokens}x{H}x{V}"
    meta = {**run_meta(origin, args.dtype), "seconds_per_method": args.seconds,
            **timing_meta(args.host_ahead)}
    if not args.float8 and "unfused_compile" in (args.only or "unfused_compile").split(","):
        meta["compiled_peer"] = COMPILED_PEER
    if args.ungated:
        meta["float8"] = "ungated: the float8 GEMMs at every shape, below flce's threshold too"
    text = markdown(meta, results, accuracy)
    write_report(args.out, {"meta": meta, "results": results, "accuracy": accuracy}, text)
    print(text)


def time_point(bare: dict, fns: dict, x, t, w, seconds: float, reps: int,
               host_ahead: bool = False):
    """(each run's round times, their medians, each method's peak extra MiB, each run's median
    host ms a call or {}) at one shape: the bare runs (no memory measured) and the methods that
    fit, in interleaved rounds (`TIMING`; with host_ahead, `HOST_AHEAD`)."""
    runs, mib = first_calls(fns, x, t, w)
    host = {} if host_ahead else None
    rounds = interleaved_rounds({**bare, **runs}, seconds, reps, host_ahead=host_ahead, host=host)
    return rounds, medians(rounds), mib, medians(host or {})


def timing_meta(host_ahead: bool) -> dict:
    return {"timing": TIMING + (f"; {HOST_AHEAD}" if host_ahead else ""),
            "host_ahead": host_ahead, **({"ahead_fill": AHEAD_FILL} if host_ahead else {})}


def method_records(shape, fns, ms, mib, rounds, floor_ms, host=None) -> list[dict]:
    """Each method's result at one shape with its rounds' times (`record`) and, when the host
    ran ahead, its median host ms a call."""
    return [{**record(shape, name, ms.get(name), mib[name], floor_ms),
             "rounds_ms": rounds.get(name, []),
             **({"host_ms": host.get(name)} if host else {})} for name in fns]


def record(shape, name, ms, mib, floor_ms) -> dict:
    """One method's result at one shape; ms and mib None where it did not fit in memory."""
    return {"shape": shape, "method": name, "ms": ms, "extra_mib": mib,
            "vs_gemms": None if ms is None else ms / floor_ms}


def run_meta(origin: dict, dtype: str) -> dict:
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, **origin, "dtype": dtype,
            "targets": "10% of targets = -100; extra memory = peak bytes requested above the "
                       "inputs (`peak_extra_mib`)"}


# a grid resumed keeps these of its report (reports from before host_ahead timed synchronised)
# ahead_fill: the rule of the GEMMs ahead of each timed call with the host ahead
# (`timing.AHEAD_FILL`); earlier reports slept the GPU instead, each run its own sleep, or one
# for all (ahead_sleep "one a point", 86d920c-328388a)
RESUMED_SETUP = {"gpu": None, "torch": None, "triton": None, "dtype": None, "host_ahead": False,
                 "ahead_fill": None, "ahead_sleep": None,
                 "targets": None}  # targets: how extra memory is counted


def grid_plan(earlier: dict | None, shapes: list[str], remeasure: bool, meta: dict
              ) -> tuple[list[dict], list[str]]:
    """The records kept from an earlier report (--resume) and the shapes left to measure: those
    of `shapes` it lacks, or with remeasure all of `shapes`, their earlier records dropped.
    Records written before points named their run are dated by the report's meta. A report
    of another GPU, torch, triton, dtype or timing (host ahead or not) than this run's (`meta`) is
    refused."""
    if earlier is None:
        return [], list(shapes)
    for key, default in RESUMED_SETUP.items():
        was, now = earlier["meta"].get(key, default), meta.get(key, default)
        if was != now:
            sys.exit(f"error: --resume: the earlier report's {key} is {was!r}, this run's "
                     f"{now!r}: one grid is one setup (another --out?)")
    results = [r for r in earlier["results"] if not (remeasure and r["shape"] in shapes)]
    for r in results:
        if r["method"] == "bare_gemms" and "git" not in r:
            r.update(git=earlier["meta"]["git"], date=earlier["meta"]["date"])
    done = {r["shape"] for r in results if r["method"] == "bare_gemms"}
    return results, [s for s in shapes if s not in done]


def in_grid_order(results: list[dict]) -> list[dict]:
    """Records by N, then H, then V (a remeasured point goes back to its row), each shape's
    methods in the order measured."""
    return sorted(results, key=lambda r: parse_shape(r["shape"]))


# a grid is written point by point: a fresh run over a report (the committed one is the
# default --out) would replace it with fewer points at the first
GRID_EXISTS = ("{out} exists: --resume measures the points it lacks, --out names a new report "
               "(a fresh grid would replace it point by point)")


def run_grid(args, origin, dtype):
    out = report_file(args.out, ".json")
    earlier = json.loads(out.read_text()) if args.resume and out.exists() else None
    meta = {**run_meta(origin, args.dtype), "seconds_per_method": args.seconds,
            **timing_meta(args.host_ahead), "compiled_peer": COMPILED_PEER}
    results, todo = grid_plan(earlier, args.shapes or grid_shapes(), args.remeasure, meta)
    for shape in todo:
        N, H, V = parse_shape(shape)
        fns = {k: f for k, f in methods(N, H, V, sweep=False).items() if k in GRID_METHODS}
        x, t, w = make_inputs(N, H, V, dtype)
        floor_run, bufs = gemm_floor(x.detach(), w.detach(), FLOOR_LOGITS_BYTES)
        rounds, ms, mib, host = time_point({"bare_gemms": floor_run}, fns, x, t, w,
                                           args.seconds, args.reps, args.host_ahead)
        floor_ms = ms["bare_gemms"]
        point = [{"shape": shape, "method": "bare_gemms", "ms": floor_ms,
                  "tflops": 6 * N * H * V / floor_ms / 1e9, "extra_mib": None,
                  "flce_path": flce_path(N, H, V, x.element_size()),
                  "rounds_ms": rounds["bare_gemms"], "git": meta["git"], "date": meta["date"],
                  **({"host_ms": host["bare_gemms"]} if host else {})}]
        point += method_records(shape, fns, ms, mib, rounds, floor_ms, host)
        del x, t, w, floor_run, bufs
        torch.cuda.empty_cache()
        results = in_grid_order(results + point)
        print(" | ".join([shape, f"gemms {floor_ms:.2f} ms"] + [
            f"{r['method']} " + ("OOM" if r["ms"] is None else f"{r['vs_gemms']:.3f}x "
                                 f"{r['extra_mib']:.0f} MiB") for r in point[1:]]), flush=True)
        write_report(args.out, {"meta": meta, "results": results}, grid_markdown(meta, results))
    print(grid_markdown(meta, results))


def flce_path(N, H, V, elem_bytes, chunk_size=None, lean: bool = False) -> str:
    """Which sweep flce takes at this shape (flce/ops.py) for this chunk_size (None: its own
    choice) and memory_lean, in any float8 mode: "one block" or "chunks of C", with " (lean)"
    for memory_lean."""
    if uses_one_block(N, H, V, elem_bytes, chunk_size, lean):
        return "one block"
    chunks = f"chunks of {pick_chunk_size(N, H, V, elem_bytes, chunk_size, lean)}"
    return chunks + (" (lean)" if lean else "")


def _method_cell(name, r):
    if r is None:
        return "-"
    if name.startswith("bare_"):
        return f"{r['ms']:.1f} ({r['tflops']:.0f} TFLOP/s)"
    if name.startswith("quantize_"):
        return f"{r['ms']:.2f}"
    if r["ms"] is None:
        return "OOM"
    return f"{r['ms']:.1f} / {r['extra_mib']:.0f} ({r['vs_gemms']:.2f}×)"


def markdown(meta, results, accuracy):
    lines = [*kernel_report_head(meta, meta["dtype"]),
             "Forward+backward, median ms / peak extra MiB (× the three bare GEMMs' time)."
             + (f" Timing: {meta['timing']}." if meta.get("timing") else "")
             + (f" {meta['compiled_peer']}." if meta.get("compiled_peer") else ""), "",
             *grid_table(results, "method", "N×H×V", _method_cell)]
    if meta.get("float8"):
        lines += ["", f"float8 {meta['float8']}."]
    if any(r["method"].startswith("bare_fp8") for r in results):
        lines += ["", "bare_gemms: the three bf16 GEMMs (logits, dx, dW); bare_*: one GEMM alone "
                  "at full size, float8 ones with rowwise scales and bf16 output; bare_fp8_floor: "
                  "float8 logits and dx + bf16 dW. quantize_*: ms of the float8 loss's "
                  "quantizations, once per call: W_rows (W per row, one read that also finds "
                  "its column maxima), W_cols (W per column with those maxima); x per chunk."]
    if accuracy:
        lines += ["", f"Relative error against float64 at {accuracy['shape']} (loss / dx / dW):", "",
                  "| method | loss | dx | dW |", "|---|---|---|---|"]
        for n, e in accuracy.items():
            if n != "shape":
                lines.append(f"| {n} | {e['loss']:.1e} | {e['dx']:.1e} | {e['dW']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
