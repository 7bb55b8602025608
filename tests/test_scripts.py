"""The launch and analysis scripts: shell syntax, the per-node torchrun command from fake SLURM
variables, the batch script's signal -> requeue logic (fake srun/scontrol), compare_losses.py on
synthetic metrics, and short real CPU runs through compare_fused_vs_unfused.sh."""

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
SHELL_SCRIPTS = sorted([*SCRIPTS.rglob("*.sh"), *SCRIPTS.rglob("*.sbatch")])
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


def run(cmd, env=None, **kwargs):
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, text=True,
                          capture_output=True, timeout=120, **kwargs)


# ---- shell syntax ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["run_train.sh", "compare_fused_vs_unfused.sh",
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
        assert "--signals-to-handle" not in argv  # SIGUSR1 must not reach torchrun's handler
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


def test_torchrun_command_needs_slurm_variables():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["scripts/slurm/torchrun_cmd.sh", "--dry-run"], cwd=REPO, env=env,
                            text=True, capture_output=True)
    assert result.returncode != 0 and "SLURM_JOB_NODELIST" in result.stderr


def test_signal_options_follow_the_installed_torchrun():
    installed = run(["torchrun", "--help"]).stdout
    argv = torchrun_argv(slurm_env(0), torchrun_help=None)
    assert "--signals-to-handle" not in argv
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
    result = compare(a, b, "--seed-run", seed, "--tolerance", "0.05")
    assert result.returncode == 0, result.stdout + result.stderr  # seed differs by 0.1: not judged
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
    b = write_metrics(tmp_path / "b", lambda s: curve(s) + 1.0)  # a run that was resumed ...
    with open(b / "metrics.jsonl", "a") as f:  # ... and repeated every step correctly
        for step in range(1, 31):
            f.write(json.dumps({"step": step, "time": 1.0, "loss": curve(step)}) + "\n")
    assert compare(a, b).returncode == 0


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


# ---- the real thing, on the CPU --------------------------------------------------------------

@pytest.fixture(scope="module")
def fused_vs_unfused(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    result = run(["scripts/compare_fused_vs_unfused.sh", "configs/debug.toml", *SHORT],
                 env={"OUT_DIR": str(out), "PYTHON": sys.executable, "NGPU": "1"})
    return result, out


def test_fused_and_unfused_losses_agree(fused_vs_unfused):
    result, out = fused_vs_unfused
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASS" in result.stdout
    assert (out / "fused_vs_unfused.png").is_file()


def test_another_learning_rate_is_caught(fused_vs_unfused, tmp_path):
    _, out = fused_vs_unfused  # its flce run is this test's lr 3e-3 run
    other = tmp_path / "lr_1e-2"
    train = run([sys.executable, "train.py", "--config", "configs/debug.toml", *SHORT,
                 "--optimizer.lr", "1e-2", "--loss.impl", "flce", "--metrics.log_freq", "1",
                 "--job.dump_folder", str(other)])
    assert train.returncode == 0, train.stderr[-3000:]
    result = compare(out / "flce", other, "--tolerance", "0.02")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL" in result.stdout


# ---- compare_layouts.py ----------------------------------------------------------------------

LAYOUTS = [sys.executable, str(SCRIPTS / "compare_layouts.py"), "--config", "configs/debug.toml"]


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


def test_layouts_on_two_cpu_processes(tmp_path):
    """Two real torchrun runs (gloo) of the vocab-parallel layout: report, plot and verdict."""
    out = tmp_path / "report"
    result = run([*LAYOUTS, "--nproc", "2", "--layouts", "tp2_vocab", "--steps", "4",
                  "--warmup-steps", "1", "--log-freq", "1", "--out", str(out),
                  "--runs-dir", str(tmp_path / "runs"),
                  "--extra=--training.device cpu --training.seq_len 64 "
                  "--training.local_batch_size 2 --lr_scheduler.warmup_steps 2 "
                  "--validation.enable false"], env={"OMP_NUM_THREADS": "1"})
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


def test_loss_parallel_benchmark_on_two_cpu_processes(tmp_path):
    """Both modes run through torchrun (gloo) and compute the same loss."""
    out = tmp_path / "lp"
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node", "2", str(SCRIPTS / "bench_loss_parallel.py"),
                  "--shapes", "64x16x37,90x24x101", "--warmup", "1", "--reps", "2",
                  "--modes", "sequence,vocab,vocab_unfused", "--out", str(out)],
                 env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(r["shape"], r["mode"]) for r in rows] == [
        (shape, mode) for shape in ("64x16x37", "90x24x101")
        for mode in ("sequence", "vocab", "vocab_unfused")]
    for a, b, c in zip(rows[::3], rows[1::3], rows[2::3]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) and a["ms"] > 0
        assert math.isclose(a["loss"], c["loss"], rel_tol=1e-5)
    assert "| 90x24x101 |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("script", ["bench_flce.py", "bench_attention.py", "bench_step_floor.py"])
def test_gpu_benchmarks_import_and_parse_without_a_gpu(script):
    """They run only on a GPU; here, that their imports resolve and their options parse."""
    result = run([sys.executable, str(SCRIPTS / script), "--help"])
    assert result.returncode == 0 and "--out" in result.stdout, result.stdout + result.stderr
