"""The torchrun and SLURM launch scripts: run_train.sh, torchrun_cmd.sh, train.sbatch."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_script_conventions import REPO, run

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
    ("2", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2"])])
def test_run_train_command(ngpu, expect):
    result = run(["scripts/run_train.sh", "--training.steps", "5"],
                 env={"NGPU": ngpu, "DRY_RUN": "1", "PYTHON": sys.executable,
                      "CONFIG": "configs/debug.toml"})
    argv = shlex.split(result.stdout)
    assert result.returncode == 0, result.stderr
    assert argv[:len(expect)] == expect
    assert argv[-4:] == ["--config", "configs/debug.toml", "--training.steps", "5"]


@pytest.mark.slow
def test_two_trainers_run_under_the_python_named_by_python(tmp_path):
    """PYTHON picks the interpreter, the header says: with NGPU > 1 the script ran whatever
    torchrun was first on PATH (another environment's, or none: "exec: torchrun: not found",
    exit 127, where NGPU=1 worked)."""
    no_torchrun = tmp_path / "bin"  # a PATH with the system's tools but no torchrun
    no_torchrun.mkdir()
    dump = tmp_path / "run"
    result = run(["scripts/run_train.sh", *SHORT, "--training.steps", "2", "--loss.impl",
                  "unfused", "--data.synthetic", "true", "--training.local_batch_size", "2",
                  "--job.dump_folder", str(dump)],
                 env={"NGPU": "2", "PYTHON": sys.executable, "CONFIG": "configs/debug.toml",
                      "OMP_NUM_THREADS": "1", "PATH": f"{no_torchrun}:/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert len((dump / "metrics.jsonl").read_text().splitlines()) >= 2


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
