"""The chunked sweep's row pass with pass 2 walking each row backwards (as flce runs it) against
pass 2 in pass 1's order, end to end: forward+backward of the loss, not the kernel alone.

    python3 -m scripts.bench.row_order --shapes 65536x1024x128256,...

Per chunk the row kernel reads each row for its statistics, then reads it again and writes
dlogits. Walking the second pass from the row's last block back to its first re-reads first
the blocks read last, while still in L2 (`flce/kernels.py`, REVERSE_GRAD): `tune_rows_kernel`
times that kernel alone, 4-26% faster. Here the whole loss is timed in interleaved rounds of
balanced orders with the bare GEMMs, in two variants: flce as it runs, and `forward_order`
(the same blocks and warps, pass 2 in pass 1's order: bitwise flce's results, checked at each
point). Writes <out>.json and <out>.md.
"""

import sys

if not __package__:
    sys.exit("run from the repository root as a module: python3 -m scripts.bench.row_order ...")

import flce  # noqa: E402
import flce.kernels  # noqa: E402
from scripts.bench.row_overlap import (loss_replacing, measure_point, run_variants,  # noqa: E402
                                       variant_table)
from scripts.lib.report import kernel_report_head  # noqa: E402

LAUNCH_ROWS = flce.kernels.launch_rows


def launch_rows_ordered(reverse: bool):
    """launch_rows with pass 2 walking each row backwards (reverse) or in pass 1's order where
    both passes run in one kernel without the e4m3 copy; every other pass as it is."""
    def launch(logits, target, loss_out, stats, weight, opts, stats_given, compute_grad, *args,
               **kwargs):
        if compute_grad and not stats_given and kwargs.get("fp8_grad") is None:
            kwargs["reverse_grad"] = reverse
        return LAUNCH_ROWS(logits, target, loss_out, stats, weight, opts, stats_given,
                           compute_grad, *args, **kwargs)
    return launch


def variants() -> dict:
    loss = lambda launch: loss_replacing(flce.kernels, "launch_rows", launch)  # noqa: E731
    return {"flce": loss(LAUNCH_ROWS), "forward_order": loss(launch_rows_ordered(False))}


def markdown(meta: dict, results: list[dict]) -> str:
    table, ratios = variant_table(results)
    lines = [*kernel_report_head(meta, "bfloat16"),
             "flce forward+backward as it runs (pass 2 of the row kernel walks each row "
             "backwards where both passes run in one kernel), and with pass 2 in pass 1's order "
             "(forward_order), in interleaved rounds of balanced orders: ms (× the bare GEMMs; × "
             "flce) / peak extra MiB; bitwise: loss, dx and dW equal flce's.", "", *table]
    if ratios:
        lines.append("")
        lines += [f"{name} over flce: {min(v):.3f}-{max(v):.3f}× at {len(v)} points."
                  for name, v in ratios.items()]
    return "\n".join(lines) + "\n"


def main():
    measure = lambda shape, seconds, reps: measure_point(  # noqa: E731
        shape, seconds, reps, variants)
    run_variants("row_order", __doc__, "benchmarks/flce_row_order", measure, markdown)


if __name__ == "__main__":
    main()
