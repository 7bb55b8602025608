"""The chunked sweep's row pass with pass 2 walking each row backwards (as flce runs it) against
pass 2 in pass 1's order, end to end: forward+backward of the loss, not the kernel alone.

    python3 -m scripts.bench.row_order --shapes 65536x1024x128256,...

Per chunk the row kernel reads each row for its statistics, then reads it again and writes
dlogits. flce walks the second pass from the row's last block back to its first, so that the
blocks read last are re-read while still in L2 (`flce/kernels.py`); `tune_rows_kernel` times
that kernel alone. Here the whole loss is timed in interleaved rounds with the bare GEMMs, in
three variants: flce as it runs; `forward_order` (the same blocks, pass 2 in pass 1's order:
bitwise flce's results, checked at each point); `previous_rule` (forward order, and the blocks
and warps of the rule before the backward walk: 8192 columns on 16 warps where V <= 40960,
4096 on 8 above). Writes <out>.json and <out>.md.
"""

import argparse
import contextlib
import sys

if not __package__:
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.row_order ...")

import torch  # noqa: E402

import flce  # noqa: E402
import flce.kernels  # noqa: E402
from scripts.bench.flce import (FLOOR_LOGITS_BYTES, first_calls, gemm_floor,  # noqa: E402
                                make_inputs, run_meta)
from scripts.bench.row_overlap import bitwise_same, flce_path  # noqa: E402
from scripts.lib.report import kernel_report_head, provenance, write_report  # noqa: E402
from scripts.lib.timing import interleaved_rounds, medians  # noqa: E402

LAUNCH_ROWS = flce.kernels.launch_rows


def previous_blocks(V: int) -> tuple[int, int]:
    """BLOCK_V and warps of both passes in one kernel before the backward walk (many rows)."""
    return (8192, 16) if V <= 40960 else (4096, 8)


def launch_rows_with(previous_rule: bool):
    """launch_rows with pass 2 in pass 1's order (and, with previous_rule, the old blocks) where
    both passes run in one kernel without the e4m3 copy; every other pass as it is."""
    def launch(logits, target, loss_out, stats, weight, opts, stats_given, compute_grad, *args,
               **kwargs):
        if compute_grad and not stats_given and kwargs.get("fp8_grad") is None:
            kwargs["reverse_grad"] = False
            if previous_rule and logits.shape[0] > 512:
                kwargs["block_v"], kwargs["num_warps"] = previous_blocks(logits.shape[1])
        return LAUNCH_ROWS(logits, target, loss_out, stats, weight, opts, stats_given,
                           compute_grad, *args, **kwargs)
    return launch


@contextlib.contextmanager
def row_launcher(launch):
    flce.kernels.launch_rows = launch
    try:
        yield
    finally:
        flce.kernels.launch_rows = LAUNCH_ROWS


def loss_with(launch):
    def f(x, t, w):
        with row_launcher(launch):
            return flce.fused_linear_cross_entropy(x, t, w)
    return f


def variants() -> dict:
    return {"flce": loss_with(LAUNCH_ROWS),
            "forward_order": loss_with(launch_rows_with(previous_rule=False)),
            "previous_rule": loss_with(launch_rows_with(previous_rule=True))}


def measure_point(shape: str, seconds: float, reps: int) -> dict:
    N, H, V = map(int, shape.split("x"))
    x, t, w = make_inputs(N, H, V, torch.bfloat16)
    fns = variants()
    same = bitwise_same({k: fns[k] for k in ("flce", "forward_order")}, x, t, w)
    floor_run, buffers = gemm_floor(x.detach(), w.detach(), FLOOR_LOGITS_BYTES)
    runs, mib = first_calls(fns, x, t, w)
    rounds = interleaved_rounds({"bare_gemms": floor_run, **runs}, seconds, reps)
    ms = medians(rounds)
    point = {"shape": shape, "path": flce_path(N, H, V), "gemms_ms": ms["bare_gemms"],
             "runs": [{"run": name, "ms": ms.get(name), "extra_mib": mib[name],
                       "bitwise_same": same.get(name), "rounds_ms": rounds.get(name, [])}
                      for name in fns]}
    del x, t, w, runs, floor_run, buffers
    torch.cuda.empty_cache()
    return point


BITWISE = {True: "yes", False: "NO", None: "-"}


def markdown(meta: dict, results: list[dict]) -> str:
    lines = [*kernel_report_head(meta, "bfloat16"),
             "flce forward+backward as it runs (pass 2 of the row kernel walks each row "
             "backwards), with pass 2 in pass 1's order (forward_order), and with that order "
             "and the blocks and warps of the rule before it (previous_rule), in interleaved "
             "rounds: ms (× the bare GEMMs; × flce) / peak extra MiB; bitwise: loss, dx and dW "
             "equal flce's.", "",
             "| N×H×V | flce path | run | ms | × GEMMs | × flce | MiB | bitwise |",
             "|---|---|---|---|---|---|---|---|"]
    ratios = {}  # each variant's time over flce's
    for point in results:
        base = next(r["ms"] for r in point["runs"] if r["run"] == "flce")
        for r in point["runs"]:
            head = f"| {point['shape']} | {point['path']} | {r['run']} | "
            if r["ms"] is None:
                lines.append(head + "OOM | - | - | - | - |")
                continue
            lines.append(head + f"{r['ms']:.2f} | {r['ms'] / point['gemms_ms']:.3f}× | "
                         f"{r['ms'] / base:.3f}× | {r['extra_mib']:.0f} | "
                         f"{BITWISE[r['bitwise_same']]} |")
            if r["run"] != "flce":
                ratios.setdefault(r["run"], []).append(r["ms"] / base)
    if ratios:
        lines.append("")
        lines += [f"{name} over flce: {min(v):.3f}-{max(v):.3f}× at {len(v)} points."
                  for name, v in ratios.items()]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(prog="python3 -m scripts.bench.row_order", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", required=True, help="comma-separated NxHxV")
    p.add_argument("--seconds", type=float, default=0.5,
                   help="about this long timing each run at each point")
    p.add_argument("--reps", type=int, default=20, help="at most this many rounds")
    p.add_argument("--out", default="benchmarks/flce_row_order", help="output path without suffix")
    args = p.parse_args()
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    meta = {**run_meta(provenance(), "bfloat16"), "seconds_per_run": args.seconds}
    results = []
    for shape in args.shapes.split(","):
        results.append(measure_point(shape, args.seconds, args.reps))
        print(" | ".join([shape] + [f"{r['run']} {r['ms']:.2f} ms" for r in results[-1]["runs"]
                                    if r["ms"] is not None]), flush=True)
        write_report(args.out, {"meta": meta, "results": results}, markdown(meta, results))
    print(markdown(meta, results))


if __name__ == "__main__":
    main()
