"""`run`: subprocess.run for a `torch.distributed.run --standalone --nproc_per_node N train.py
...` command, whose ranks are forked from a "zygote" that has imported torch already.

CI's 2 cores spent most of the multi-rank tests starting interpreters: a torchrun launch of k
ranks is k + 1 of them, each importing torch (~1.7 s of CPU) and torch.distributed.tensor, DCP
and sympy (~1 s more). The zygote, one per pytest process, imports them once and forks the ranks.
For tests about what the ranks compute (layouts, checkpoints across layouts), not the launcher:
signals, exit codes, faults and timeouts stay on real torchrun. Real torchrun runs instead on a
GPU machine, with FLCE_TEST_REAL_TORCHRUN=1, and where the command or environment differs from
what a zygote can reproduce (see `_forkable`)."""

import atexit
import faulthandler
import io
import os
import pickle
import random
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

TORCHRUN = ["-m", "torch.distributed.run", "--standalone"]
# Read when an interpreter starts or torch and numpy load: the zygote's values are the ranks'
# then, so a request whose values differ gets a zygote of its own (an in-process train.main
# leaves TORCH_FR_*, CUBLAS_WORKSPACE_CONFIG, ... in the test process's environment).
AT_IMPORT = ("PYTHON", "TORCH", "PYTORCH", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS",
             "CUDA", "NCCL", "GLOO", "TRITON", "NUMPY")
# Set per rank: -u (torchrun's) and faulthandler, which a rank switches on itself.
PER_RANK = {"PYTHONUNBUFFERED", "PYTHONFAULTHANDLER"}
# Every zygote's: OpenBLAS sizes its thread pool by it when numpy loads, and a fork must not
# copy a pool. torchrun's default for several ranks, and what the tests give theirs; a request
# with another value runs on real torchrun.
ZYGOTE_ENV = {"OMP_NUM_THREADS": "1"}
GRACE_S = 30  # torchrun's: SIGTERM to the other ranks once one failed, SIGKILL this much later

_zygote: tuple[subprocess.Popen, dict] | None = None


def _import_sensitive(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(AT_IMPORT) and k not in PER_RANK}


def torch_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _with_torchrun_defaults(nproc: int, env: dict) -> dict:
    """env with torchrun's OMP_NUM_THREADS=1 for several ranks, where env sets none."""
    return {"OMP_NUM_THREADS": "1", **env} if nproc > 1 else env


def _forkable(command: list, env: dict) -> bool:
    if torch_cuda() or os.environ.get("FLCE_TEST_REAL_TORCHRUN") == "1":
        return False
    if len(command) < 7 or command[1:4] != TORCHRUN:
        return False
    if command[4] not in ("--nproc_per_node", "--nproc-per-node") or not command[5].isdigit():
        return False
    if not command[6].endswith(".py") or command[6].startswith("-"):
        return False
    env = _with_torchrun_defaults(int(command[5]), env)
    return all(env.get(k) == v for k, v in ZYGOTE_ENV.items())


def _server(env: dict) -> subprocess.Popen:
    """The zygote for a request's environment: the running one where the variables read at
    import are the same, else a new one started with the request's."""
    global _zygote
    if _zygote is not None and (_zygote[0].poll() is not None
                                or _import_sensitive(_zygote[1]) != _import_sensitive(env)):
        _stop(_zygote[0])
        _zygote = None
    if _zygote is None:
        # a fresh interpreter, not a fork of this one: pytest-xdist's execnet runs threads here
        env = {k: v for k, v in env.items() if k not in PER_RANK}
        proc = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        _zygote = proc, env
        atexit.register(_stop, proc)
    return _zygote[0]


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()  # its EOF ends the zygote
    proc.stdout.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def run(command: list, *, cwd=None, env=None, timeout=None, check=False, capture_output=False,
        stdout=None, stderr=None, text=False) -> subprocess.CompletedProcess:
    """subprocess.run(command, ...) of a torchrun command, the ranks forked (see the module)."""
    assert stderr != subprocess.STDOUT, "not kept apart from stdout here"
    env = dict(os.environ if env is None else env)
    if not _forkable(command, env):
        return subprocess.run(command, cwd=cwd, env=env, timeout=timeout, check=check, text=text,
                              capture_output=capture_output, stdout=stdout, stderr=stderr)
    nproc, script, args = int(command[5]), command[6], command[7:]
    env = _with_torchrun_defaults(nproc, env)
    from ports import free_port
    with tempfile.TemporaryDirectory(prefix="forked-ranks-") as logs:
        request = dict(script=os.path.abspath(os.path.join(cwd or ".", script)), args=args,
                       env=env, cwd=os.path.abspath(cwd or "."), nproc=nproc, logs=logs,
                       port=free_port(), timeout=timeout or 24 * 3600)
        zygote = _server(env)
        try:
            pickle.dump(request, zygote.stdin)
            zygote.stdin.flush()
            # the zygote keeps the timeout; this is for a zygote that hangs or died
            if not select.select([zygote.stdout], [], [], request["timeout"] + 60)[0]:
                raise RuntimeError("forked_ranks: the zygote did not answer")
            codes, first, timed_out = pickle.load(zygote.stdout)
        except BaseException:  # its answer would be read as the next request's: a new zygote
            global _zygote
            zygote.kill()
            _stop(zygote)
            _zygote = None
            raise
        out, err = ("".join(Path(logs, f"{r}.{s}").read_text(errors="backslashreplace")
                            for r in range(nproc)) for s in ("out", "err"))
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, out, err)
    if first is not None:  # torchrun's report of the first failure
        err += "".join(f"  rank      : {r} (local_rank: {r})\n  exitcode  : {codes[r]}"
                       + (f" (Signal {-codes[r]} ({signal.Signals(-codes[r]).name}))"
                          if codes[r] < 0 else "") + "\n"
                       for r in [first] + [r for r, c in enumerate(codes) if c and r != first])
    returncode = 0 if first is None else 1  # torchrun's status when a rank failed
    if not (capture_output or stdout == subprocess.PIPE):
        if stdout != subprocess.DEVNULL:
            sys.stdout.write(out)
        out = None
    if not (capture_output or stderr == subprocess.PIPE):
        if stderr != subprocess.DEVNULL:
            sys.stderr.write(err)
        err = None
    if not text:
        out, err = (s.encode() if s is not None else None for s in (out, err))
    done = subprocess.CompletedProcess(command, returncode, out, err)
    if check:
        done.check_returncode()
    return done


# --- the zygote ----------------------------------------------------------------------------------

def _rank(request: dict, rank: int) -> None:
    """In a forked child: become rank `rank` of torchrun's launch, run the script, exit."""
    code = 1
    try:
        os.setsid()  # as torchrun starts a rank: its group is killed with it
        os.environ.clear()
        os.environ.update(request["env"])
        n = request["nproc"]
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
            ROLE_NAME="default", LOCAL_WORLD_SIZE=str(n), WORLD_SIZE=str(n),
            GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(request["port"]), TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=request["run_id"],
            # no agent holds a store here: rank 0 hosts it, as without torchrun
            TORCHELASTIC_USE_AGENT_STORE="False",
            TORCH_NCCL_ASYNC_ERROR_HANDLING=request["env"].get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
        # fds 0 and 1 were the zygote's requests and answers: the rank must not touch them
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, "out"), (2, "err")):
            path = os.path.join(request["logs"], f"{rank}.{name}")
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        # torchrun runs `python -u script`: unbuffered text streams
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding, write_through=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding,
            errors="backslashreplace", write_through=True)
        if os.environ.get("PYTHONFAULTHANDLER"):
            faulthandler.enable()
        import numpy as np
        import torch
        random.seed()  # a fresh interpreter seeds these from the OS, not from the zygote's state
        np.random.seed()
        if "OMP_NUM_THREADS" in os.environ:
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        os.chdir(request["cwd"])
        sys.argv = [request["script"], *request["args"]]
        sys.path[0] = os.path.dirname(request["script"])  # as `python script` has it
        try:
            runpy.run_path(request["script"], run_name="__main__")
            code = 0
        except SystemExit as e:  # as the interpreter reads it: None is 0, a message is 1
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        # what an interpreter does when it ends: wait for non-daemon threads, run atexit
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _launch(request: dict) -> tuple[list, int | None, bool]:
    request["run_id"] = str(uuid.uuid4())
    ranks = {}
    for rank in range(request["nproc"]):
        # a fork copies only the calling thread: another one's locks would stay held in the child
        # (native threads too: OpenBLAS starts a pool unless OMP_NUM_THREADS=1 when it loads)
        assert threading.active_count() == 1, threading.enumerate()
        assert len(os.listdir("/proc/self/task")) == 1, "a native thread runs in the zygote"
        pid = os.fork()
        if pid == 0:
            _rank(request, rank)
        ranks[pid] = rank
    codes = [None] * request["nproc"]
    first, termed, timed_out = None, None, False
    deadline = time.monotonic() + request["timeout"]

    def signal_all(sig):
        for pid, rank in ranks.items():
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    while None in codes:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[ranks[pid]] = os.waitstatus_to_exitcode(status)
            if codes[ranks[pid]] != 0 and first is None:
                first = ranks[pid]
            continue
        now = time.monotonic()
        if now > deadline and not timed_out:
            timed_out = True
            signal_all(signal.SIGKILL)
        elif first is not None and termed is None:
            termed = now
            signal_all(signal.SIGTERM)
        elif termed is not None and now > termed + GRACE_S:
            signal_all(signal.SIGKILL)
        time.sleep(0.05)
    return codes, first, timed_out


def serve() -> None:
    # What every rank imports, and nothing of the repository's: its modules may read the
    # environment at import, and that must be the test's. No torch op runs here.
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        pickle.dump(_launch(request), answers)
        answers.flush()


if __name__ == "__main__":
    serve()
