"""scripts/slurm/train.sbatch on a real one-node SLURM cluster: Debian's munged, slurmctld and
slurmd, started here as root with their own key, sockets, ports and state in a temporary folder
(.ci/run installs them; without them, or without root, this file skips).

The time limit's warning signal (sbatch --signal=B:USR1@5, the path a real job takes) makes the
trainer checkpoint and stop, the batch script `scontrol requeue`s the job, and the requeued job
resumes from that checkpoint; a `scancel` then stops it without a requeue. The losses of every
step equal those of an uninterrupted run of the same layout. The job runs two trainers on the
node (torchrun, gloo) and first gets a preemption (USR1 to the batch shell) while its trainers
are still starting: they stop after step 1 with a checkpoint and exit 0, the job is requeued
and resumes from it. (A one-trainer job took the same path through the batch script, and cost
CI another of SLURM's minute-long time limits.)

slurmctld looks at time limits every 30 s and sends the warning at the first look within
(lead time + 30 s) of the limit, so with SLURM's shortest limit, a minute, it may come before the
trainer has set up its signal handler (on a loaded machine). The job is therefore submitted with
a limit of 10 minutes, shortened with `scontrol update` once it trains to leave 40 s (up to 100 s
when the job was slow to start): the signal comes 5-35 s (up to 95 s) later. A requeued job
starts again after AuthInfo's cred_expire (5 s here, 120 by default)."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
MISSING = [name for name in DAEMONS + COMMANDS if shutil.which(name, path=SBIN) is None]
pytestmark = [pytest.mark.skipif(
    bool(MISSING) or os.geteuid() != 0,
    reason=f"SLURM is not installed ({', '.join(MISSING)} missing; .ci/run installs it)"
    if MISSING else "starting SLURM's daemons needs root"),
    pytest.mark.slow]  # a cluster and multi-process runs: not in the fast subset

# A constant learning rate after warmup (min_lr_factor 1): the schedule does not depend on
# --training.steps, so a run stopped at step m is comparable with one of m steps.
TRAIN = ["--training.device", "cpu", "--training.seq_len", "32", "--training.local_batch_size",
         "2", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.min_lr_factor", "1.0",
         "--metrics.log_freq", "1", "--job.print_config", "false", "--validation.enable",
         "false", "--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "100000"]


def losses(dump: Path) -> dict[int, float]:
    """{step: loss}, the last line of a repeated step winning; {} before the first line. A line
    being written (no newline yet) is left for the next look."""
    path = dump / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    rows = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def slurm_conf(folder: Path, node: str) -> str:
    return f"""ClusterName=ci
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.socket,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
ReturnToService=2
JobRequeue=1
KillWait=10
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def wait_for(condition, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def cluster():
    """A running one-node cluster; yields the environment its commands need (SLURM_CONF)."""
    # Not under pytest's tmp_path: munged wants every folder above its socket searchable by all.
    folder = Path(tempfile.mkdtemp(prefix="flce-slurm-"))
    folder.chmod(0o755)
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node = "localhost"
    (folder / "slurm.conf").write_text(slurm_conf(folder, node))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_CONF=str(folder / "slurm.conf"), PATH=SBIN)
    daemons = []

    def start(name, *args):
        log = open(folder / f"{name}.out", "w")
        daemons.append(subprocess.Popen([shutil.which(name, path=SBIN), *args], env=env,
                                        stdout=log, stderr=subprocess.STDOUT))

    try:
        start("munged", "--foreground", f"--socket={folder}/munge.socket",
              f"--key-file={key}", f"--log-file={folder}/munged.log",
              f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munged.seed")
        wait_for(lambda: (folder / "munge.socket").exists(), 10, "munged")
        start("slurmctld", "-D", "-f", env["SLURM_CONF"])
        start("slurmd", "-D", "-f", env["SLURM_CONF"], "-N", node)

        def idle():
            for daemon in daemons:
                assert daemon.poll() is None, (daemon.args, log_tail(folder))
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, text=True,
                                 capture_output=True).stdout
            return out.strip() == "idle"
        wait_for(idle, 60, "the node to be idle in sinfo")
        yield env
    finally:
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True)
        try:
            wait_for(lambda: not subprocess.run(["squeue", "-h"], env=env, text=True,
                                                capture_output=True).stdout.strip(), 30,
                     "the queue to empty")
        except AssertionError:
            pass
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(folder, ignore_errors=True)


def log_tail(folder: Path) -> str:
    return "\n".join(f"--- {p.name}:\n" + p.read_text()[-2000:]
                     for p in sorted(folder.glob("*.log")) + sorted(folder.glob("*.out")))


def job_field(env, job: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, text=True,
                         capture_output=True).stdout
    match = re.search(rf"\b{field}=(\S+)", out)
    return match[1] if match else ""


def test_time_limit_signal_checkpoints_requeues_and_resumes(cluster, tmp_path):
    shim = tmp_path / "bin" / "torchrun"  # this interpreter's torchrun, whatever PATH holds
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
    shim.chmod(0o755)
    # sbatch passes its environment on to the job.
    env = {**cluster, "PATH": f"{shim.parent}{os.pathsep}{cluster['PATH']}",
           "OMP_NUM_THREADS": "1", "CONFIG": "configs/debug.toml",
           "GPUS_PER_NODE": "2", "LOG_ROOT": str(tmp_path / "logs")}
    dump, reference = tmp_path / "run", tmp_path / "reference"
    got = job_runs(env, tmp_path, dump)
    # Two gloo ranks add up in another order than one process: after a hundred steps the losses
    # part by more than 1e-5. The reference is a run of the same two ranks, after the job
    # (beside it, four trainers would share 2 CPU cores).
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", "2", "train.py", "--config", "configs/debug.toml", *TRAIN,
                    "--checkpoint.enable_checkpoint", "false", "--job.dump_folder", str(reference),
                    "--training.steps", str(max(got))],
                   cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True,
                   timeout=600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    want = losses(reference)
    differ = {s: (got[s], want[s]) for s in got if abs(got[s] - want[s]) > 1e-5}
    assert not differ, f"steps whose loss differs from the uninterrupted run's: {differ}"


def trainer_pids(dump: Path) -> list[int]:
    """The trainers of the job writing `dump`, started or starting."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"train.py") for a in argv) and str(dump).encode() in argv \
                and not any(a.endswith(b"torch.distributed.run") for a in argv):
            found.append(int(cmdline.parent.name))
    return found


def catches_usr1(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt")).split()[1], 16)
    return bool(caught >> (signal.SIGUSR1 - 1) & 1)


def job_runs(env, tmp_path: Path, dump: Path) -> dict[int, float]:
    """The job's losses by step, every step from 1 once."""
    start = time.monotonic()
    submit = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--time=10",
         "--signal=B:USR1@5", f"--output={tmp_path}/%x-%j.out", "scripts/slurm/train.sbatch",
         *TRAIN, "--training.steps", "100000", "--job.dump_folder", str(dump)],
        cwd=ROOT, env=env, text=True, capture_output=True)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    batch_log = tmp_path / f"flce-train-{job}.out"
    node_log = tmp_path / "logs" / f"flce-train-{job}" / "node-0.out"
    read = lambda path: path.read_text() if path.exists() else ""

    def diagnose():
        return (f"\n--- batch log:\n{read(batch_log)[-3000:]}\n--- node log:\n"
                f"{read(node_log)[-3000:]}")

    def wait_or_diagnose(condition, timeout: float, what: str, **kw):
        try:
            return wait_for(condition, timeout, what, **kw)
        except AssertionError as e:
            raise AssertionError(f"{e}{diagnose()}") from None

    # 0. A preemption while the trainers are still importing torch (they are up, nothing
    # trained yet): the USR1 is kept, they stop after step 1 with a checkpoint and exit 0
    # (a USR1 then was ignored, inherited from torchrun, and lost), and the job is requeued.
    pids = wait_or_diagnose(lambda: len(trainer_pids(dump)) == 2 and trainer_pids(dump), 150,
                            "the two trainers to start", poll=0.05)
    # train.py catches USR1 from its first lines on (the old one, which inherited torchrun's
    # ignored USR1, only after its imports, about 3 s); the first 0.1 s of Python's own
    # start-up are not covered.
    started = time.monotonic()
    while not all(map(catches_usr1, pids)) and time.monotonic() < started + 1:
        time.sleep(0.01)
    assert not losses(dump)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True)
    wait_or_diagnose(lambda: "requeueing job" in read(batch_log), 150, "the requeue")
    assert "srun exited with 0 after SIGUSR1" in read(batch_log), diagnose()
    assert "received SIGUSR1: stopped after step 1," in read(node_log), diagnose()
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-1"]
    restarts = 1  # the requeues so far
    wait_or_diagnose(lambda: max(losses(dump), default=0) >= 3, 150, "the requeued job to train")
    assert re.search(r"resumed from \S*step-1\b", read(node_log)), diagnose()
    print(f"{time.monotonic() - start:.0f} s: USR1 at start-up, checkpoint, requeue, resumed")

    # 1. The time limit's USR1: checkpoint, stop, requeue.
    wait_or_diagnose(lambda: losses(dump), 150, "the job to train")
    def run_seconds():
        hms = job_field(env, job, "RunTime").split("-")[-1].split(":")
        return sum(int(x) * 60 ** i for i, x in enumerate(reversed(hms)))
    # A limit 35-95 s away (not less: the warning must come at a look before the limit's), about
    # 40 s when the job trains within 20 s of its start, as on an idle machine.
    time.sleep(max(0, 20 - run_seconds()))
    minutes = math.ceil((run_seconds() + 35) / 60)
    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}"], env=env,
                   check=True)
    wait_or_diagnose(lambda: read(batch_log).count("requeueing job") > restarts, 150,
                     "the USR1 and the requeue")
    print(f"{time.monotonic() - start:.0f} s: USR1, checkpoint, requeue")
    # The requeued run gets a longer limit, so that its own warning signal cannot come first.
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=10"], env=env, check=True)
    stopped = re.findall(r"received SIGUSR1: stopped after step (\d+)", read(node_log))
    assert len(stopped) == restarts + 1, f"the trainer did not checkpoint on USR1{diagnose()}"
    k = int(stopped[-1])
    assert f"step-{k}" in [p.name for p in (dump / "checkpoint").iterdir()]

    # 2. The requeued job resumes from that checkpoint.
    wait_or_diagnose(lambda: max(losses(dump)) >= k + 3, 120, "the requeued job to train on")
    assert re.search(rf"resumed from \S*step-{k}\b", read(node_log)), diagnose()
    assert f"restart {restarts + 1}:" in read(batch_log)
    print(f"{time.monotonic() - start:.0f} s: resumed")

    # 3. scancel (SIGTERM) stops it for good: no requeue.
    subprocess.run(["scancel", job], env=env, check=True)
    wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", job], env=env, text=True,
                                        capture_output=True).stdout.strip(), 60,
             "the cancelled job to end")
    assert job_field(env, job, "JobState") == "CANCELLED"
    assert job_field(env, job, "Restarts") == str(restarts + 1), diagnose()
    assert read(batch_log).count("SIGUSR1: asking the trainers") == restarts + 1

    print(f"{time.monotonic() - start:.0f} s: cancelled")
    got = losses(dump)
    assert sorted(got) == list(range(1, max(got) + 1))
    return got
