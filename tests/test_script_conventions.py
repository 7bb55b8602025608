"""Every script's --help, run-as-a-file message, no sys.path edits and shell syntax."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
SHELL_SCRIPTS = sorted([*SCRIPTS.rglob("*.sh"), *SCRIPTS.rglob("*.sbatch")])
# What a user runs (scripts/lib/ holds what they source and import).
USER_SCRIPTS = sorted(p for p in [*SHELL_SCRIPTS, *SCRIPTS.rglob("*.py")]
                      if "lib" not in p.relative_to(SCRIPTS).parts and p.name != "__init__.py")
PYTHON_SCRIPTS = [p for p in USER_SCRIPTS if p.suffix == ".py"]


def with_repo_on_path(env: dict) -> dict:
    """The Python scripts run as modules of the repository (`python3 -m scripts.NAME`): from
    another working directory the repository root goes on PYTHONPATH."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}


def module_of(script: Path) -> str:
    """scripts/bench/flce.py -> scripts.bench.flce"""
    return ".".join(("scripts", *script.relative_to(SCRIPTS).with_suffix("").parts))


def script_command(script: Path) -> list[str]:
    if script.suffix == ".py":
        return [sys.executable, "-m", module_of(script)]
    return ["bash", str(script)]


def run(cmd, env=None, timeout=120, **kwargs):
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, text=True,
                          capture_output=True, timeout=timeout, **kwargs)


# ---- --help: the usage, and nothing else -----------------------------------------------------

def files_under(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")
            if "__pycache__" not in p.parts}


def repo_status() -> list[str]:
    """git's view of the checkout, ignored files included (outputs/, logs/, ...)."""
    status = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
                            cwd=REPO, text=True, capture_output=True)
    if status.returncode != 0:
        return []  # not a git checkout (an unpacked copy): the temporary folder still counts
    return [line for line in status.stdout.splitlines()
            if "__pycache__" not in line and ".pytest_cache" not in line]


# -h too for the shell scripts; for Python's argparse -h is --help (and a run costs seconds).
HELP_CASES = [(script, flag) for script in USER_SCRIPTS
              for flag in (["--help"] if script.suffix == ".py" else ["--help", "-h"])]


@pytest.mark.parametrize("script, flag", HELP_CASES,
                         ids=[f"{s.relative_to(SCRIPTS)} {f}" for s, f in HELP_CASES])
def test_help_prints_the_usage_and_changes_no_file(script, flag, tmp_path):
    """Run from a folder holding earlier results (compare_fused_vs_unfused.sh used to delete
    outputs/compare/flce on --help) and with no SLURM job around: exit 0, the usage on stdout,
    and no file created, changed or deleted there or in the checkout."""
    for name in ("outputs/compare/flce/metrics.jsonl", "outputs/debug/metrics.jsonl",
                 "logs/flce-train-1.out"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    before, repo_before = files_under(tmp_path), repo_status()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONDONTWRITEBYTECODE="1")
    env.pop("CONFIG", None)
    result = subprocess.run([*script_command(script), flag], cwd=tmp_path,
                            env=with_repo_on_path(env), text=True, capture_output=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "usage" in result.stdout.lower() and script.stem in result.stdout, result.stdout
    if script.suffix == ".py":  # as it is run, and the whole docstring, not its first line
        assert f" -m {module_of(script)}" in result.stdout.splitlines()[0], result.stdout
        lines = [line.strip() for line in ast.get_docstring(ast.parse(script.read_text()),
                                                            clean=True).splitlines()]
        shown = [line.strip() for line in result.stdout.splitlines()]
        assert lines[-1] in shown and lines[2] in shown, result.stdout
    assert files_under(tmp_path) == before
    assert repo_status() == repo_before


@pytest.mark.parametrize("script", PYTHON_SCRIPTS, ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_a_script_run_as_a_file_says_how_to_run_it(script, tmp_path):
    """`python3 scripts/NAME.py` (as the README once said): a script that imports the repository
    stops with one line naming the module command, not a traceback; one that imports only the
    standard library runs as a file too."""
    result = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, text=True,
                            capture_output=True, timeout=120)
    if result.returncode == 0:
        assert "usage" in result.stdout.lower(), result.stdout
    else:
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("run from the repository root as a module: ")
        assert line.endswith(f" -m {module_of(script)} ..."), line


def test_step_floor_refuses_fewer_than_one_shard():
    """--shards 0 is a one-line usage error naming the option, before any GPU is looked for
    (it used to reach a division by zero, or on the CPU the missing-GPU assertion)."""
    result = run([sys.executable, "-m", "scripts.bench.step_floor", "--shards", "0"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "error: --shards must be at least 1, got 0"), result.stderr


def test_no_sys_path_edits():
    """The recipe runs from the repository root and the scripts as its modules: nothing needs
    to edit sys.path (only flce is installed)."""
    folders = ("flce", "components", "models", "parallelisms", "scripts", "tests")
    tree = [REPO / "train.py", *[p for d in folders for p in (REPO / d).rglob("*.py")]]
    edits = [str(p.relative_to(REPO)) for p in tree
             if re.search(r"sys\.path\.(insert|append|extend)|sys\.path\s*=", p.read_text())]
    assert edits == []


# ---- shell syntax ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["run_train.sh", "compare_fused_vs_unfused.sh",
                                  "compare_float8_vs_bf16.sh",
                                  "compare_losses.py", "slurm/train.sbatch",
                                  "slurm/torchrun_cmd.sh"])
def test_script_is_executable(name):
    # compare_fused_vs_unfused.sh runs run_train.sh, and srun runs torchrun_cmd.sh, directly.
    assert os.access(SCRIPTS / name, os.X_OK), f"chmod +x scripts/{name}"


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    result = run(["bash", "-n", str(script)])
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck():
    result = run(["shellcheck", "--shell=bash", *map(str, SHELL_SCRIPTS)])
    assert result.returncode == 0, result.stdout + result.stderr
