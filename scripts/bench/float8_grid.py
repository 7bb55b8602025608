"""The float8 loss over the whole N x H x V grid of `bench.flce --grid`: against the bf16 loss
and against its own floor, the float8 GEMMs alone.

    python3 -m scripts.bench.float8_grid [--resume] [--shapes NxHxV,...]

At each point: flce in bf16, flce with float8="logits+dx" (which runs the bf16 GEMMs below
flce's threshold, `flce.ops.float8_used`: the report says where), the bare bf16 GEMMs and the
float8 floor (float8 logits and dx GEMMs with their operands quantized beforehand, bf16 dW; in
row blocks where the logits would not fit, dx in flce's dx row blocks, as the bf16 floor),
timed in interleaved rounds as the bf16 grid. The targets it checks: the float8 loss never
slower than the bf16 loss, and within 1.15x its float8 floor where the GEMMs take 10 ms or more.
Writes <out>.json and <out>.md after every point; --resume skips the points already in
<out>.json.
"""

import argparse
import json
import math
import sys

if not __package__:
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.float8_grid ...")

import torch  # noqa: E402

import flce  # noqa: E402
from flce.ops import float8_dx_block_tokens, float8_used, gemm_operands  # noqa: E402
from scripts.bench.flce import (FLOOR_LOGITS_BYTES, GRID_EXISTS, first_calls,  # noqa: E402
                                floor_row_blocks, gemm_floor, make_inputs, run_meta)
from scripts.lib.loss_grid import (grid_shapes, hbm_peak, logit_traffic_ms,  # noqa: E402
                                   parse_shape, parse_shapes)
from scripts.lib.report import (kernel_report_head, provenance, report_file,  # noqa: E402
                                write_report)
from scripts.lib.timing import SETTLE_MS, interleaved_rounds, medians, require_cuda  # noqa: E402

MODE = "logits+dx"
FLOOR_TARGET = 1.15  # the bound on the float8 loss over its float8 floor
# The least any float8 loss that leaves the GEMMs to cuBLAS moves per logit beyond the GEMMs'
# own traffic: one read of the logits (2) and the writes of the bf16 dlogits for the bf16 dW
# GEMM (2) and the e4m3 ones for the float8 dx GEMM (1). flce's passes read each logit twice
# (7 bytes), but the second read can come from L2 (the bf16 loss beat a two-read floor), so
# only the single read bounds every loss.
ROW_BYTES = 5


def row_pass_ms(shape: str, bytes_per_s: float) -> float:
    """The least row-pass time of a float8 loss at the HBM's peak: ROW_BYTES·N·V bytes, in ms."""
    return logit_traffic_ms(shape, ROW_BYTES, bytes_per_s)


def float8_floor(x, w, max_logits_bytes=None):
    """The float8 loss's GEMMs alone: float8 logits and dx (rowwise scales, bf16 out, operands
    quantized beforehand, as flce/float8.py calls them) and the bf16 dW, at full size or in row
    blocks whose logits take at most max_logits_bytes (dW summed in place). The float8 dx runs in
    the float8 loss's row blocks (`dx_row_blocks` of `float8_dx_block_tokens` rows): cuBLAS's
    kernel for it changes with the rows. The operands hold real values (x's first rows,
    their logits as the stand-in dlogits), not zeros, which a GEMM runs faster on."""
    from flce.float8 import Float8Gemms
    from flce.quantize_kernels import quantize_rows
    w = gemm_operands(w.detach(), None)[0]
    (N, H), V = x.shape, w.shape[0]
    rows, row_blocks = floor_row_blocks(N, V, x.element_size(), max_logits_bytes,
                                        float8_dx_block_tokens(H))
    target = torch.zeros(N, dtype=torch.long, device=x.device)
    f8 = Float8Gemms(w, None, target, rows, dx=True, use_triton=True)
    logits = torch.mm(x[:rows], w.t())
    quantize_rows(x[:rows], f8.x[:, :H], f8.x_scale[:, 0])
    quantize_rows(logits, f8.g[:, :V], f8.g_scale[:, 0])
    out = torch.empty(rows, f8.width, device=x.device, dtype=torch.bfloat16)
    dx = torch.empty(rows, f8.wt.shape[0], device=x.device, dtype=torch.bfloat16)
    dw = torch.empty_like(w)

    def run():
        for start, n, dx_bounds in row_blocks:
            torch._scaled_mm(f8.x[:n], f8.w.t(), f8.x_scale[:n], f8.w_scale,
                             out_dtype=torch.bfloat16, use_fast_accum=True, out=out[:n])
            for lo, hi in dx_bounds:
                torch._scaled_mm(f8.g[lo:hi], f8.wt.t(), f8.g_scale[lo:hi], f8.wt_scale,
                                 out_dtype=torch.bfloat16, use_fast_accum=False,
                                 out=dx[lo:hi])
            if start == 0:
                torch.mm(logits[:n].t(), x[start:start + n], out=dw)
            else:
                dw.addmm_(logits[:n].t(), x[start:start + n])
    return run, (f8, logits, out, dx, dw)


def measure_point(shape: str, dtype, seconds: float, reps: int) -> list[dict]:
    N, H, V = parse_shape(shape)
    x, t, w = make_inputs(N, H, V, dtype)
    runs = {"bare_gemms": gemm_floor(x.detach(), w.detach(), FLOOR_LOGITS_BYTES)[0],
            "float8_floor": float8_floor(x.detach(), w.detach(), FLOOR_LOGITS_BYTES)[0]}
    losses = {name: (lambda x, t, w, mode=mode: flce.fused_linear_cross_entropy(
        x, t, w, float8=mode)) for name, mode in (("flce", "none"), ("flce_float8", MODE))}
    timed, mib = first_calls(losses, x, t, w)
    rounds = interleaved_rounds({**runs, **timed}, seconds, reps)
    ms = medians(rounds)
    gemms, floor8 = ms["bare_gemms"], ms["float8_floor"]
    point = [{"shape": shape, "method": "bare_gemms", "ms": gemms,
              "rounds_ms": rounds["bare_gemms"], "float8_used": float8_used(MODE, N, H, V)},
             {"shape": shape, "method": "float8_floor", "ms": floor8,
              "vs_gemms": floor8 / gemms, "rounds_ms": rounds["float8_floor"]}]
    for name in ("flce", "flce_float8"):
        m = ms.get(name)
        point.append({"shape": shape, "method": name, "ms": m, "extra_mib": mib[name],
                      "vs_gemms": None if m is None else m / gemms,
                      "vs_float8_floor": None if m is None else m / floor8,
                      "rounds_ms": rounds.get(name, [])})
    del x, t, w, runs
    torch.cuda.empty_cache()
    return point


def verdict(results: list[dict], gpu: str = "") -> list[str]:
    """The two targets, each with what the grid measured, and on a GPU of known HBM peak the
    points where no row pass could meet the second."""
    at = {(r["shape"], r["method"]): r for r in results}
    shapes = [s for s in dict.fromkeys(r["shape"] for r in results)
              if (at.get((s, "flce_float8")) or {}).get("ms") is not None
              and (at.get((s, "flce")) or {}).get("ms") is not None]
    if not shapes:
        return ["no grid point measured both losses"]
    used = [s for s in shapes if at[s, "bare_gemms"]["float8_used"] != "none"]
    slower = [s for s in shapes if at[s, "flce_float8"]["ms"] > at[s, "flce"]["ms"]]
    clear = [s for s in slower if max(at[s, "flce"]["rounds_ms"]) <
             min(at[s, "flce_float8"]["rounds_ms"])]
    lines = [f"- float8 GEMMs used at {len(used)} of {len(shapes)} points (below flce's "
             f"threshold the float8 loss runs the bf16 GEMMs: the same code as flce)",
             f"- the float8 loss no slower than the bf16 loss: {len(shapes) - len(slower)} of "
             f"{len(shapes)} points; at {len(clear)} of the {len(slower)} others slower in every "
             f"round than bf16 in its slowest" + (f": {', '.join(clear)}" if clear else "")]
    long = [s for s in used if at[s, "bare_gemms"]["ms"] >= 10]
    if long:
        ratios = [at[s, "flce_float8"]["vs_float8_floor"] for s in long]
        lines.append(f"- the float8 loss ≤ {FLOOR_TARGET}× its float8 floor where the bf16 "
                     f"GEMMs take ≥ 10 ms: {sum(r <= FLOOR_TARGET for r in ratios)} of "
                     f"{len(long)} (worst {max(ratios):.3f}×; geometric mean "
                     f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}×)")
        peak = hbm_peak(gpu)
        if peak:
            lines.append(ceiling_line(at, long, peak))
    speedup = [at[s, "flce"]["ms"] / at[s, "flce_float8"]["ms"] for s in used]
    if speedup:
        lines.append(f"- where float8 is used, the bf16 loss's time over the float8 loss's: "
                     f"{min(speedup):.2f}-{max(speedup):.2f}×")
    return lines


def ceiling_line(at: dict, long: list[str], bytes_per_s: float) -> str:
    """The float8 loss over its floor were its row passes to move only ROW_BYTES a logit at the
    HBM's peak and nothing else added, at each of the `long` points, and where that alone
    exceeds the target."""
    floor = {s: at[s, "float8_floor"]["ms"] for s in long}
    ceiling = {s: 1 + row_pass_ms(s, bytes_per_s) / floor[s] for s in long}
    out = sorted((s for s in long if ceiling[s] > FLOOR_TARGET), key=ceiling.get)
    above = [(at[s, "flce_float8"]["ms"] - floor[s]) / row_pass_ms(s, bytes_per_s) for s in long]
    text = (f"- its ceiling: the least row traffic (one read of the logits, bf16 and e4m3 "
            f"dlogits written: {ROW_BYTES} bytes a logit) at the HBM's peak "
            f"({bytes_per_s / 1e12:.2f} TB/s) puts the float8 loss at {min(ceiling.values()):.3f}-"
            f"{max(ceiling.values()):.3f}× its floor at those {len(long)} points; ≤ "
            f"{FLOOR_TARGET}× is out of reach at {len(out)}")
    if out:
        text += (f" ({', '.join(out)}: {ceiling[out[0]]:.3f}-{ceiling[out[-1]]:.3f}×)")
    return text + (f"; its time above the floor is a median "
                   f"{sorted(above)[len(above) // 2]:.2f}× those passes' time at the peak")


def markdown(meta: dict, results: list[dict]) -> str:
    at = {(r["shape"], r["method"]): r for r in results}
    cell = lambda r, key: "OOM" if r is None or r["ms"] is None else f"{r[key]:.3f}×"  # noqa: E731
    lines = [*kernel_report_head(meta, meta["dtype"]),
             "Forward+backward: the bf16 loss (flce) and the float8 loss (flce, "
             f"float8=\"{MODE}\") against the bare bf16 GEMMs (ms) and the float8 floor "
             "(float8 logits and dx GEMMs, bf16 dW; × the bf16 GEMMs); the float8 loss also × "
             "its float8 floor.", "",
             *verdict(results, meta["gpu"]), "",
             "| N×H×V | float8 GEMMs | bare bf16 GEMMs ms | float8 floor | flce | flce_float8 | "
             "flce_float8 × its floor | MiB bf16 / float8 |",
             "|---|---|---|---|---|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in results):
        gemms, f8, b, q = (at.get((shape, m)) for m in
                           ("bare_gemms", "float8_floor", "flce", "flce_float8"))
        used = "yes" if gemms["float8_used"] != "none" else "no (below the threshold)"
        mib = " / ".join("-" if r is None or r.get("extra_mib") is None else
                         f"{r['extra_mib']:.0f}" for r in (b, q))
        lines.append(f"| {shape} | {used} | {gemms['ms']:.2f} | {cell(f8, 'vs_gemms')} | "
                     f"{cell(b, 'vs_gemms')} | {cell(q, 'vs_gemms')} | "
                     f"{cell(q, 'vs_float8_floor')} | {mib} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.float8_grid", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=None, type=parse_shapes,
                   help="comma-separated NxHxV (default: the grid)")
    p.add_argument("--seconds", type=float, default=0.5,
                   help="about this long timing each run at each point")
    p.add_argument("--reps", type=int, default=20, help="at most this many rounds")
    p.add_argument("--resume", action="store_true",
                   help="keep the points already in <out>.json, measure the rest")
    p.add_argument("--out", default="benchmarks/flce_float8_grid",
                   help="output path without suffix")
    args = p.parse_args()
    path = report_file(args.out, ".json")
    if not args.resume and path.exists():
        p.error(GRID_EXISTS.format(out=path))
    require_cuda("scripts.bench.float8_grid")
    results = json.loads(path.read_text())["results"] if args.resume and path.exists() else []
    done = {r["shape"] for r in results}
    meta = {**run_meta(provenance(), "bfloat16"), "seconds_per_run": args.seconds,
            "timing": "interleaved rounds as bench.flce --grid (each visit settled for "
                      f"{SETTLE_MS:.0f} ms, in balanced orders); the median"}
    for shape in args.shapes or grid_shapes():
        if shape in done:
            continue
        results += measure_point(shape, torch.bfloat16, args.seconds, args.reps)
        print(" | ".join(f"{r['method']} " + ("OOM" if r["ms"] is None else f"{r['ms']:.2f} ms")
                         for r in results[-4:]), shape, flush=True)
        write_report(args.out, {"meta": meta, "results": results}, markdown(meta, results))
    print(markdown(meta, results))


if __name__ == "__main__":
    main()
