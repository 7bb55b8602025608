"""A benchmark report: where it comes from (the environment, the command, the commit, with a tree
that differs from its commit flagged loudly) and its two files, <out>.json and <out>.md.

A result that cannot be traced to a commit says so in both files: the JSON's meta has
"dirty": true (null when the commit is unknown), and the markdown starts with a bold line
"DIRTY TREE: not reproducible from a commit" (or "UNKNOWN REVISION: ..."). Such results may be
kept, but benchmarks/README.md cites them as such. Never imports torch.
"""

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from components.synced_files import write_synced

REPO = Path(__file__).resolve().parents[2]
# Untracked files here are earlier benchmarks' results, not code: they leave the tree clean.
RESULTS_DIR = "benchmarks/"

# Run in a child process with the trainer's Python: versions and the GPU, without a CUDA context
# in the launching process. Free memory at the start shows whether something else used the GPU.
ENV_PROBE = r"""
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": None, "gpu_count": 0}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info(0)
    info.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                gpu_memory_gib=round(total / 2**30, 1),
                gpu_free_gib_at_start=round(free / 2**30, 1))
print(json.dumps(info))
"""


def probe_environment() -> dict:
    """torch, CUDA, triton and the GPU, asked of a child process (no CUDA context here)."""
    try:
        result = subprocess.run([sys.executable, "-c", ENV_PROBE], capture_output=True,
                                text=True, timeout=120)
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, json.JSONDecodeError, IndexError, OSError) as e:
        return {"probe_error": f"{type(e).__name__}: {e}"}


def _git(repo: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                timeout=10)
    except (subprocess.SubprocessError, OSError):
        return None
    return result.stdout if result.returncode == 0 else None


def git_revision(repo: Path = REPO) -> dict:
    """{"git": the short commit (+dirty), "dirty": whether the tree differs from it}, both None
    when unknown. $FLCE_GIT_REVISION, when set, is taken as it is ("dirty" when it ends with
    +dirty): a copy of the tree sent to another machine can carry a stale .git, so its sender
    names the commit it sent. A tracked file changed, or an untracked file outside benchmarks/,
    makes the tree dirty."""
    sent = os.environ.get("FLCE_GIT_REVISION")
    if sent:
        return {"git": sent, "dirty": sent.endswith("+dirty")}
    head = _git(repo, "rev-parse", "--short", "HEAD")
    status = _git(repo, "status", "--porcelain", "--untracked-files=all")
    if not head or status is None:
        return {"git": None, "dirty": None}
    changed = [line for line in status.splitlines()
               if not (line.startswith("?? ") and line[3:].lstrip('"').startswith(RESULTS_DIR))]
    dirty = bool(changed)
    return {"git": head.strip() + ("+dirty" if dirty else ""), "dirty": dirty}


def reproducibility_warning(meta: dict) -> str | None:
    """The loud line for a result that no commit reproduces, or None."""
    if meta.get("dirty"):
        return (f"**DIRTY TREE: not reproducible from a commit** (git {meta['git']}: the code "
                "measured differs from that commit)")
    if meta.get("git") is None:
        return ("**UNKNOWN REVISION: not reproducible from a commit** (no git checkout and no "
                "FLCE_GIT_REVISION)")
    return None


def warning_lines(meta: dict) -> list[str]:
    """The warning and a blank line for the top of a markdown report, or nothing."""
    warning = reproducibility_warning(meta)
    return [warning, ""] if warning else []


def kernel_report_head(meta: dict, dtype: str) -> list[str]:
    """The first lines of a kernel benchmark's markdown: the warning of a tree no commit
    reproduces, the GPU, versions, dtype, date and commit, the command, and a blank line."""
    return [*warning_lines(meta),
            f"GPU: {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · {dtype} · "
            f"{meta['date']} · git {meta['git']}",
            f"Command: `{meta['command']}`", ""]


def command_line(launcher: tuple[str, ...] = ("python3",)) -> str:
    """The command that ran this process: `python3 -m scripts.NAME ARGS` for a script run as a
    module (launcher replaces python3, e.g. with torchrun's)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    target = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    return shlex.join([*launcher, *target, *sys.argv[1:]])


def provenance(launcher: tuple[str, ...] = ("python3",)) -> dict:
    """python, date, command, git and dirty of a report's meta; prints the warning, if any, to
    stderr at once (a long benchmark should not run for nothing)."""
    meta = {"python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(launcher), **git_revision()}
    warning = reproducibility_warning(meta)
    if warning:
        print(f"warning: {warning.replace('**', '')}", file=sys.stderr, flush=True)
    return meta


# an --out ending in one of these names the report itself (out.json: out.json and out.md)
REPORT_SUFFIXES = (".json", ".md")


def report_file(out: str | Path, suffix: str) -> Path:
    """The report file <out><suffix> (suffix ".json" or ".md"). out keeps its whole name:
    Path.with_suffix would take a dot in it for a suffix (name_v1.5 would give name_v1.json);
    only a .json or .md ending is replaced."""
    out = Path(out)
    if out.suffix in REPORT_SUFFIXES:
        return out.with_suffix(suffix)
    return out.with_name(out.name + suffix)


def write_report(out: str | Path, report: dict, markdown: str) -> None:
    """<out>.json and <out>.md (report_file), each written to a temporary file, synced and
    renamed (components/synced_files.py): a reader (or a benchmark killed mid-write) never leaves
    half a file."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(report, indent=1) + "\n"), (".md", markdown)):
        write_synced(report_file(out, suffix), text, atomic=True)


def fmt(value, spec: str = "{:,.0f}") -> str:
    return "-" if value is None else spec.format(value)


def grid_table(results: list[dict], key: str, shape_label: str, cell_text) -> list[str]:
    """Markdown table: a row per value of r[key], a column per shape (both in first-seen order);
    cell_text(name, result or None) fills each cell."""
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    names = list(dict.fromkeys(r[key] for r in results))
    cell = {(r["shape"], r[key]): r for r in results}
    lines = [f"| {key} | " + " | ".join(f"{s} ({shape_label})" for s in shapes) + " |",
             "|---|" + "---|" * len(shapes)]
    for n in names:
        cells = (cell_text(n, cell.get((s, n))) for s in shapes)
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines
