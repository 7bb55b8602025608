#!/usr/bin/env python3
"""Compare the loss curves of runs against the first one: a table, a PNG, a pass/fail exit code.

    python3 -m scripts.compare_losses RUN_A RUN_B [RUN_C ...] [--seed-run RUN]
        [--verdict auto|absolute|band] [--tolerance 0.05] [--band-ratio 0.5] [--window 9]
        [--threshold X] [--metric loss] [--out PATH.png]

A run is a dump folder holding metrics.jsonl, or the file itself. Lines without the metric
(validation lines have val_loss, not loss) are skipped. A resumed run appends from its
checkpoint's step on: its lines replace the earlier run's from there, and the earlier run's
later steps are left out even where the resumed run has not reached them yet (a rollback
abandons them), as in the trainer's own summary, with a note. Where the steps go back is the
file's timeline, every line's step, whichever metric is compared. A file whose steps start
over from its first step (the first line's, not the metric's) holds two runs, not a resumed one:
that is refused (exit 2), unless the line going back is the trainer's {"step": N, "resumed":
true}. A line cut short by a run stopped mid-write is skipped with a warning where it is the
file's last, or where the trainer's resumed line follows it; any other line that is not JSON is
refused. Runs are aligned on the steps they all logged; runs that end at different steps (one
stopped early) are refused too.

For each run after the first: mean and max |run - A| and the first step where |diff| exceeds
--threshold (default: --tolerance). --seed-run names the same config as A at another seed: it
is not judged (also where it is among the runs), but each run's mean |run - A| is also reported
relative to the seed-to-seed spread mean |seed - A|, the noise floor any change has to be
compared with. With no run to judge besides A and the seed run there is no verdict (exit 2).

The verdict (--verdict; auto: band when --seed-run is given, else absolute):
  absolute  every step's |run - A| must stay within --tolerance. Right for deterministic runs
            (fp32 on the CPU: fused and unfused agree to ~1e-6), wrong for bf16 GPU runs, whose
            curves separate chaotically: there one step's difference says little.
  band      the curves are smoothed (a centred moving average over --window logged steps) and
            mean |smoothed run - smoothed A| must stay within --band-ratio times the noise
            band mean |smoothed seed - smoothed A| that --seed-run measures.
A null value (the trainer writes non-finite values as null) is a divergence at that step, a
failure in either verdict.

Exit status: 0 when every run passes; 1 when one does not, or has a non-finite value; 2 on bad
input (missing file, metric absent, no common steps, no usable noise band, no run to judge).
"""

import argparse
import io
import json
import math
import sys
from pathlib import Path


class BadInput(Exception):
    pass


def data_path(run: str) -> Path:
    path = Path(run)
    return path / "metrics.jsonl" if path.is_dir() else path


def resumed_line(line: str) -> bool:
    """Whether a line is the trainer's {"step": N, "resumed": true}, which it writes first when
    it resumes a run whose file went on past the checkpoint or ends in a partial line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and record.get("resumed") is True


def _glued_hint(line: str) -> str:
    """Where a line ends in a whole JSON object after a partial one, a hint: the trainer before
    the cut-short fix appended a resumed run's first line to the stopped run's partial last
    line, and this is that line; the file mends with a line break."""
    for start in (i for i, c in enumerate(line) if c == "{" and i > 0):
        try:
            if isinstance(json.loads(line[start:]), dict):
                return (f"; it ends in a whole metrics line from character {start + 1}: a run "
                        "stopped mid-write with the next run's first line appended (an older "
                        "trainer's); a line break there mends the file")
        except json.JSONDecodeError:
            continue
    return ""


def read_metric(run: str, metric: str) -> dict[int, float]:
    """{step: value} of one run; NaN where the trainer wrote null (a non-finite value)."""
    path = data_path(run)
    if not path.is_file():
        raise BadInput(f"{run}: no such file {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): not a "
                       "metrics.jsonl") from None
    values, first, latest = {}, None, None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            following = next((x for x in lines[number:] if x.strip()), None)
            if following is None:  # a run killed mid-write can leave a partial last line
                print(f"warning: {path}:{number}: skipping a partial last line", file=sys.stderr)
                continue
            if resumed_line(following):  # ... and the run resumed after it says so first
                print(f"warning: {path}:{number}: skipping a partial line, the last of a run "
                      "stopped mid-write (a resumed run's lines follow)", file=sys.stderr)
                continue
            raise BadInput(f"{path}:{number}: not JSON ({e}){_glued_hint(line)}") from None
        if not isinstance(record, dict):
            raise BadInput(f"{path}:{number}: a JSON {type(record).__name__}, not a metrics line "
                           "(an object with step and the metric)")
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            # Any line going back starts a resumed run's timeline: the earlier run's lines after
            # its step belong to the one it abandoned, whichever metrics they hold
            # (components/metrics_timeline.py, which this stdlib-only script cannot import).
            # Whether it went back to the start is the file's timeline's question, not the
            # metric's: a run rolled back to before its first validation repeats that one.
            if latest is not None and step < latest:
                marker = record.get("resumed") is True  # the trainer's line for a resumed run
                if step <= first and not marker:  # what a second run from the start looks like
                    raise BadInput(f"{path}:{number}: step {step} follows step {latest}: the "
                                   "file holds more than one run, started over in the same dump "
                                   "folder (a trainer that keeps runs apart renames the earlier "
                                   "run's file metrics.<time>.jsonl); split it and compare the "
                                   "runs")
                print(f"note: {path}:{number}: steps go back from {latest} to {step}: a resumed "
                      "run; its lines replace the earlier run's after step "
                      f"{step if marker else step - 1}", file=sys.stderr)
                for abandoned in [s for s in values if s > step]:
                    del values[abandoned]
            first = step if first is None else first
            latest = step
        if metric in record and "step" in record:
            value = record[metric]
            if isinstance(step, bool) or not isinstance(step, int):
                raise BadInput(f"{path}:{number}: step {step!r} is not a step number")
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))):
                raise BadInput(f"{path}:{number}: {metric} {value!r} is not a number")
            values[step] = math.nan if value is None else float(value)
    if not values:
        raise BadInput(f"{path}: no line has the metric {metric!r}")
    return values


def plot_path(out: str | None, reference: str, metric: str) -> Path:
    """The file the plot is written to: --out, with .png added where it names no format (as
    matplotlib would add it, unseen), else compare_<metric>.png beside A's metrics.jsonl.
    Checked before the comparison: a suffix matplotlib cannot write failed only after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:  # the plot is always drawn: without it, a traceback at the end
        raise BadInput(f"the plot needs matplotlib, which does not import ({e}): pip install "
                       "'flce-recipes[metrics]' (or: pip install matplotlib)") from e
    if not out:
        return data_path(reference).parent / f"compare_{metric}.png"
    path = Path(out)
    if not path.name.strip("."):
        raise BadInput(f"--out {out}: not a file name (give one ending in .png)")
    if not path.suffix:
        return path.with_name(path.name.rstrip(".") + ".png")
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise BadInput(f"--out {out}: matplotlib writes no {path.suffix} files; end the name "
                       f"in .png or another suffix it writes ({', '.join(sorted(formats))})")
    check_writable(out, path.suffix[1:].lower())
    return path


def check_writable(out: str, fmt: str) -> None:
    """Draws a small figure with text as fmt, in memory. matplotlib lists formats it may not
    write here (avif with a Pillow built without it, pgf without its TeX system): they failed
    at the plot, after the whole comparison, with a traceback."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    from matplotlib.figure import Figure
    fig = Figure(figsize=(1, 1))
    fig.text(0.5, 0.5, "x")  # text: pgf sizes it with its TeX system
    try:
        fig.savefig(io.BytesIO(), format=fmt)
    except Exception as e:  # any failure to write it: a backend's own error, whichever it is
        why = (str(e).strip().splitlines() or [""])[0]
        raise BadInput(f"--out {out}: matplotlib cannot write {fmt} files here "
                       f"({type(e).__name__}: {why}); end the name in .png") from e


def first_step_above(steps, diffs, threshold):
    """The first step whose |diff| exceeds threshold or is non-finite, else None."""
    return next((s for s, d in zip(steps, diffs) if not d <= threshold), None)


def finite_mean_max(diffs):
    finite = [d for d in diffs if math.isfinite(d)]
    return (sum(finite) / len(finite), max(finite)) if finite else (math.nan, math.nan)


def moving_average(values: list[float], window: int) -> list[float]:
    """Centred moving average over `window` points (fewer at the ends, where the window is cut)."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half):i + half + 1]
        out.append(sum(part) / len(part))
    return out


def plot(path: Path, steps, curves: dict, reference: str, seed: str | None, metric: str,
         tolerance: float | None, smoothed: dict | None = None) -> None:
    """Curves on top, differences to the reference below: raw, plus the smoothed ones the band
    verdict judges (smoothed) or the +-tolerance lines of the absolute verdict."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 7), height_ratios=(2, 1))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, values) in enumerate(curves.items()):
        color = colors[i % len(colors)]  # one color per run in both panels
        style = dict(color=color, linestyle="--" if name == seed else "-")
        top.plot(steps, values, label=name + (" (seed reference)" if name == seed else ""), **style)
        if name != reference:
            diff = [v - a for v, a in zip(values, curves[reference])]
            bottom.plot(steps, diff, label=f"{name} - {reference}",
                        alpha=0.35 if smoothed else 1.0, **style)
            if smoothed and name in smoothed:
                mean = [v - a for v, a in zip(smoothed[name], smoothed[reference])]
                bottom.plot(steps, mean, linewidth=2, label=f"{name} - {reference}, smoothed",
                            **style)
            # Non-finite values leave gaps in the lines: mark where they start.
            bad = [s for s, d in zip(steps, diff) if not math.isfinite(d)]
            if bad:
                bottom.axvline(bad[0], linewidth=2, alpha=0.5, label=f"{name}: non-finite",
                               **style)
    for y in () if tolerance is None else (tolerance, -tolerance):
        bottom.axhline(y, color="gray", linewidth=0.8, linestyle=":")
    top.set_ylabel(metric)
    top.legend(fontsize="small")
    bottom.set_ylabel(f"{metric} difference")
    bottom.set_xlabel("step")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def absolute_verdict(steps, diffs: dict, tolerance: float, threshold: float) -> list[str]:
    """Failures of the absolute verdict: any step's |run - A| above tolerance."""
    print(f"  pass when |run - A| <= --tolerance {tolerance:g} at every step (for deterministic "
          "runs: fp32 on the CPU)")
    failures = []
    for name, d in diffs.items():
        _, peak = finite_mean_max(d)
        print(f"  {name}: max |diff| {peak:.4g}: {'within' if peak <= tolerance else 'OUTSIDE'}")
        if peak > tolerance:
            first = first_step_above(steps, d, threshold)
            failures.append(f"{name}: max |diff| {peak:.4g} > tolerance {tolerance:g} "
                            f"(first step above {threshold:g}: {first})")
    return failures


def band_verdict(steps, curves: dict, reference: str, seed: str, judged: list[str],
                 window: int, ratio_limit: float) -> tuple[list[str], list[str], dict]:
    """Failures and passes of the band verdict, and the smoothed curves: the mean |difference|
    of the smoothed curves against ratio_limit times the seed run's (the noise band)."""
    window = min(window, len(steps))
    smoothed = {name: moving_average(curves[name], window) for name in [reference, seed, *judged]}
    mean_diff = {name: sum(abs(v - a) for v, a in zip(smoothed[name], smoothed[reference]))
                 / len(steps) for name in [seed, *judged]}
    band = mean_diff[seed]
    if not band > 0:  # the seed run's smoothed curve is A's: there is no band to judge against
        raise BadInput(f"no noise band: the seed run {seed}, smoothed over {window} logged "
                       f"step(s), equals A's curve; lengthen the runs or lower --window")
    print(f"  smoothing: a centred moving average over {window} logged step(s)\n"
          f"  noise band: mean |seed - A| of the smoothed curves over steps {steps[0]}..{steps[-1]}"
          f" = {band:.4g} (seed run {seed})\n"
          f"  pass when mean |run - A| of the smoothed curves <= {ratio_limit:g} x the band"
          f" = {ratio_limit * band:.4g}")
    failures, passes = [], []
    for name in judged:
        ratio = mean_diff[name] / band
        print(f"  {name}: {mean_diff[name]:.4g} = {ratio:.3g} x the band: "
              f"{'within' if ratio <= ratio_limit else 'OUTSIDE'}")
        summary = (f"{name}: mean |smoothed diff| {mean_diff[name]:.4g} = {ratio:.3g} x the "
                   f"seed-to-seed spread {band:.4g} (limit {ratio_limit:g})")
        (passes if ratio <= ratio_limit else failures).append(summary)
    return failures, passes, smoothed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m scripts.compare_losses", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders or metrics.jsonl files; A first")
    parser.add_argument("--verdict", choices=("auto", "absolute", "band"), default="auto",
                        help="absolute: every step within --tolerance; band: smoothed curves "
                             "within --band-ratio x the seed-to-seed spread (needs --seed-run); "
                             "auto (default): band with --seed-run, else absolute")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="absolute verdict: fail (exit 1) when max |run - A| exceeds this "
                             "(default 0.05)")
    parser.add_argument("--band-ratio", type=float, default=0.5,
                        help="band verdict: fail when mean |smoothed run - A| exceeds this "
                             "fraction of mean |smoothed seed - A| (default 0.5)")
    parser.add_argument("--window", type=int, default=9,
                        help="band verdict: logged steps per moving-average window (default 9)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="report the first step where |run - A| exceeds this "
                             "(default: --tolerance)")
    parser.add_argument("--metric", default="loss")
    parser.add_argument("--seed-run", help="A's config at another seed: the noise reference")
    parser.add_argument("--out", help="PNG path, .png added where it has no suffix (another "
                                      "suffix matplotlib writes gives that format; default: "
                                      "compare_<metric>.png beside A's metrics.jsonl)")
    args = parser.parse_args(argv)
    threshold = args.tolerance if args.threshold is None else args.threshold
    verdict = args.verdict if args.verdict != "auto" else ("band" if args.seed_run else "absolute")
    if verdict == "band" and not args.seed_run:
        parser.error("--verdict band needs --seed-run (the run that measures the noise band)")
    # The seed run is the noise reference, never judged, also where it is given among the runs
    # (as the same path or another path to its file): with no other run after A, a verdict
    # would judge nothing and pass.
    seed_file = data_path(args.seed_run).resolve() if args.seed_run else None
    judged = [run for run in args.runs[1:] if data_path(run).resolve() != seed_file]
    if not judged and len(args.runs) > 1:
        parser.error(f"{args.runs[1]} is the seed run (--seed-run {args.seed_run}), which is not "
                     "judged: give a run to judge besides A and the seed run")
    if not judged:
        parser.error("give a run to judge besides A and the seed run" if args.seed_run else
                     "give at least two runs: A and a run to judge against it")
    if args.window < 1 or args.band_ratio <= 0:
        parser.error("--window must be >= 1 and --band-ratio > 0")

    names = list(args.runs) + ([args.seed_run] if args.seed_run else [])
    try:
        out = plot_path(args.out, names[0], args.metric)
        data = {name: read_metric(name, args.metric) for name in names}
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    steps = sorted(set.intersection(*(set(values) for values in data.values())))
    if not steps:
        print(f"error: the runs have no logged step in common ({args.metric})", file=sys.stderr)
        return 2
    last = {name: max(values) for name, values in data.items()}
    if len(set(last.values())) > 1:  # one stopped early (a signal, bad steps): not comparable
        ends = ", ".join(f"{name} at step {step}" for name, step in last.items())
        print(f"error: the runs end at different steps ({ends}): a comparison over the steps "
              "they share would hide the rest; rerun the one that stopped early",
              file=sys.stderr)
        return 2
    curves = {name: [data[name][s] for s in steps] for name in names}
    reference = names[0]

    print(f"{args.metric}: {len(names)} runs aligned on {len(steps)} common steps "
          f"({steps[0]}..{steps[-1]}); reference A = {reference}")
    width = max(len(name) for name in names) + 2
    print(f"\n{'run':<{width}}{'final ' + args.metric + ' @ ' + str(steps[-1]):>22}")
    for name in names:
        note = "  (seed reference)" if name == args.seed_run else ""
        print(f"{name:<{width}}{curves[name][-1]:>22.6g}{note}")

    print(f"\n{'vs A':<{width}}{'mean|diff|':>12}{'max|diff|':>12}  "
          f"first step |diff| > {threshold:g}")
    diffs = {name: [abs(v - a) for v, a in zip(curves[name], curves[reference])]
             for name in names[1:]}
    failures, non_finite = [], {}
    for name, d in diffs.items():
        mean, peak = finite_mean_max(d)
        first = first_step_above(steps, d, threshold)
        bad = [s for s, x in zip(steps, d) if not math.isfinite(x)]
        print(f"{name:<{width}}{mean:>12.4g}{peak:>12.4g}  {first if first is not None else '-'}")
        if bad:
            non_finite[name] = bad[0]
            print(f"{'':<{width}}non-finite {args.metric} (null) at {len(bad)} step(s), "
                  f"first at step {bad[0]}: treated as a divergence")
            if name in judged:
                failures.append(f"{name}: non-finite {args.metric} from step {bad[0]}")

    if args.seed_run:
        spread, _ = finite_mean_max(diffs[args.seed_run])
        print(f"\nseed-to-seed spread: mean |seed - A| = {spread:.4g}")
        for name in judged:
            mean, _ = finite_mean_max(diffs[name])
            ratio = f"{mean / spread:.3g}" if spread > 0 else "n/a (no finite, non-zero spread)"
            print(f"relative to seed spread: mean|A - {name}| / mean|A - seed| = {ratio}")

    smoothed, passes = None, []
    why = f"--verdict {verdict}" if args.verdict != "auto" else (
        "auto: --seed-run given" if args.seed_run else "auto: no --seed-run")
    print(f"\nverdict: {verdict} ({why})")
    if verdict == "band":
        if reference in non_finite or args.seed_run in non_finite:
            print(f"error: no noise band: non-finite {args.metric} in A or the seed run (from step "
                  f"{min(non_finite.get(reference, math.inf), non_finite.get(args.seed_run, math.inf))})",
                  file=sys.stderr)
            return 2
        if all(s == a for s, a in zip(curves[args.seed_run], curves[reference])):
            print(f"error: no noise band: the seed run {args.seed_run} equals A at every common "
                  "step (the same run twice, or a seed that changes nothing?)", file=sys.stderr)
            return 2
        finite = [name for name in judged if name not in non_finite]
        try:
            band_failures, passes, smoothed = band_verdict(steps, curves, reference,
                                                           args.seed_run, finite, args.window,
                                                           args.band_ratio)
        except BadInput as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        failures += band_failures
    else:
        failures += absolute_verdict(steps, {n: diffs[n] for n in judged if n not in non_finite},
                                     args.tolerance, threshold)

    plot(out, steps, curves, reference, args.seed_run, args.metric,
         args.tolerance if verdict == "absolute" else None, smoothed)
    print(f"\nplot: {out}")

    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    if verdict == "band":
        print("PASS: within the noise band: " + "; ".join(passes))
    else:
        print(f"PASS: every run within {args.tolerance:g} of A at every step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
