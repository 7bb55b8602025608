"""The launch and analysis scripts: --help of every script (usage, no side effect), shell syntax,
the per-node torchrun command from fake SLURM variables and outside a job, the batch script's
signal -> requeue logic (fake srun/scontrol; tests/test_slurm.py runs it on a real cluster),
compare_losses.py's absolute and noise-band verdicts on synthetic and real metrics, and short
real CPU runs through compare_fused_vs_unfused.sh."""

import ast
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
SHELL_SCRIPTS = sorted([*SCRIPTS.rglob("*.sh"), *SCRIPTS.rglob("*.sbatch")])
# What a user runs (scripts/lib/ holds what they source and import).
USER_SCRIPTS = sorted(p for p in [*SHELL_SCRIPTS, *SCRIPTS.rglob("*.py")]
                      if "lib" not in p.relative_to(SCRIPTS).parts and p.name != "__init__.py")
PYTHON_SCRIPTS = [p for p in USER_SCRIPTS if p.suffix == ".py"]
COMPARE = [sys.executable, str(SCRIPTS / "compare_losses.py")]
# A short debug run: about 5 s on 2 CPU cores.
SHORT = ["--training.device", "cpu", "--training.steps", "20", "--training.seq_len", "64",
         "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "2",
         "--validation.enable", "false", "--job.print_config", "false", "--optimizer.lr", "3e-3"]
# A stand-in torchrun: `--help` lists the signal options or not (newer torchrun vs torch 2.11's),
# and a run records the signals it gets, exiting 143 on SIGTERM as torchrun does. Its one child
# stands in for a trainer: it records a SIGUSR1 and exits 0 (Python, like the trainer, can handle
# a signal its parent ignores; bash cannot), and torchrun exits with the trainer's status.
FAKE_TORCHRUN = """#!/bin/bash
if [[ $1 == --help ]]; then
  echo "usage: torchrun [--nnodes NNODES] [--standalone] ${FAKE_TORCHRUN_HELP:-}"
  exit 0
fi
echo "$@" > "$FAKE_DIR/torchrun_args"
trap 'echo TERM >> "$FAKE_DIR/torchrun_signals"; kill $trainer; exit 143' TERM
trap 'echo USR1 >> "$FAKE_DIR/torchrun_signals"' USR1
python3 -c 'import os, signal, sys, time
def stop(signum, frame):
    open(os.environ["FAKE_DIR"] + "/trainer_signals", "a").write("USR1\\n")
    sys.exit(0)
signal.signal(signal.SIGUSR1, stop)
open(os.environ["FAKE_DIR"] + "/torchrun_started", "w").close()
time.sleep(30)' & trainer=$!
wait $trainer
"""
NEW_TORCHRUN_HELP = "[--signals-to-handle SIGNALS] [--shutdown-timeout SHUTDOWN_TIMEOUT]"


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


# ---- the torchrun command of each node -------------------------------------------------------

def slurm_env(node_id, nodelist="gpu[07-08]"):
    env = {"SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": "2", "SLURM_JOB_ID": "123456",
           "SLURM_NODEID": str(node_id), "GPUS_PER_NODE": "8", "CONFIG": "configs/llama_1b.toml"}
    return env


@pytest.fixture
def fake_torchrun(tmp_path):
    bin_dir = tmp_path / "torchrun_bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path)}


def torchrun_argv(env, *overrides, torchrun_help=NEW_TORCHRUN_HELP, fake=None):
    """The dry-run command of torchrun_cmd.sh, with the fake torchrun `fake` whose --help says
    torchrun_help; torchrun_help=None: with the installed torchrun."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    if torchrun_help is not None:
        clean.update(fake, FAKE_TORCHRUN_HELP=torchrun_help)
    result = subprocess.run(["scripts/slurm/torchrun_cmd.sh", "--dry-run", *overrides],
                            cwd=REPO, env={**clean, **env}, text=True, capture_output=True)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def option(argv, name):
    return argv[argv.index(name) + 1]


def test_torchrun_command_for_two_nodes(fake_torchrun):
    overrides = ["--training.steps", "10", "--job.dump_folder", "out dir/with space"]
    node0 = torchrun_argv(slurm_env(0), *overrides, fake=fake_torchrun)
    node1 = torchrun_argv(slurm_env(1), *overrides, fake=fake_torchrun)
    for argv in (node0, node1):
        assert argv[0] == "torchrun"
        assert option(argv, "--nnodes") == "2"
        assert option(argv, "--nproc-per-node") == "8"
        assert option(argv, "--rdzv-backend") == "c10d"
        assert option(argv, "--shutdown-timeout") == "240"
        # SIGUSR1 and SIGINT must not reach torchrun's handler: they go to the trainers
        assert option(argv, "--signals-to-handle") == "SIGTERM,SIGHUP,SIGQUIT"
        script = argv.index(str(REPO / "train.py"))
        assert argv[script + 1:] == ["--config", "configs/llama_1b.toml", *overrides]
    # Same rendezvous (the first node, a port from the job id); node 0 hosts the store.
    assert option(node0, "--rdzv-endpoint") == option(node1, "--rdzv-endpoint")
    assert option(node0, "--rdzv-endpoint").startswith("gpu07:")
    assert option(node0, "--rdzv-id") == option(node1, "--rdzv-id") == "123456"
    assert option(node0, "--rdzv-conf") == "is_host=true"
    assert option(node1, "--rdzv-conf") == "is_host=false"
    differ = [(a, b) for a, b in zip(node0, node1) if a != b]
    assert differ == [("is_host=true", "is_host=false")]


@pytest.mark.parametrize("nodelist, first", [
    ("node[01-02]", "node01"), ("gpu-a,gpu-b", "gpu-a"), ("n[3,5-6],x", "n3"),
    ("rack[1-2]-gpu[08-09]", "rack1-gpu08"), ("solo", "solo")])
def test_first_node_of_a_nodelist(nodelist, first, fake_torchrun):
    argv = torchrun_argv(slurm_env(0, nodelist), fake=fake_torchrun)
    assert option(argv, "--rdzv-endpoint").split(":")[0] == first


def test_torchrun_command_outside_a_job(fake_torchrun):
    """No SLURM_JOB_ID: one node, this machine, as --dry-run on a laptop shows."""
    argv = torchrun_argv({"GPUS_PER_NODE": "2", "CONFIG": "configs/debug.toml"},
                         "--training.steps", "3", fake=fake_torchrun)
    assert option(argv, "--nnodes") == "1" and option(argv, "--nproc-per-node") == "2"
    assert option(argv, "--rdzv-endpoint") == "localhost:29500"
    assert option(argv, "--rdzv-conf") == "is_host=true"
    assert argv[-5:] == [str(REPO / "train.py"), "--config", "configs/debug.toml",
                         "--training.steps", "3"]


def test_torchrun_command_reads_the_default_config_from_the_repository(fake_torchrun, tmp_path):
    """Run from another folder, the default config was a path relative to it (train.py then
    failed on every node); a CONFIG that is not there is one line before torchrun starts."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env = {**clean, **fake_torchrun, "FAKE_TORCHRUN_HELP": NEW_TORCHRUN_HELP}
    script = str(REPO / "scripts/slurm/torchrun_cmd.sh")
    result = subprocess.run([script, "--dry-run"], cwd=tmp_path, env=env, text=True,
                            capture_output=True)
    assert result.returncode == 0, result.stderr
    assert option(shlex.split(result.stdout), "--config") == str(REPO / "configs/llama_1b.toml")
    result = subprocess.run([script, "--dry-run"], cwd=tmp_path, text=True, capture_output=True,
                            env={**env, "CONFIG": "configs/llama_1b.toml"})
    assert result.returncode == 2 and result.stderr == (
        f"error: CONFIG=configs/llama_1b.toml: no such file (from {tmp_path})\n")


def test_sbatch_outside_a_job_or_the_repository_says_so(tmp_path):
    """Under plain bash it stopped at "SLURM_JOB_ID: unbound variable"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", "scripts/slurm/train.sbatch"], cwd=REPO, env=env,
                            text=True, capture_output=True)
    assert result.returncode == 2 and "submit it with sbatch" in result.stderr
    result = subprocess.run(["bash", str(REPO / "scripts/slurm/train.sbatch")], cwd=REPO,
                            text=True, capture_output=True,
                            env={**env, "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path)})
    assert result.returncode == 2 and "is not the repository's root" in result.stderr
    assert not (tmp_path / "logs").exists()


def test_torchrun_command_in_a_job_needs_its_variables():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["scripts/slurm/torchrun_cmd.sh", "--dry-run"], cwd=REPO,
                            env={**env, "SLURM_JOB_ID": "7"}, text=True, capture_output=True)
    assert result.returncode != 0 and "SLURM_JOB_NODELIST: not set" in result.stderr


def test_first_node_without_a_slurm_config(fake_torchrun, tmp_path):
    """SLURM's client installed but no cluster configured (scontrol fails): parse it here."""
    scontrol = Path(fake_torchrun["PATH"].split(":")[0]) / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 'scontrol: fatal: no configuration' >&2\nexit 1\n")
    scontrol.chmod(0o755)
    argv = torchrun_argv(slurm_env(0, "node[03-04]"), fake=fake_torchrun)
    assert option(argv, "--rdzv-endpoint").split(":")[0] == "node03"


def test_signal_options_follow_the_installed_torchrun():
    installed = run(["torchrun", "--help"]).stdout
    argv = torchrun_argv(slurm_env(0), torchrun_help=None)
    assert ("--signals-to-handle" in argv) == ("--signals-to-handle" in installed)
    assert "USR1" not in " ".join(argv) and "SIGINT" not in " ".join(argv)
    assert ("--shutdown-timeout" in argv) == ("--shutdown-timeout" in installed)


@pytest.mark.parametrize("torchrun_help", ["", NEW_TORCHRUN_HELP], ids=["torch-2.11", "newer"])
def test_usr1_goes_to_the_trainers_not_torchrun(fake_torchrun, tmp_path, torchrun_help):
    # torchrun exits 1 after relaying a signal, whatever its trainers did: the node script
    # sends SIGUSR1 to the trainers itself, and torchrun (which ignores it, also when SLURM
    # signals every process of the step) exits with their status.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    job = subprocess.Popen(["scripts/slurm/torchrun_cmd.sh", "--training.steps", "5"], cwd=REPO,
                           env={**clean, **slurm_env(0), **fake_torchrun,
                                "FAKE_TORCHRUN_HELP": torchrun_help},
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while not (tmp_path / "torchrun_started").exists():
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0]
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    output = job.communicate(timeout=20)[0]
    assert (tmp_path / "trainer_signals").read_text().split() == ["USR1"], output
    assert not (tmp_path / "torchrun_signals").exists(), output
    assert job.returncode == 0, output  # the trainer's status, through torchrun
    assert (tmp_path / "torchrun_args").read_text().split()[-3:] == ["configs/llama_1b.toml",
                                                                      "--training.steps", "5"]


def _kill_tree(root: int) -> str:
    """SIGKILL a process and all its descendants (torchrun starts its workers in sessions of
    their own: a process-group kill misses them); returns the tree as ps listed it."""
    rows = [line.split(None, 2) for line in subprocess.run(
        ["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout.splitlines()]
    tree, frontier = [], {root}
    while frontier:
        found = [r for r in rows if len(r) == 3 and int(r[1]) in frontier]
        tree += found
        frontier = {int(r[0]) for r in found}
    for pid in [root] + [int(r[0]) for r in tree]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return "\n".join(" ".join(r) for r in tree)


def _signals_as_default():
    # A shell that starts with SIGINT ignored cannot trap it (bash ignores traps on signals
    # ignored at entry), and a command run with `&` from a script starts so: the test must not
    # depend on how its own process was started (a background CI run failed here).
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.slow
def test_sigint_through_run_train_after_a_saved_stop_exits_0(tmp_path):
    """kill -INT of run_train.sh with two trainers (torchrun, gloo): the trainers save and
    stop, and the script exits 0 (torchrun, when it relayed the SIGINT, re-raised it: exit 1)."""
    dump = tmp_path / "run"
    job = subprocess.Popen(["scripts/run_train.sh", *SHORT, "--training.steps", "100000",
                            "--loss.impl", "unfused", "--data.synthetic", "true",
                            "--training.local_batch_size", "2", "--metrics.log_freq", "1",
                            "--checkpoint.enable", "true", "--checkpoint.interval", "100000",
                            "--job.dump_folder", str(dump)], cwd=REPO, text=True,
                           env={**os.environ, "NGPU": "2", "CONFIG": "configs/debug.toml",
                                "OMP_NUM_THREADS": "1", "PYTHON": sys.executable},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           preexec_fn=_signals_as_default)

    def fail(why: str):
        tree = _kill_tree(job.pid)  # the trainers hold the output pipe open: they go first
        pytest.fail(f"{why}; processes:\n{tree}\n{job.communicate(timeout=30)[0][-3000:]}")

    try:
        deadline = time.monotonic() + 180
        while not ((dump / "metrics.jsonl").is_file()
                   and len((dump / "metrics.jsonl").read_text().splitlines()) >= 2):
            if time.monotonic() > deadline or job.poll() is not None:
                fail("no second step logged")
            time.sleep(0.1)
        job.send_signal(signal.SIGINT)
        try:
            output = job.communicate(timeout=180)[0]
        except subprocess.TimeoutExpired:
            fail("no exit 180 s after SIGINT")
    finally:
        if job.poll() is None:
            _kill_tree(job.pid)
    assert job.returncode == 0, output[-3000:]
    assert "received SIGINT: stopped after step" in output, output[-3000:]
    assert len(list((dump / "checkpoint").glob("step-*"))) == 1


@pytest.mark.parametrize("ngpu, expect", [
    ("1", [sys.executable, str(REPO / "train.py")]),
    ("2", ["torchrun", "--standalone", "--nproc-per-node", "2"])])
def test_run_train_command(ngpu, expect):
    result = run(["scripts/run_train.sh", "--training.steps", "5"],
                 env={"NGPU": ngpu, "DRY_RUN": "1", "PYTHON": sys.executable,
                      "CONFIG": "configs/debug.toml"})
    argv = shlex.split(result.stdout)
    assert result.returncode == 0, result.stderr
    assert argv[:len(expect)] == expect
    assert argv[-4:] == ["--config", "configs/debug.toml", "--training.steps", "5"]


# ---- train.sbatch: USR1 -> forwarded to srun -> requeue --------------------------------------

FAKE_SRUN = """#!/bin/bash
echo "$@" > "$FAKE_DIR/srun_args"
echo "${FLCE_TEST_SETUP:-unset}" > "$FAKE_DIR/srun_env"
if [[ -n ${FAKE_SRUN_RC:-} ]]; then exit "$FAKE_SRUN_RC"; fi
sleep 30 & sleeper=$!
# Like torchrun after the trainers checkpointed: exits non-zero once told to stop.
trap 'kill $sleeper; touch "$FAKE_DIR/srun_got_usr1"; exit 1' USR1
touch "$FAKE_DIR/srun_started"
wait $sleeper
"""
FAKE_SCONTROL = """#!/bin/bash
case $1 in
  show) printf 'node01\\nnode02\\n' ;;
  requeue) echo "$2" >> "$FAKE_DIR/requeued" ;;
esac
"""


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(tmp_path),
           "SLURM_SUBMIT_DIR": str(REPO), "LOG_ROOT": str(tmp_path / "logs"),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "t", "SLURM_JOB_NODELIST": "node[01-02]",
           "SLURM_NNODES": "2"}
    return tmp_path, env


def start_sbatch(env):
    return subprocess.Popen(["bash", "scripts/slurm/train.sbatch", "--training.steps", "5"],
                            cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def test_sbatch_requeues_after_usr1(fake_slurm):
    tmp, env = fake_slurm
    job = start_sbatch(env)
    deadline = time.monotonic() + 10
    while not (tmp / "srun_started").exists():
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0]
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 does
    output = job.communicate(timeout=20)[0]
    assert job.returncode == 0, output
    assert (tmp / "srun_got_usr1").exists(), "the batch shell did not forward USR1 to srun"
    assert (tmp / "requeued").read_text().split() == ["4242"], output
    srun_args = (tmp / "srun_args").read_text()
    assert "--kill-on-bad-exit=1" in srun_args
    assert srun_args.rstrip().endswith("scripts/slurm/torchrun_cmd.sh --training.steps 5")
    assert (tmp / "logs" / "t-4242").is_dir()


@pytest.mark.parametrize("srun_rc", ["0", "3"])
def test_sbatch_without_usr1_does_not_requeue(fake_slurm, srun_rc):
    tmp, env = fake_slurm
    job = start_sbatch({**env, "FAKE_SRUN_RC": srun_rc})
    output = job.communicate(timeout=20)[0]
    assert job.returncode == int(srun_rc), output
    assert not (tmp / "requeued").exists()


def test_sbatch_sources_the_environment_hook_before_srun(fake_slurm):
    """FLCE_ENV_SETUP (a venv, conda, modules): sourced by the batch shell, under `set +u` as
    activation scripts need; what it exports reaches srun (and through it every node)."""
    tmp, env = fake_slurm
    setup = tmp / "my env.sh"
    setup.write_text('echo "setup: ${NOT_SET_ANYWHERE}"\nexport FLCE_TEST_SETUP=activated\n')
    job = start_sbatch({**env, "FAKE_SRUN_RC": "0", "FLCE_ENV_SETUP": str(setup)})
    output = job.communicate(timeout=20)[0]
    assert job.returncode == 0, output
    assert f"sourcing {setup}" in output and "setup: \n" in output
    assert (tmp / "srun_env").read_text() == "activated\n"


def test_sbatch_stops_when_the_named_environment_hook_is_missing(fake_slurm):
    tmp, env = fake_slurm
    job = start_sbatch({**env, "FAKE_SRUN_RC": "0", "FLCE_ENV_SETUP": str(tmp / "nowhere.sh")})
    output = job.communicate(timeout=20)[0]
    assert job.returncode == 1
    assert f"error: FLCE_ENV_SETUP={tmp}/nowhere.sh: no such file" in output
    assert not (tmp / "srun_args").exists()


# ---- compare_losses.py on synthetic metrics --------------------------------------------------

def write_metrics(path: Path, loss, steps=range(1, 31), val_every=10) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for step in steps:
            value = loss(step)
            f.write(json.dumps({"step": step, "time": 0.0, "loss": value, "lr": 1e-3}) + "\n")
            if step % val_every == 0:  # validation lines carry no "loss"
                f.write(json.dumps({"step": step, "time": 0.0, "val_loss": 2.5}) + "\n")
    return path


def curve(step):
    return 2.0 + 4.0 * math.exp(-step / 8)


def append_resumed(run: Path, steps) -> None:
    """The lines of a run resumed in run's folder: `curve` at steps."""
    with open(run / "metrics.jsonl", "a") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "time": 1.0, "loss": curve(step)}) + "\n")


def compare(*args):
    return run([*COMPARE, *map(str, args)])


def first_divergent_step(stdout: str, run_path: Path) -> str:
    """The last column of run_path's row in the "vs A" table."""
    table = stdout[stdout.index("vs A"):]
    return next(line for line in table.splitlines() if line.startswith(str(run_path))).split()[-1]


def test_identical_runs_pass(tmp_path):
    a = write_metrics(tmp_path / "a", curve)
    b = write_metrics(tmp_path / "b", curve)
    result = compare(a, b / "metrics.jsonl", "--out", tmp_path / "plot.png")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_that_stopped_early_is_refused_not_passed(tmp_path):
    """A run stopped at step 4 of 30 (SIGUSR1, exit 0) compared over the 4 steps both logged
    and passed: "2 runs aligned on 4 common steps", PASS, the other 26 unseen."""
    a = write_metrics(tmp_path / "a", curve)
    b = write_metrics(tmp_path / "b", curve, steps=range(1, 5))
    result = compare(a, b)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (f"error: the runs end at different steps ({a} at step 30, {b} at "
                             "step 4): a comparison over the steps they share would hide the "
                             "rest; rerun the one that stopped early\n")


@pytest.mark.parametrize("line, error", [
    ('{"step": 2, "loss": "abc"}', "loss 'abc' is not a number"),
    ('{"step": 2, "loss": {"x": 1}}', "loss {'x': 1} is not a number"),
    ('{"step": "x", "loss": 1.0}', "step 'x' is not a step number"),
    ("7", "a JSON int, not a metrics line"),
    (b"\xff\xfe", "not UTF-8 text")])
def test_a_malformed_metrics_line_is_bad_input(tmp_path, line, error):
    """Each was a traceback and exit 1, the code of "the curves differ", not 2 (bad input)."""
    a = write_metrics(tmp_path / "a", curve, steps=range(1, 3))
    bad = tmp_path / "b.jsonl"
    first = '{"step": 1, "loss": 5.0}\n'
    bad.write_bytes(first.encode() + line if isinstance(line, bytes) else
                    (first + line + "\n" + '{"step": 3, "loss": 4.0}\n').encode())
    result = compare(a, bad)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and error in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def test_a_seed_run_that_smooths_to_a_is_no_band(tmp_path):
    """A = [5.0, 4.5], seed = [5.25, 4.25]: the raw curves differ, their moving averages do
    not, and the band verdict divided by zero (ZeroDivisionError)."""
    a = write_metrics(tmp_path / "a", lambda s: [5.0, 4.5][s - 1], steps=range(1, 3))
    seed = write_metrics(tmp_path / "seed", lambda s: [5.25, 4.25][s - 1], steps=range(1, 3))
    b = write_metrics(tmp_path / "b", lambda s: [5.1, 4.4][s - 1], steps=range(1, 3))
    result = compare(a, b, "--seed-run", seed)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"error: no noise band: the seed run {seed}, smoothed over")


def test_a_divergence_fails_and_names_its_first_step(tmp_path):
    a = write_metrics(tmp_path / "a", curve)
    b = write_metrics(tmp_path / "b", lambda s: curve(s) + (0.2 if s >= 13 else 0.001))
    result = compare(a, b, "--tolerance", "0.05")
    assert result.returncode == 1, result.stdout + result.stderr
    assert first_divergent_step(result.stdout, b) == "13"
    assert "FAIL" in result.stdout
    assert (a / "compare_loss.png").is_file()  # the default plot path
    # A looser tolerance passes; a lower threshold only moves the reported first step.
    loose = compare(a, b, "--tolerance", "0.5", "--threshold", "0.0005")
    assert loose.returncode == 0, loose.stdout
    assert first_divergent_step(loose.stdout, b) == "1"


def test_seed_run_gives_the_relative_spread_and_is_not_judged(tmp_path):
    a = write_metrics(tmp_path / "a", curve)
    b = write_metrics(tmp_path / "b", lambda s: curve(s) + 0.01)
    seed = write_metrics(tmp_path / "seed", lambda s: curve(s) + (0.1 if s % 2 else -0.1))
    result = compare(a, b, "--seed-run", seed, "--tolerance", "0.05", "--verdict", "absolute")
    assert result.returncode == 0, result.stdout + result.stderr  # seed differs by 0.1: not judged
    assert "verdict: absolute (--verdict absolute)" in result.stdout
    line = next(line for line in result.stdout.splitlines() if "relative to seed spread" in line)
    assert float(line.rsplit("=", 1)[1]) == pytest.approx(0.1)


def test_null_is_a_divergence(tmp_path):
    a = write_metrics(tmp_path / "a", curve)
    b = write_metrics(tmp_path / "b", lambda s: None if s == 17 else curve(s))
    result = compare(a, b, "--tolerance", "10")
    assert result.returncode == 1, result.stdout
    assert "non-finite" in result.stdout and "step 17" in result.stdout


def test_the_last_line_of_a_repeated_step_wins(tmp_path):
    a = write_metrics(tmp_path / "a", curve)
    b = write_metrics(tmp_path / "b", lambda s: curve(s) + (1.0 if s > 10 else 0.0))
    append_resumed(b, range(11, 31))  # resumed from step 10, repeating 11-30 correctly
    result = compare(a, b)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "steps go back from 30 to 11: a resumed run" in result.stderr


def test_a_rolled_back_run_leaves_its_abandoned_steps_out(tmp_path):
    """B ran to step 30 on a bad curve, was resumed from its step-10 checkpoint and has reached
    step 20: its steps 21-30 belong to the abandoned timeline, not to the run compared with A."""
    a = write_metrics(tmp_path / "a", curve, steps=range(1, 21))
    b = write_metrics(tmp_path / "b", lambda s: curve(s) + (1.0 if s > 10 else 0.0))
    append_resumed(b, range(11, 21))
    result = compare(a, b)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replace the earlier run's after step 10" in result.stderr


def test_a_rollback_drops_the_abandoned_validations_too(tmp_path):
    """B validated at steps 10, 20 and 30, was resumed from step 15 and reached 18: its going
    back showed only on training lines, so --metric val_loss kept the validations of 20 and 30."""
    a = write_metrics(tmp_path / "a", curve, steps=range(1, 19))
    b = write_metrics(tmp_path / "b", curve)
    append_resumed(b, range(16, 19))
    result = compare(a, b, "--metric", "val_loss")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vs A" in result.stdout


def test_two_runs_in_one_file_are_refused(tmp_path):
    """A second run from step 1 appended to the first's file (what the trainer did before it
    kept fresh runs apart) is not a resumed run: comparing the mix would mislead."""
    a = write_metrics(tmp_path / "a", curve)
    b = write_metrics(tmp_path / "b", curve)
    with open(b / "metrics.jsonl", "a") as f:
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "time": 1.0, "loss": curve(step) + 0.5}) + "\n")
    result = compare(a, b)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "metrics.jsonl:34: step 1 follows step 30: the file holds more than one run" in \
        result.stderr


@pytest.mark.parametrize("problem", ["missing", "no common steps", "metric absent"])
def test_bad_input_exits_2(tmp_path, problem):
    a = write_metrics(tmp_path / "a", curve)
    if problem == "missing":
        b = tmp_path / "nowhere"
    elif problem == "no common steps":
        b = write_metrics(tmp_path / "b", curve, steps=range(100, 110))
    else:
        b = write_metrics(tmp_path / "b", curve)
    extra = ["--metric", "grad_norm"] if problem == "metric absent" else []
    result = compare(a, b, *extra)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ")


# ---- the noise-band verdict ------------------------------------------------------------------

LONG = range(1, 151)


def jitter(step, amplitude):
    """Per-step differences around zero, like bf16 curves that separate chaotically (the golden
    angle per step: no period that a moving-average window lines up with)."""
    return amplitude * math.sin(2.39996 * step)


def smoothed_mean_abs_diff(run, reference, window=9):
    """Reference arithmetic for the band verdict: mean |centred moving average of run - ref|."""
    diff = np.array([run(s) - reference(s) for s in LONG])
    half = window // 2
    return np.mean([abs(diff[max(0, i - half):i + half + 1].mean()) for i in range(len(diff))])


def test_band_passes_chaotic_differences_that_the_absolute_test_fails(tmp_path):
    """The issue's H200 case in miniature: per-step differences of up to 0.06 (> 0.02), smoothed
    away, next to a seed run 0.06 above: the band verdict passes, the absolute one fails."""
    b_curve = lambda s: curve(s) + jitter(s, 0.06)
    seed_curve = lambda s: curve(s) + 0.06 + jitter(s + 7, 0.03)
    a = write_metrics(tmp_path / "a", curve, steps=LONG)
    b = write_metrics(tmp_path / "b", b_curve, steps=LONG)
    seed = write_metrics(tmp_path / "seed", seed_curve, steps=LONG)
    absolute = compare(a, b, "--seed-run", seed, "--tolerance", "0.02", "--verdict", "absolute")
    assert absolute.returncode == 1 and "FAIL" in absolute.stdout, absolute.stdout
    result = compare(a, b, "--seed-run", seed, "--tolerance", "0.02")  # auto: band
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "verdict: band (auto: --seed-run given)" in out
    assert "centred moving average over 9 logged step(s)" in out
    band = smoothed_mean_abs_diff(seed_curve, curve)
    mean = smoothed_mean_abs_diff(b_curve, curve)
    assert f"noise band: mean |seed - A| of the smoothed curves over steps 1..150 = {band:.4g}" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict == (f"PASS: within the noise band: {b}: mean |smoothed diff| {mean:.4g} = "
                       f"{mean / band:.3g} x the seed-to-seed spread {band:.4g} (limit 0.5)")
    assert mean / band < 0.2


def test_band_fails_a_systematic_difference(tmp_path):
    a = write_metrics(tmp_path / "a", curve, steps=LONG)
    b = write_metrics(tmp_path / "b", lambda s: curve(s) + 0.04 + jitter(s, 0.01), steps=LONG)
    seed = write_metrics(tmp_path / "seed", lambda s: curve(s) - 0.06, steps=LONG)
    result = compare(a, b, "--seed-run", seed)
    assert result.returncode == 1, result.stdout + result.stderr
    ratio = smoothed_mean_abs_diff(lambda s: 0.04 + jitter(s, 0.01), lambda s: 0) / 0.06
    assert f"{b}: {0.06 * ratio:.4g} = {ratio:.3g} x the band: OUTSIDE" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith(
        f"FAIL: {b}: mean |smoothed diff| {0.06 * ratio:.4g} = {ratio:.3g} x the seed-to-seed "
        "spread 0.06 (limit 0.5)")
    # The ratio limit is an option; so is the window.
    assert compare(a, b, "--seed-run", seed, "--band-ratio", "0.8").returncode == 0
    assert "over 3 logged step(s)" in compare(a, b, "--seed-run", seed, "--window", "3").stdout


def test_band_fails_a_non_finite_run(tmp_path):
    a = write_metrics(tmp_path / "a", curve, steps=LONG)
    b = write_metrics(tmp_path / "b", lambda s: None if s == 99 else curve(s), steps=LONG)
    seed = write_metrics(tmp_path / "seed", lambda s: curve(s) + 0.1, steps=LONG)
    result = compare(a, b, "--seed-run", seed)
    assert result.returncode == 1 and "FAIL: " in result.stdout
    assert "non-finite loss from step 99" in result.stdout


@pytest.mark.parametrize("problem", ["no seed run", "seed run equals A", "non-finite seed run"])
def test_band_without_a_usable_band_exits_2(tmp_path, problem):
    a = write_metrics(tmp_path / "a", curve)
    b = write_metrics(tmp_path / "b", lambda s: curve(s) + 0.01)
    seed_curve = {"no seed run": None, "seed run equals A": curve,
                  "non-finite seed run": lambda s: None if s == 5 else curve(s) + 0.1}[problem]
    args = ["--verdict", "band"]
    if seed_curve is not None:
        args += ["--seed-run", write_metrics(tmp_path / "seed", seed_curve)]
    result = compare(a, b, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert {"no seed run": "--verdict band needs --seed-run",
            "seed run equals A": "equals A at every common step",
            "non-finite seed run": "no noise band: non-finite loss"}[problem] in result.stderr


# ---- the real thing, on the CPU --------------------------------------------------------------

@pytest.fixture(scope="module")
def fused_vs_unfused(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    result = run(["scripts/compare_fused_vs_unfused.sh", "configs/debug.toml", *SHORT],
                 env={"OUT_DIR": str(out), "PYTHON": sys.executable, "NGPU": "1"}, timeout=600)
    return result, out


@pytest.mark.slow
def test_fused_and_unfused_losses_agree(fused_vs_unfused):
    """On the CPU (fp32, deterministic) the script picks the absolute verdict by itself."""
    result, out = fused_vs_unfused
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "=== device cpu: verdict absolute" in result.stdout
    assert "verdict: absolute (--verdict absolute)" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "PASS: every run within 0.02 of A at every step"
    assert (out / "fused_vs_unfused.png").is_file()


def train_short(dump, *overrides):
    result = run([sys.executable, "train.py", "--config", "configs/debug.toml", *SHORT,
                  "--metrics.log_freq", "1", *overrides, "--job.dump_folder", str(dump)],
                 timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return dump


@pytest.mark.slow
def test_another_learning_rate_is_caught_by_both_verdicts(fused_vs_unfused, tmp_path):
    """Real runs: fused vs unfused sits deep inside the noise band that a run at another seed
    measures; a run at another learning rate is outside it, and outside the tolerance."""
    _, out = fused_vs_unfused  # its flce run is this test's lr 3e-3 run
    other = train_short(tmp_path / "lr_1e-2", "--optimizer.lr", "1e-2")
    seed = train_short(tmp_path / "seed_1", "--training.seed", "1")
    result = compare(out / "flce", other, "--tolerance", "0.02")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL" in result.stdout
    same = compare(out / "flce", out / "unfused", "--seed-run", seed, "--window", "5")
    assert same.returncode == 0, same.stdout + same.stderr
    ratio = float(same.stdout.split(" x the seed-to-seed spread")[0].rsplit("= ", 1)[1])
    assert ratio < 1e-3  # fp32: ~1e-7 of the seed-to-seed spread
    lr = compare(out / "flce", other, "--seed-run", seed, "--window", "5")
    assert lr.returncode == 1 and "OUTSIDE" in lr.stdout, lr.stdout + lr.stderr


@pytest.mark.parametrize("device, verdict", [("cpu", "absolute"), ("cuda", "band")])
def test_fused_vs_unfused_picks_its_verdict(tmp_path, device, verdict):
    """GPU runs are judged against a noise band from a third run at the next seed; CPU runs by
    the absolute tolerance. DRY_RUN=1 prints the commands and deletes nothing, not even an
    earlier run of the script (a folder it marked)."""
    (tmp_path / "flce").mkdir()
    (tmp_path / "flce" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "flce" / ".scratch-run").write_text("")
    result = run(["scripts/compare_fused_vs_unfused.sh", "configs/debug.toml",
                  "--training.device", device, "--training.seed", "3"],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1",
                      "DRY_RUN": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"=== device {device}: verdict {verdict}" in result.stdout
    commands = [shlex.split(line) for line in result.stdout.splitlines()
                if not line.startswith("===")]
    assert [option(c, "--loss.impl") for c in commands[:-1]] == (
        ["flce", "unfused"] + (["flce"] if verdict == "band" else []))
    compare_cmd = commands[-1]
    assert compare_cmd[1].endswith("compare_losses.py")
    assert option(compare_cmd, "--verdict") == verdict
    if verdict == "band":
        seed_run = commands[2]  # the config's seed + 1, after (so over) the caller's
        tail = seed_run[seed_run.index("--loss.impl"):]
        assert tail[:4] == ["--loss.impl", "flce", "--training.seed", "4"]
        assert option(compare_cmd, "--seed-run") == str(tmp_path / "flce_seed4")
    else:
        assert "--seed-run" not in compare_cmd
    assert (tmp_path / "flce" / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize("args", [["configs/nope.toml"],
                                  ["configs/debug.toml", "--training.stepz", "3"],
                                  ["--training.steps", "3"]])
def test_fused_vs_unfused_bad_input_keeps_earlier_results(tmp_path, args):
    (tmp_path / "flce").mkdir()
    (tmp_path / "flce" / "metrics.jsonl").write_text("{}\n")
    result = run(["scripts/compare_fused_vs_unfused.sh", *args],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(("error: ", "usage: ")), result.stderr
    assert (tmp_path / "flce" / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize("script", ["run_train.sh", "compare_fused_vs_unfused.sh"])
@pytest.mark.parametrize("ngpu", ["0", "abc", "1 2"])
def test_a_bad_ngpu_is_one_line(tmp_path, script, ngpu):
    """NGPU=0 ran torchrun --nproc-per-node 0 (an AssertionError deep in torch), NGPU=abc was
    bash's "unbound variable", and NGPU="1 2" an arithmetic error before torchrun ran anyway."""
    result = run([f"scripts/{script}", *(["configs/debug.toml"] if script != "run_train.sh"
                                          else []), *SHORT],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": ngpu})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr == (f"error: NGPU={ngpu}: expected the number of processes, 1 or more "
                             "(1: one process, the CPU where there is no GPU)\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("setting", ["TOLERANCE=0.02x", "BAND_RATIO=-1", "BAND_RATIO=0"])
def test_a_bad_tolerance_is_refused_before_any_run(tmp_path, setting):
    """compare_losses.py read TOLERANCE and BAND_RATIO after every run had trained (and the
    earlier results were cleared): a typo cost the whole comparison."""
    (tmp_path / "flce").mkdir()
    (tmp_path / "flce" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "flce" / ".scratch-run").write_text("")
    name, value = setting.split("=")
    result = run(["scripts/compare_fused_vs_unfused.sh", "configs/debug.toml", *SHORT],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1",
                      name: value})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    bound = ">= 0" if name == "TOLERANCE" else "> 0"
    assert result.stderr == f"error: {setting}: expected a number {bound}\n"
    assert (tmp_path / "flce" / "metrics.jsonl").read_text() == "{}\n"


def test_fused_vs_unfused_refuses_a_folder_it_did_not_make(tmp_path):
    """OUT_DIR shared with a real run named flce: the script used to rm -rf it and train over
    it. Now it stops before any run, names the folder, and leaves every file where it was."""
    run_of_yours = tmp_path / "flce"
    (run_of_yours / "checkpoint" / "step-10").mkdir(parents=True)
    (run_of_yours / "metrics.jsonl").write_text('{"step": 10}\n')
    before = files_under(tmp_path)
    result = run(["scripts/compare_fused_vs_unfused.sh", "configs/debug.toml", *SHORT],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1"})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {run_of_yours} holds files that no script run made")
    assert files_under(tmp_path) == before


@pytest.mark.slow
def test_float8_vs_bf16_trains_both_and_judges_float8_by_the_seed_band(tmp_path):
    """Real CPU runs: the float8 run has float8 layers (emulated on the CPU) and the float8
    loss, its curve differs from bf16's (it is not bf16 again) by far less than another seed's."""
    result = run(["scripts/compare_float8_vs_bf16.sh", "configs/debug.toml", *SHORT],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1"},
                 timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "=== device cpu: verdict band" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("PASS: within the noise band")
    resolved = (tmp_path / "float8" / "config.toml").read_text()
    assert 'converters = ["quantize.linear.float8"]' in resolved
    assert "emulate = true" in resolved and 'float8 = "logits+dx"' in resolved
    assert 'converters = []' in (tmp_path / "bf16" / "config.toml").read_text()
    diffs = result.stdout.split("mean|diff|")[1]  # the table of mean |run - bf16|
    float8_diff = float(re.search(r"/float8 +([\d.]+)", diffs).group(1))
    seed_diff = float(re.search(r"/bf16_seed1 +([\d.]+)", diffs).group(1))
    assert 0 < float8_diff < seed_diff / 10
    assert (tmp_path / "float8_vs_bf16.png").is_file()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_float8_vs_bf16_commands(tmp_path, device):
    """DRY_RUN=1: bf16, float8 (FLOAT8's overrides; emulated on the CPU only), bf16 at the
    config's seed + 1, and the band verdict at 1x the seed spread, on either device."""
    result = run(["scripts/compare_float8_vs_bf16.sh", "configs/debug.toml",
                  "--training.device", device, "--training.seed", "3"],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1",
                      "DRY_RUN": "1", "FLOAT8": "--model.converters quantize.linear.float8"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"=== device {device}: verdict band" in result.stdout
    commands = [shlex.split(line) for line in result.stdout.splitlines()
                if not line.startswith("===")]
    bf16, float8, noise, compare_cmd = commands
    assert "--model.converters" not in bf16
    assert option(float8, "--model.converters") == "quantize.linear.float8"
    assert "--loss.float8" not in float8  # FLOAT8 replaced the default overrides
    assert ("--quantize.linear.float8.emulate" in float8) == (device == "cpu")
    seeds = [noise[i + 1] for i, word in enumerate(noise) if word == "--training.seed"]
    assert seeds == ["3", "4"]  # the script's after (so over) the caller's
    assert option(compare_cmd, "--seed-run") == str(tmp_path / "bf16_seed4")
    assert option(compare_cmd, "--band-ratio") == "1.0"
    assert option(compare_cmd, "--out") == str(tmp_path / "float8_vs_bf16.png")
    assert list(tmp_path.iterdir()) == []


# ---- compare_layouts.py ----------------------------------------------------------------------

LAYOUTS = [sys.executable, "-m", "scripts.compare_layouts", "--config", "configs/debug.toml"]


def test_layouts_refuse_a_runs_dir_folder_they_did_not_make(tmp_path):
    (tmp_path / "fsdp_flce").mkdir()
    (tmp_path / "fsdp_flce" / "notes.txt").write_text("mine\n")
    result = run([*LAYOUTS, "--layouts", "fsdp", "--runs-dir", str(tmp_path), "--steps", "4",
                  "--warmup-steps", "2", "--out", str(tmp_path / "report")])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "fsdp_flce holds files that no script run made" in result.stderr
    assert (tmp_path / "fsdp_flce" / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp_flce"]


def test_layout_commands(tmp_path):
    result = run([*LAYOUTS, "--nproc", "8", "--layouts", "fsdp,tp2_vocab,hsdp2", "--seed-runs",
                  "--runs-dir", str(tmp_path), "--extra=--training.local_batch_size 2",
                  "--dry-run"])
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    assert len(commands) == 9  # 3 layouts x (flce, unfused, unfused at seed + 1)
    for argv in commands:
        assert argv[argv.index("--nproc_per_node") + 1] == "8"
        assert argv.index("--training.local_batch_size") < argv.index("--loss.impl")
    tp_vocab = commands[3]
    assert option(tp_vocab, "--parallelism.tensor_parallel_degree") == "2"
    assert option(tp_vocab, "--loss.parallel") == "vocab"
    assert option(tp_vocab, "--loss.impl") == "flce"
    assert option(commands[5], "--training.seed") == "1"
    assert option(commands[6], "--parallelism.data_parallel_replicate_degree") == "2"
    assert option(commands[7], "--job.dump_folder") == str(tmp_path / "hsdp2_unfused")
    bad = run([*LAYOUTS, "--layouts", "fsdp,tp2_rows", "--dry-run"])
    assert bad.returncode == 2 and "layout 'tp2_rows'" in bad.stderr


@pytest.mark.slow
def test_layouts_on_two_cpu_processes(tmp_path):
    """Two real torchrun runs (gloo) of the vocab-parallel layout: report, plot and verdict."""
    out = tmp_path / "report"
    result = run([*LAYOUTS, "--nproc", "2", "--layouts", "tp2_vocab", "--steps", "4",
                  "--warmup-steps", "1", "--log-freq", "1", "--out", str(out),
                  "--runs-dir", str(tmp_path / "runs"),
                  "--extra=--training.device cpu --training.seq_len 64 "
                  "--training.local_batch_size 2 --lr_scheduler.warmup_steps 2 "
                  "--validation.enable false"],
                 env={"OMP_NUM_THREADS": "1", "FLCE_GIT_REVISION": "0a1b2c3"})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    assert [(r["layout"], r["loss"], r["status"]) for r in report["runs"]] == [
        ("tp2_vocab", "flce", "ok"), ("tp2_vocab", "unfused", "ok")]
    for r in report["runs"]:
        assert r["final_step"] == 4 and r["tokens_per_second"] > 0 and r["final_loss"] > 0
    [comparison] = report["comparisons"]
    assert comparison["exit_code"] == 0 and comparison["verdict"].startswith("PASS")
    assert (tmp_path / "report_tp2_vocab.png").stat().st_size > 0
    md = out.with_suffix(".md").read_text()
    assert "| tp2_vocab | flce | ok |" in md and "- **tp2_vocab**: PASS" in md
    assert md.splitlines()[0].endswith(" · git 0a1b2c3") and report["meta"]["dirty"] is False


@pytest.mark.slow
def test_loss_parallel_benchmark_on_two_cpu_processes(tmp_path):
    """Both modes run through torchrun (gloo) and compute the same loss."""
    out = tmp_path / "lp"
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node", "2", "-m", "scripts.bench.loss_parallel",
                  "--shapes", "64x16x37,90x24x101", "--warmup", "1", "--reps", "2",
                  "--modes", "sequence,vocab,vocab_unfused", "--out", str(out),
                  "--device", "cpu"],
                 env={"OMP_NUM_THREADS": "1", "FLCE_GIT_REVISION": "0a1b2c3+dirty"})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["results"]
    assert report["meta"]["git"] == "0a1b2c3+dirty" and report["meta"]["dirty"] is True
    assert report["meta"]["command"].startswith(
        "torchrun --nproc_per_node 2 -m scripts.bench.loss_parallel --shapes")
    md = out.with_suffix(".md").read_text()
    assert md.startswith("**DIRTY TREE: not reproducible from a commit** (git 0a1b2c3+dirty")
    assert [(r["shape"], r["mode"]) for r in rows] == [
        (shape, mode) for shape in ("64x16x37", "90x24x101")
        for mode in ("sequence", "vocab", "vocab_unfused")]
    for a, b, c in zip(rows[::3], rows[1::3], rows[2::3]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) and a["ms"] > 0
        assert math.isclose(a["loss"], c["loss"], rel_tol=1e-5)
    assert "| 90x24x101 |" in md
