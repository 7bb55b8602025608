"""The report of `python3 -m scripts.bench.train`: its meta (provenance, settings, the measured
steps), the summary per loss and the fused loss against each other one, and its markdown."""

import typing

from components.allocator import allocator_settings, run_environment
from components.config.schema import ACMode  # no torch: the benchmark is a launcher
from scripts.lib.report import fmt, probe_environment, provenance, warning_lines

FUSED = "flce"
# lightest first; memory_budget is left out: where it falls depends on its budget
AC_MODES = tuple(mode for mode in typing.get_args(ACMode) if mode != "memory_budget")


# ---- which steps count ------------------------------------------------------------------------

def logged_steps(steps: int, log_freq: int) -> list[int]:
    """The steps train.py logs: every log_freq-th, the first and the last."""
    return sorted({s for s in range(1, steps + 1) if s % log_freq == 0 or s in (1, steps)})


def measured_steps(steps: int, log_freq: int, warmup: int) -> list[int]:
    """Logged steps whose whole window (the steps since the previous log) is past the warm-up:
    a logged value averages its window, so one that straddles the warm-up would mix it in."""
    logged = logged_steps(steps, log_freq)
    return [s for prev, s in zip([0, *logged], logged) if prev >= warmup]


# ---- summary ----------------------------------------------------------------------------------

def ok_runs(runs: list[dict], loss: str, acs=None) -> list[dict]:
    return [r for r in runs if r["loss"] == loss and r["status"] == "ok"
            and (acs is None or r["ac"] in acs)]


def largest_fit(runs: list[dict], loss: str, acs) -> dict | None:
    """The largest batch that ran (fastest at that batch) and the smallest OOM above it at the
    same AC mode; batch None: runs, none fitted; None: no run with these AC modes."""
    tried = [r for r in runs if r["loss"] == loss and r["ac"] in acs]
    fits = ok_runs(tried, loss)
    if not fits:
        ooms = [r["batch"] for r in tried if r["status"] == "oom"]
        return {"batch": None, "ac": None, "first_oom_above": min(ooms)} if ooms else None
    best = max(fits, key=lambda r: (r["batch"], r["tokens_per_second"]))
    ooms = [r["batch"] for r in tried if r["status"] == "oom"
            and r["ac"] == best["ac"] and r["batch"] > best["batch"]]
    return {"batch": best["batch"], "ac": best["ac"], "first_oom_above": min(ooms, default=None)}


def loss_summary(runs: list[dict], loss: str, args) -> dict:
    equal = next((r for r in runs if r["loss"] == loss and r["batch"] == args.batch
                  and r["ac"] == args.ac[0]), None)
    fits = ok_runs(runs, loss)
    best = max(fits, key=lambda r: r["tokens_per_second"], default=None)
    return {"equal": None if equal is None else {
                "status": equal["status"], "tokens_per_second": equal["tokens_per_second"]},
            "best": None if best is None else {
                k: best[k] for k in ("batch", "ac", "compile", "tokens_per_second",
                                     "mfu_percent", "memory_max_reserved_gib")},
            "largest_batch_ac_none": largest_fit(runs, loss, ["none"]),
            "largest_batch": largest_fit(runs, loss, AC_MODES)}


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def compare(fused: dict, base: dict) -> dict:
    def tps(d, part):
        return d[part]["tokens_per_second"] if d[part] else None

    def batch(d, part):
        return d[part]["batch"] if d[part] else None

    return {"equal_batch_speedup": ratio(tps(fused, "equal"), tps(base, "equal")),
            "best_speedup": ratio(tps(fused, "best"), tps(base, "best")),
            "largest_batch_ratio_ac_none": ratio(batch(fused, "largest_batch_ac_none"),
                                                 batch(base, "largest_batch_ac_none")),
            "largest_batch_ratio": ratio(batch(fused, "largest_batch"),
                                         batch(base, "largest_batch"))}


def summarize(runs: list[dict], args) -> dict:
    per_loss = {loss: loss_summary(runs, loss, args) for loss in args.losses}
    comparisons = {}
    if FUSED in per_loss:
        comparisons = {f"{FUSED}_vs_{loss}": compare(per_loss[FUSED], per_loss[loss])
                       for loss in args.losses if loss != FUSED}
    return {"per_loss": per_loss, "comparisons": comparisons}


# ---- markdown ---------------------------------------------------------------------------------

def fit_text(fit: dict | None, args) -> str:
    if fit is None:
        return "-"
    if fit["batch"] is None:
        return f"none fit (OOM from {fit['first_oom_above']})"
    if fit["first_oom_above"] is not None:
        bound = f"OOM at {fit['first_oom_above']}"
    elif fit["batch"] >= args.max_batch:
        bound = "= --max-batch"
    else:
        bound = "nothing larger ran"
    return f"{fit['batch']} (ac {fit['ac']}; {bound})"


def equal_text(eq: dict | None) -> str:
    if eq is None:
        return "not run"
    return fmt(eq["tokens_per_second"]) if eq["status"] == "ok" else eq["status"]


def best_text(best: dict | None) -> str:
    if best is None:
        return "-"
    return f"{fmt(best['tokens_per_second'])} (batch {best['batch']}, ac {best['ac']})"


def comparison_line(name: str, c: dict, per_loss: dict, args) -> str:
    base = name.split("_vs_", 1)[1]
    f, b = per_loss[FUSED], per_loss[base]

    def x(v):
        return "n/a" if v is None else f"{v:.2f}×"

    return (f"- {FUSED} vs {base}: {x(c['equal_batch_speedup'])} tokens/s at equal batch "
            f"{args.batch}, ac {args.ac[0]} ({equal_text(f['equal'])} vs "
            f"{equal_text(b['equal'])}); "
            f"{x(c['best_speedup'])} at each one's best ({best_text(f['best'])} vs "
            f"{best_text(b['best'])}); largest batch {x(c['largest_batch_ratio_ac_none'])} at "
            f"ac none, {x(c['largest_batch_ratio'])} with any ac")


def markdown(report: dict, args) -> str:
    m, runs, summary = report["meta"], report["runs"], report["summary"]
    gpu = f"{m.get('gpu') or 'no GPU'} ×{m['nproc']}"
    lines = [*warning_lines(m),
             f"GPU: {gpu} · torch {m.get('torch')} · triton {m.get('triton')} · {m['date']}"
             f" · git {m.get('git')}", f"Command: `{m['command']}`", "",
             f"train.py {m['config']}, seq {m['seq_len']}, synthetic tokens, {m['steps']} steps a "
             f"run; tokens/s per device = median of the windows logged at steps "
             f"{', '.join(map(str, m['measured_steps']))}; memory = peak over the run. "
             f"State: {report['state']} ({len(runs)} runs, {m['elapsed_minutes']} min).", ""]
    per_loss = summary["per_loss"]
    if summary["comparisons"]:
        lines += [comparison_line(n, c, per_loss, args) for n, c in summary["comparisons"].items()]
        lines.append("")
    lines += [f"| loss | tok/s at batch {args.batch}, ac {args.ac[0]} | best tok/s | "
              "largest batch, ac none | largest batch, any ac |", "|---|---|---|---|---|"]
    for loss, s in per_loss.items():
        lines.append(f"| {loss} | {equal_text(s['equal'])} | {best_text(s['best'])} | "
                     f"{fit_text(s['largest_batch_ac_none'], args)} | "
                     f"{fit_text(s['largest_batch'], args)} |")
    lines += ["", "| loss | batch | ac | compile | tok/s/device | tok/s total | MFU % | "
              "peak alloc GiB | peak reserved GiB | status | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['loss']} | {r['batch']} | {r['ac']} | {r['compile']} | "
                     f"{fmt(r['tokens_per_second'])} | {fmt(r['tokens_per_second_total'])} | "
                     f"{fmt(r['mfu_percent'], '{:.1f}')} | "
                     f"{fmt(r['memory_max_allocated_gib'], '{:.1f}')} | "
                     f"{fmt(r['memory_max_reserved_gib'], '{:.1f}')} | {r['status']} | "
                     f"{r['wall_seconds']:.0f} |")
    if runs:
        lines += ["", f"First run: `{runs[0]['command']}`"]
    for r in runs:
        if r["status"] in ("error", "timeout"):
            lines += ["", f"{r['loss']} batch {r['batch']} ac {r['ac']}: {r['status']} "
                      f"(exit {r['exit_code']}), last lines:", "```", r["output_tail"], "```"]
    return "\n".join(lines) + "\n"


def build_meta(args) -> dict:
    return {**probe_environment(), **provenance(), "nproc": args.nproc, "config": args.config,
            "seq_len": args.seq_len, "steps": args.steps, "warmup_steps": args.warmup_steps,
            "log_freq": args.log_freq,
            "measured_steps": measured_steps(args.steps, args.log_freq, args.warmup_steps),
            "losses": args.losses, "ac_modes": args.ac, "batch": args.batch,
            "max_batch": args.max_batch, "extra": args.extra,
            "allocator": allocator_settings(run_environment())}
