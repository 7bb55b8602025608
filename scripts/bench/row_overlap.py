"""Would the chunked sweep gain from running its row pass beside a GEMM? An experiment, not a
path of the loss.

    python3 -m scripts.bench.row_overlap --shapes 65536x1024x128256,...

flce's chunked sweep (`flce.ops.chunk_loop`) runs, per chunk, the logits GEMM, the row pass
(memory-bound: ~15% of the three GEMMs' time at H = 1024) and the dx and dW GEMMs one after
another on one stream. The variant here keeps two logits buffers and puts chunk i's row pass on
a second stream, where it can run while the main stream's logits GEMM of chunk i + 1 does; the
GEMMs stay in order on the main stream, so dW sums the chunks in the same order and every
result is bitwise the same (checked at each point). Timed against flce and the bare GEMMs in
interleaved rounds, with the side stream at the default and at the highest priority. Writes
<out>.json and <out>.md.
"""

import argparse
import contextlib
import sys

if not __package__:
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.row_overlap ...")

import torch  # noqa: E402

import flce  # noqa: E402
import flce.ops  # noqa: E402
from flce.ops import gemm_operands, gemm_vocab, matmul_into  # noqa: E402
from scripts.bench.flce import (FLOOR_LOGITS_BYTES, first_calls, gemm_floor,  # noqa: E402
                                make_inputs, run_meta)
from scripts.bench.flce import flce_path as flce_sweep  # noqa: E402
from scripts.lib.loss_grid import parse_shape, parse_shapes  # noqa: E402
from scripts.lib.report import kernel_report_head, provenance, write_report  # noqa: E402
from scripts.lib.timing import interleaved_rounds, medians, require_cuda  # noqa: E402

SEQUENTIAL = flce.ops.chunk_loop


def overlapped_chunk_loop(side: torch.cuda.Stream):
    """chunk_loop's signature and results, the row pass of each chunk on `side` beside the next
    chunk's logits GEMM (bf16 only: no bias, db or float8; those take the sequential loop)."""
    def loop(x, weight, bias, chunk_size, row_pass, dx, dw_acc, db_acc, fp8=None):
        if fp8 is not None or bias is not None or db_acc is not None:
            return SEQUENTIAL(x, weight, bias, chunk_size, row_pass, dx, dw_acc, db_acc, fp8)
        N, V = x.shape[0], weight.shape[0]
        width = gemm_vocab(V, x.element_size())
        C = min(chunk_size, N)
        buffers = [torch.empty(C, width, device=x.device, dtype=x.dtype) for _ in range(2)]
        w = gemm_operands(weight, None)[0]
        main = torch.cuda.current_stream()
        starts = range(0, N, chunk_size)

        def logits_of(i):
            start = starts[i]
            block = buffers[i % 2][:min(C, N - start)]
            torch.mm(x[start:start + len(block)], w.t(), out=block)
            written = torch.cuda.Event()
            written.record(main)
            return block, written

        pending = logits_of(0)
        for i, start in enumerate(starts):
            block, written = pending
            end = start + len(block)
            side.wait_event(written)
            with torch.cuda.stream(side):
                row_pass(block if width == V else block[:, :V], start, end, width)
            done = torch.cuda.Event()
            done.record(side)
            if i + 1 < len(starts):
                pending = logits_of(i + 1)  # the other buffer: its last reader ran on main
            main.wait_event(done)
            if dx is not None:
                matmul_into(dx[start:end], block, w, accumulate=False)
            if dw_acc is not None:
                matmul_into(dw_acc, block.t(), x[start:end], accumulate=start > 0)
    return loop


@contextlib.contextmanager
def replaced(module, name: str, value):
    """module.name is value inside the block, and what it was again after it."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def chunk_loop(loop):
    return replaced(flce.ops, "chunk_loop", loop)


def loss_replacing(module, name: str, value):
    """flce's loss with module.name replaced by value while it runs (its backward included:
    the chunked sweep does all its work in forward)."""
    def f(x, t, w):
        with replaced(module, name, value):
            return flce.fused_linear_cross_entropy(x, t, w)
    return f


def variants() -> dict:
    low, high = torch.cuda.Stream.priority_range()  # (lowest, highest): numerically low > high
    overlap = lambda priority: loss_replacing(  # noqa: E731
        flce.ops, "chunk_loop", overlapped_chunk_loop(torch.cuda.Stream(priority=priority)))
    return {"flce": loss_replacing(flce.ops, "chunk_loop", SEQUENTIAL),
            "overlap": overlap(low), "overlap_high_priority": overlap(high)}


def bitwise_same(fns: dict, x, t, w) -> dict:
    """{name: whether its loss, dx and dW equal flce's bit for bit; None where it (or flce) ran
    out of memory}. Each result moves to the host: the GPU's memory is what is measured next."""
    out = {}
    for name, f in fns.items():
        x.grad = w.grad = None
        try:
            loss = f(x, t, w)
            loss.backward()
            out[name] = (loss.detach().cpu(), x.grad.cpu(), w.grad.cpu())
        except torch.OutOfMemoryError:
            out[name] = None
        torch.cuda.empty_cache()
    x.grad = w.grad = None
    return {name: None if got is None or out["flce"] is None
            else all(map(torch.equal, out["flce"], got)) for name, got in out.items()}


def measure_point(shape: str, seconds: float, reps: int, make_variants=None) -> dict:
    """One point: flce and its variants (`variants()`, or make_variants'; flce first) timed in
    interleaved rounds with the bare GEMMs, and whether each
    gives flce's results bit for bit."""
    N, H, V = parse_shape(shape)
    x, t, w = make_inputs(N, H, V, torch.bfloat16)
    fns = (make_variants or variants)()
    same = bitwise_same(fns, x, t, w)
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


def flce_path(N, H, V) -> str:
    path = flce_sweep(N, H, V, 2)
    return path + (" (the variants are flce)" if path == "one block" else "")


BITWISE = {True: "yes", False: "NO", None: "-"}


def variant_table(results: list[dict]) -> tuple[list[str], dict]:
    """The table of flce and its variants at each point, and {variant: [its time over flce's at
    each point]}."""
    lines = ["| N×H×V | flce path | run | ms | × GEMMs | × flce | MiB | bitwise |",
             "|---|---|---|---|---|---|---|---|"]
    ratios = {}
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
    return lines, ratios


def markdown(meta: dict, results: list[dict]) -> str:
    table, ratios = variant_table(results)
    lines = [*kernel_report_head(meta, "bfloat16"),
             "flce's chunked sweep forward+backward as it runs (flce), and with each chunk's row "
             "pass on a second stream beside the next chunk's logits GEMM (overlap; the side "
             "stream at the default and at the highest priority), in interleaved rounds: ms "
             "(× the bare GEMMs; × flce) / peak extra MiB; bitwise: loss, dx and dW equal "
             "flce's.", "", *table]
    pooled = [v for per_variant in ratios.values() for v in per_variant]
    if pooled:
        lines += ["", f"Overlap over flce: {min(pooled):.3f}-{max(pooled):.3f}× at "
                      f"{len(results)} points."]
    return "\n".join(lines) + "\n"


def run_variants(module: str, doc: str, default_out: str, measure, render) -> None:
    """The command line of a benchmark of flce's variants (this one, bench.row_order): each
    shape measured by measure(shape, seconds, reps), the report rendered by render(meta,
    results) and written after every point."""
    p = argparse.ArgumentParser(prog=f"python3 -m scripts.bench.{module}", description=doc,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", required=True, type=parse_shapes, help="comma-separated NxHxV")
    p.add_argument("--seconds", type=float, default=0.5,
                   help="about this long timing each run at each point")
    p.add_argument("--reps", type=int, default=20, help="at most this many rounds")
    p.add_argument("--out", default=default_out, help="output path without suffix")
    args = p.parse_args()
    require_cuda("scripts.bench.row_overlap")
    meta = {**run_meta(provenance(), "bfloat16"), "seconds_per_run": args.seconds}
    results = []
    for shape in args.shapes:
        results.append(measure(shape, args.seconds, args.reps))
        print(" | ".join([shape] + [f"{r['run']} {r['ms']:.2f} ms" for r in results[-1]["runs"]
                                    if r["ms"] is not None]), flush=True)
        write_report(args.out, {"meta": meta, "results": results}, render(meta, results))
    print(render(meta, results))


def main():
    run_variants("row_overlap", __doc__, "benchmarks/flce_row_overlap", measure_point, markdown)


if __name__ == "__main__":
    main()
