"""Launching the trainer's processes from tests: torchrun as a subprocess, with what a failure
needs to be read in CI (`errors`), and one more launch when a rank died in native code (`launch`)."""

import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import forked_ranks

ROOT = Path(__file__).resolve().parents[1]

# PYTHONFAULTHANDLER: a rank that crashes (a signal) prints its Python stack for errors()
LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
# A rank that dies in native code (a segfault, or glibc's abort on a corrupted heap) rather than
# raising: on torch 2.13 with 8 gloo processes on 2 CPU cores, the CP x TP launch of
# test_eight_processes.py crashed so in 2 of 11 runs here, inside PyTorch's ring attention
# (its all_gather), and passed in the other 9. Such a launch runs once more from where it
# started, with a warning naming the crash; a second crash fails the test.
NATIVE_CRASH = re.compile(r"Fatal Python error: (Segmentation fault|Aborted)")


def launch(command: list[str], dump: Path, forked: bool = False) -> subprocess.CompletedProcess:
    """Run a torchrun command writing into `dump`; once more, on `dump` as it was before, if a
    rank crashed in native code (NATIVE_CRASH). `forked`: its ranks forked from a process that
    imported torch already (tests/forked_ranks.py), for a test of what the ranks compute."""
    before = dump.with_name(dump.name + ".before-launch")
    if dump.exists():  # a launch may resume in a folder an earlier one wrote
        shutil.copytree(dump, before)
    for attempt in (1, 2):
        run = (forked_ranks.run if forked else subprocess.run)(
            command, cwd=ROOT, env={**os.environ, **LAUNCH_ENV}, timeout=400,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if run.returncode == 0 or attempt == 2 or not NATIVE_CRASH.search(run.stderr):
            break
        warnings.warn(f"torchrun: a rank crashed in native code, launching again: "
                      f"{errors(run.stderr, keep=12)}")
        shutil.rmtree(dump, ignore_errors=True)
        if before.exists():
            shutil.copytree(before, dump)
    shutil.rmtree(before, ignore_errors=True)
    return run


def errors(output: str, keep: int = 40) -> str:
    """What the ranks of a failed launch printed (its stderr, or its merged output) before
    torchrun's own report, without the warnings every rank prints (CI shows a failure's first
    lines only, and 8 ranks' warnings fill them), then the report's lines that say how a rank
    ended (a signal such as SIGSEGV prints nothing before them). torchrun prefixes each rank's
    lines with [rankN]:."""
    ranks = re.split(r"^[EW]\d{4} .*torch/distributed/elastic/", output, maxsplit=1, flags=re.M)[0]
    lines = []
    for line in ranks.splitlines():
        text = re.sub(r"^\[rank\d+\]:", "", line)
        if text.lstrip().startswith("File ") or (
                text.strip() and not text.startswith(" ") and "Warning" not in text
                and not re.match(r"W\d{4} ", text)):
            lines.append(line)
    ends = re.findall(r"^\s*((?:exitcode|traceback)\s*:.*\S)", output, flags=re.M)
    return " | ".join(lines[-keep:] + ends[:4])
