"""The loss grid of `python3 -m scripts.bench.flce --grid`: its points (GRID_N x GRID_H x GRID_V),
the runs it times (GRID_METHODS), and its report rendered from the records: the verdict on issue
20's targets, the floor no loss that leaves the GEMMs to cuBLAS passes, flce by tokens N, which
runs a resumed grid joined and which points it has not measured yet, and the host's time a call.
`tests/test_benchmarks.py` checks each grid report in benchmarks/ is its JSON rendered here.
It also holds the one reader of the shapes the benchmarks take on their command lines
("16384x8192x256000" and comma lists of them: `parse_shape`, `parse_shapes`). Never imports torch.
"""

import argparse
import itertools
import math
import statistics

from scripts.lib.report import kernel_report_head

GRID_N = (2048, 4096, 16384, 65536, 131072)
GRID_H = (1024, 2048, 4096, 8192)
GRID_V = (32000, 128256, 256000)
GRID_METHODS = ("flce", "flce_lean", "unfused_compile", "liger", "cce")
# The least any loss that leaves the GEMMs to cuBLAS moves per logit beyond their own traffic:
# it reads the logits the logits GEMM wrote (2) and writes dlogits for the dx and dW GEMMs (2).
LOGIT_BYTES_FLOOR = 4
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12}  # the makers' peak figures
# A block the caching allocator hands out may exceed the request by up to 1 MiB (the rest of a
# cached block too small to split off), and the peak counts the block: two runs that ask for the
# same bytes can differ by that much from one call to another. Reports whose meta "targets"
# says "requested" count the bytes asked for instead (`bench.flce.peak_extra_mib`) and have none.
ALLOCATOR_SLACK_MIB = 1.0
HOST_AHEAD = ("with the host ahead: each timed call is queued while bf16 GEMMs keep the GPU "
              "busy, at its clocks under load (as long for every run at a point: 3x the longest "
              "host time of a call of any of them, within 5-60 ms), so the times are the GPU's "
              "alone, as in a training step whose host runs ahead of the GPU; without it a "
              "synchronised call starts on an idle GPU and includes whatever the host's launches "
              "lag behind the kernels (`scripts.lib.timing.ahead_ms`)")


def grid_shapes() -> list[str]:
    return [f"{n}x{h}x{v}" for n, h, v in itertools.product(GRID_N, GRID_H, GRID_V)]


def parse_shape(text: str, form: str = "NxHxV") -> tuple:
    """The sizes of one shape as the benchmarks take it: "16384x8192x256000" -> (16384, 8192,
    256000). `form` names them, as many sizes as it has x-separated names ("NxHxV", "CxHxV",
    "BxHQxHKVxTxD"); a form with a ':' ("NxHxV:C1/C2/...") takes one or more /-separated sizes
    after a ':' too, their list the tuple's last item. Every size is 1 or more. Anything else is
    an argparse.ArgumentTypeError naming `text` and `form`: as a type= (`parse_shapes`), the
    command line exits 2 with "error: argument --shapes: '16384x8192' is not NxHxV"."""
    head, colon, _ = form.partition(":")
    malformed = argparse.ArgumentTypeError(f"{text!r} is not {form}")
    try:
        shape, after = text.split(":") if colon else (text, "")
        sizes = [int(s) for s in shape.split("x")]
        listed = [int(s) for s in after.split("/")] if colon else []
    except ValueError:
        raise malformed from None
    if len(sizes) != len(head.split("x")):
        raise malformed
    if min(sizes + listed) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} has a size below 1")
    return (*sizes, listed) if colon else tuple(sizes)


def parse_shapes(text: str, form: str = "NxHxV") -> list[str]:
    """A comma-separated list of shapes of `form`, each checked by `parse_shape` and kept as
    given (the text a report's records are keyed by; parse_shape gives each one's sizes): the
    type= of the benchmarks' --shapes, `type=lambda s: parse_shapes(s, "CxHxV")` for another
    form."""
    shapes = text.split(",")
    for shape in shapes:
        parse_shape(shape, form)
    return shapes


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, each 1 or more ("8192,32768" -> [8192, 32768]), checked
    as `parse_shape` checks a shape's: the type= of a benchmark's list of heights or widths."""
    return [parse_shape(size, "a size")[0] for size in text.split(",")]


def hbm_peak(gpu: str):
    """The HBM's peak bytes/s of a GPU named `gpu` (torch.cuda.get_device_name), or None."""
    return next((bps for name, bps in HBM_BYTES_PER_S.items() if name in gpu), None)


def logit_traffic_ms(shape: str, bytes_per_logit: float, bytes_per_s: float) -> float:
    """bytes_per_logit over the N·V logits of an "NxHxV" shape at bytes_per_s, in ms."""
    N, _, V = parse_shape(shape)
    return bytes_per_logit * N * V / bytes_per_s * 1e3


def ahead_timing(meta) -> str:
    """How the report's own run timed with the host ahead (the rule changed since):
    the host-ahead part of its meta's timing (`bench.flce.timing_meta`)."""
    return meta["timing"][meta["timing"].index("with the host ahead"):]


def grid_markdown(meta, results):
    """The report of a grid's records: how it was timed, the verdict on the targets, flce by
    tokens N, and a row per point (each method × its bare GEMMs' time / peak extra MiB)."""
    names = [m for m in ("bare_gemms", *GRID_METHODS) if any(r["method"] == m for r in results)]
    at = {(r["shape"], r["method"]): r for r in results}
    cell = lambda r: ("-" if r is None else "OOM" if r["ms"] is None else
                      f"{r['ms']:.2f} ({r['tflops']:.0f} TFLOP/s)" if r["method"] == "bare_gemms"
                      else f"{r['vs_gemms']:.3f}× / {r['extra_mib']:.0f}")
    lines = [*kernel_report_head(meta, meta["dtype"]),
             "Forward+backward at each N×H×V: the bare GEMMs in ms; each method as × the bare "
             "GEMMs' time / peak extra MiB (OOM: does not fit in the GPU's memory)."
             + (f" {meta['compiled_peer']}." if meta.get("compiled_peer") else "")
             + (f" Timed {ahead_timing(meta)}." if meta.get("host_ahead") else ""), "",
             *resumed_runs(results), *unmeasured_lines(meta, results), *host_lines(results, names),
             *grid_verdict(results, meta["gpu"]), "", "By tokens N:", "",
             *grid_by_tokens(results), "",
             "| N×H×V | flce path | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for shape in dict.fromkeys(r["shape"] for r in results):
        path = (at.get((shape, "bare_gemms")) or {}).get("flce_path", "-")
        lines.append(f"| {shape} | {path} | " +
                     " | ".join(cell(at.get((shape, n))) for n in names) + " |")
    return "\n".join(lines) + "\n"


def grid_verdict(results: list[dict], gpu: str = "") -> list[str]:
    """The issue's targets, each with what the grid measured (a peer that does not fit loses),
    and, on a GPU whose HBM peak is known, the floor no loss leaving the GEMMs to cuBLAS passes."""
    at = {(r["shape"], r["method"]): r for r in results}
    shapes = [s for s in dict.fromkeys(r["shape"] for r in results) if (s, "flce") in at]
    flce = [at[s, "flce"] for s in shapes if at[s, "flce"]["ms"] is not None]
    if not flce:
        return ["no grid point measured flce"]
    ratios = [r["vs_gemms"] for r in flce]
    lines = [f"- flce ≤ 1.05× the bare GEMMs at every point: {sum(x <= 1.05 for x in ratios)} of "
             f"{len(ratios)} (worst {max(ratios):.3f}×); geometric mean "
             f"{math.exp(statistics.fmean(map(math.log, ratios))):.3f}× (target ≤ 1.03×)"]

    def beats(ours, peer, key):
        pairs = [(at[s, ours], at.get((s, peer))) for s in shapes if (s, ours) in at]
        pairs = [(a, b) for a, b in pairs if b is not None and a[key] is not None]
        wins = [a for a, b in pairs if b[key] is None or a[key] <= b[key]]
        return len(wins), len(pairs)

    long = [at[s, "flce"]["vs_gemms"] for s in shapes if at[s, "flce"]["ms"] is not None
            and at.get((s, "bare_gemms"), {}).get("ms", 0) >= 10]
    if long:
        lines.append(f"- flce ≤ 1.05× the bare GEMMs where they take ≥ 10 ms: "
                     f"{sum(x <= 1.05 for x in long)} of {len(long)}")
    fastest = [s for s in shapes if at[s, "flce"]["ms"] is not None and all(
        at[s, "flce"]["ms"] <= r["ms"] for r in (at.get((s, m)) for m in GRID_METHODS)
        if r is not None and r["ms"] is not None)]
    lines.append(f"- flce the fastest of {', '.join(GRID_METHODS)}: {len(fastest)} of "
                 f"{len(shapes)} points" + _clear_losses(at, shapes, "flce", GRID_METHODS))
    for peer in ("unfused_compile", "liger", "cce"):
        won, n = beats("flce", peer, "ms")
        if n:
            lines.append(f"- flce faster than {peer}: {won} of {n} points")
    won, n = beats("flce", "unfused_compile", "extra_mib")
    ratio = [at[s, "flce"]["extra_mib"] / at[s, "unfused_compile"]["extra_mib"] for s in shapes
             if at[s, "flce"]["extra_mib"] and (s, "unfused_compile") in at
             and at[s, "unfused_compile"]["extra_mib"]]
    if n:
        lines.append(f"- flce's extra memory ≤ torch.compile's: {won} of {n} points" +
                     (f"; median ratio {statistics.median(ratio):.2f} (target ≤ 0.5)" if ratio else ""))
    for key, what in (("extra_mib", "memory ≤"), ("ms", "time ≤")):
        won, n = beats("flce_lean", "liger", key)
        if n:
            clear = (_clear_losses(at, shapes, "flce_lean", ("liger",)) if key == "ms"
                     else _slack_losses(at, shapes, "flce_lean", "liger"))
            lines.append(f"- flce_lean {what} Liger's: {won} of {n} points" + clear)
    peak = hbm_peak(gpu)
    if peak:
        lines.append(floor_line(at, [s for s in shapes if at[s, "flce"]["ms"] is not None], peak))
    return lines


def floor_line(at: dict, shapes: list[str], bytes_per_s: float) -> str:
    """Any loss that leaves the GEMMs to cuBLAS over its bare GEMMs were it to move only
    LOGIT_BYTES_FLOOR bytes a logit at the HBM's peak: its geometric mean, where that alone
    exceeds 1.05x among the points whose GEMMs take >= 10 ms, and how far flce is from it."""
    gemms = {s: at[s, "bare_gemms"]["ms"] for s in shapes}
    floor_ms = {s: logit_traffic_ms(s, LOGIT_BYTES_FLOOR, bytes_per_s) for s in shapes}
    floor = {s: 1 + floor_ms[s] / gemms[s] for s in shapes}
    long = [s for s in shapes if gemms[s] >= 10]
    reach = [s for s in long if floor[s] <= 1.05]
    within = sum(at[s, "flce"]["vs_gemms"] <= 1.05 for s in reach)
    above = [(at[s, "flce"]["ms"] - gemms[s]) / floor_ms[s] for s in shapes]
    # a run under the floor had GEMMs faster than the bare ones back to back (the GPU's clocks
    # under another mix of kernels): the floor's premise, the bare GEMMs as every loss's, failed
    timed = [(s, at[s, m]["ms"]) for s in shapes for m in GRID_METHODS
             if (at.get((s, m)) or {}).get("ms") is not None]
    under = [s for s, ms in timed if ms < gemms[s] * floor[s]]
    return (f"- the floor: one read of the logits and one write of dlogits at the HBM's peak "
            f"({bytes_per_s / 1e12:.2f} TB/s, {LOGIT_BYTES_FLOOR} bytes a logit) put any loss "
            f"that leaves the GEMMs to cuBLAS at {min(floor.values()):.3f}-"
            f"{max(floor.values()):.3f}× its GEMMs (geometric mean "
            f"{math.exp(statistics.fmean(map(math.log, floor.values()))):.3f}×); ≤ 1.05× is out "
            f"of reach at {len(long) - len(reach)} of the {len(long)} points whose GEMMs take "
            f"≥ 10 ms, and flce is within it at {within} of the other {len(reach)}; flce's time "
            f"above its GEMMs is a median {statistics.median(above):.2f}× the floor's"
            + (f"; {len(under)} runs at {len(set(under))} points came in under it, their GEMMs "
               f"faster than the bare GEMMs back to back" if under else ""))


def _slack_losses(at: dict, shapes: list, ours: str, peer: str) -> str:
    """Of the points where `ours` took more peak memory than `peer`: at how many by no more than
    the allocator's slack (ALLOCATOR_SLACK_MIB), which a run of the same code may show or not."""
    mib = [(at[s, ours]["extra_mib"], at[s, peer]["extra_mib"]) for s in shapes
           if (s, ours) in at and (s, peer) in at and at[s, ours]["extra_mib"] is not None
           and at[s, peer]["extra_mib"] is not None]
    over = [a - b for a, b in mib if a > b]
    slack = sum(d <= ALLOCATOR_SLACK_MIB for d in over)
    return (f"; at {slack} of the {len(over)} others by {ALLOCATOR_SLACK_MIB:g} MiB or less, "
            f"the caching allocator's slack" if slack else "")


def _clear_losses(at: dict, shapes: list, ours: str, peers) -> str:
    """Of the points where `ours` is not the fastest of itself and `peers`: at how many a peer
    was faster in every round than `ours` in its fastest round (the others lie within the rounds'
    spread), and which. Empty when no losing point kept its rounds (grids before b119f8e)."""
    def rivals(s):
        return [at[s, p] for p in peers
                if p != ours and (s, p) in at and at[s, p]["ms"] is not None]

    losing = [s for s in shapes if (s, ours) in at and at[s, ours]["ms"] is not None
              and not all(at[s, ours]["ms"] <= r["ms"] for r in rivals(s))]
    timed = [s for s in losing if at[s, ours].get("rounds_ms")]
    if not timed:
        return ""
    clear = [s for s in timed if any(r.get("rounds_ms") and max(r["rounds_ms"]) <
                                     min(at[s, ours]["rounds_ms"]) for r in rivals(s))]
    text = (f"; at {len(clear)} of the {len(losing)} others a peer was faster in every round "
            f"than {ours} in its fastest")
    if len(timed) < len(losing):
        text += f" ({len(losing) - len(timed)} of them measured without rounds)"
    return text + (f": {', '.join(clear)}" if clear else "")


def grid_by_tokens(results: list[dict]) -> list[str]:
    """flce by tokens N (and over all points): its geometric mean over the bare GEMMs, the points
    within 1.05x of them, where it beats torch.compile and Liger (a peer that does not fit loses)
    and where it is the fastest of GRID_METHODS; then by how much the fastest beats flce where
    flce is not."""
    at = {(r["shape"], r["method"]): r for r in results}
    shapes = [s for s in dict.fromkeys(r["shape"] for r in results)
              if at.get((s, "flce"), {}).get("ms") is not None]
    ms = lambda s, m: (at.get((s, m)) or {}).get("ms") or math.inf  # noqa: E731
    rows = ["| N | geomean × its GEMMs | ≤ 1.05× | faster than torch.compile | faster than Liger "
            "| fastest of all five |", "|---|---|---|---|---|---|"]
    groups = {n: [s for s in shapes if s.split("x")[0] == n]
              for n in dict.fromkeys(s.split("x")[0] for s in shapes)}
    for name, group in [*groups.items(), ("all", shapes)]:
        ratios = [at[s, "flce"]["vs_gemms"] for s in group]
        counts = [sum(x <= 1.05 for x in ratios),
                  sum(ms(s, "flce") < ms(s, "unfused_compile") for s in group),
                  sum(ms(s, "flce") < ms(s, "liger") for s in group),
                  sum(all(ms(s, "flce") <= ms(s, m) for m in GRID_METHODS) for s in group)]
        geomean = math.exp(statistics.fmean(map(math.log, ratios)))
        rows.append(f"| {name} | {geomean:.3f} | " +
                    " | ".join(f"{c}/{len(group)}" for c in counts) + " |")
    margins = [ms(s, "flce") / min(ms(s, m) for m in GRID_METHODS) - 1 for s in shapes]
    lost = [m for m in margins if m > 0]
    if lost:
        spread = f"{100 * min(lost):.1f}-{100 * max(lost):.1f}" if len(lost) > 1 else \
            f"{100 * lost[0]:.1f}"
        rows += ["", f"Where flce is not the fastest ({len(lost)} of {len(shapes)} points) the "
                     f"fastest is {spread}% faster."]
    return rows


def resumed_runs(results) -> list[str]:
    """The line naming each run's commit, date and point count, where --resume joined runs."""
    runs = {}
    for r in results:
        if r["method"] == "bare_gemms" and "git" in r:
            runs.setdefault((r["git"], r["date"]), []).append(r["shape"])
    if len(runs) < 2:
        return []
    return ["Measured in runs resumed one after another: " + "; ".join(
        f"{len(shapes)} point{'s' * (len(shapes) > 1)} at git {git} ({date})"
        for (git, date), shapes in runs.items()) + ".", ""]


def unmeasured_lines(meta: dict, results: list[dict]) -> list[str]:
    """The grid's points a whole-grid report (`--grid` without `--shapes`) has not measured yet,
    named (its counts and means are over the others): what a later `--resume` would add."""
    command = meta.get("command", "").split()
    if "--grid" not in command or "--shapes" in command:
        return []
    measured = {r["shape"] for r in results}
    left = [s for s in grid_shapes() if s not in measured]
    if not left:
        return []
    return [f"Not measured yet: {len(left)} of the grid's {len(grid_shapes())} points "
            f"({', '.join(left)}); every figure below is over the other {len(measured)}.", ""]


def host_lines(results: list[dict], names: list[str]) -> list[str]:
    """The host's ms to issue one call, each run's median over the points and its largest (the
    records of a run timed with the host ahead carry it)."""
    parts = []
    for name in names:
        ms = [r["host_ms"] for r in results if r["method"] == name and r.get("host_ms")]
        if ms:
            parts.append(f"{name} {statistics.median(ms):.2f} ({max(ms):.2f})")
    return (["The host's ms to issue a call, the median over the points (the largest): "
             + ", ".join(parts) + ".", ""] if parts else [])
