"""[comm] trace_buf_size, save_traces_folder, save_traces_file_prefix (torchtitan v0.2's keys):
they load, bad values are named, and the trainer's process setup turns NCCL's flight recorder on
as torchtitan's init_distributed does: the environment variables set before the process group
is created, the folder made once the run holds its dump folder, nothing of it on a CPU (gloo) run.

NCCL's process group is not started here (CPU only): CUDA's availability and init_process_group
are replaced, the latter by a stand-in that records what the process group would have read."""

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import train
from components import process
from components.config.parse import load_config
from components.config.schema import Comm, ConfigError
from components.config.toml_out import to_toml
from components.lock import LOCK_FILE, DumpFolderInUse, FolderNotWritable, acquire, release
from ports import free_port
from test_lock import ARGS

CPU_RUN = [*ARGS, "--training.steps", "1", "--checkpoint.enable_checkpoint", "false"]

RECORDER_ENV = ["TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING"]


@pytest.fixture
def clean_env(monkeypatch):
    """No flight recorder variable set; whatever the code under test sets is undone after."""
    for name in [*RECORDER_ENV, "RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTORCH_ALLOC_CONF"]:
        monkeypatch.delenv(name, raising=False)


class _Created(Exception):
    """Raised by the stand-in for init_process_group once it has recorded what it saw."""


@pytest.fixture
def nccl(monkeypatch, clean_env):
    """A CUDA machine as far as components/process.py sees; init_process_group records the
    backend, the recorder's environment variables and whether the traces folder exists (not yet:
    it is made once the run holds its dump folder)."""
    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(backend=backend, env={name: os.environ.get(name) for name in RECORDER_ENV})
        temp_file = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
        seen["folder exists"] = temp_file is not None and os.path.isdir(os.path.dirname(temp_file))
        raise _Created

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    return seen


# ---- the keys ---------------------------------------------------------------------------------

def test_the_keys_load_with_torchtitans_defaults(tmp_path):
    assert (Comm().trace_buf_size, Comm().save_traces_folder,
            Comm().save_traces_file_prefix) == (20000, "comm_traces", "rank_")
    path = tmp_path / "torchtitan.toml"  # a torchtitan v0.2 config's [comm] table
    path.write_text('[comm]\ninit_timeout_seconds = 300\ntrain_timeout_seconds = 100\n'
                    'trace_buf_size = 5000\nsave_traces_folder = "fr"\n'
                    'save_traces_file_prefix = "trace_"\n')
    comm = load_config(["--config", str(path)]).comm
    assert (comm.trace_buf_size, comm.save_traces_folder, comm.save_traces_file_prefix) == (
        5000, "fr", "trace_")
    cfg = load_config(["--config", str(path), "--comm.trace_buf_size", "0",
                       "--comm.save_traces_folder", "/shared/fr",
                       "--comm.save_traces_file_prefix=r"])
    assert (cfg.comm.trace_buf_size, cfg.comm.save_traces_folder,
            cfg.comm.save_traces_file_prefix) == (0, "/shared/fr", "r")
    assert ('trace_buf_size = 0\nsave_traces_folder = "/shared/fr"\nsave_traces_file_prefix = "r"\n'
            in to_toml(cfg))


@pytest.mark.parametrize("argv,match", [
    (["--comm.trace_buf_size", "-1"],
     r"^\[comm\] trace_buf_size = -1: must be >= 0 \(0: no flight recorder\)$"),
    (["--comm.trace_buf_size", "big"], r"\[comm\] trace_buf_size: expected int"),
    (["--comm.save_traces_file_prefix", "traces/rank_"],
     r"^\[comm\] save_traces_file_prefix = 'traces/rank_': a file name's start, without '/'"),
    (["--comm.trace_buffer_size", "10"],
     r"unknown config key \[comm\] trace_buffer_size \(did you mean 'trace_buf_size'\?\)"),
])
def test_a_bad_value_is_named(argv, match):
    with pytest.raises(ConfigError, match=match):
        load_config(argv)


# ---- the process setup ------------------------------------------------------------------------

@pytest.mark.parametrize("launched", [True, False], ids=["torchrun", "one process"])
def test_nccl_gets_the_recorder_before_its_process_group_is_created(nccl, monkeypatch, tmp_path,
                                                                    launched):
    if launched:
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("LOCAL_RANK", "1")
    dump = tmp_path / "run"
    with pytest.raises(_Created), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing the user set is replaced
        with process.process_group("auto", Comm(trace_buf_size=500), str(dump)):
            pass
    assert nccl == {"backend": "nccl", "folder exists": False, "env": {
        "TORCH_FR_BUFFER_SIZE": "500", "TORCH_NCCL_TRACE_BUFFER_SIZE": None,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": f"{dump}/comm_traces/rank_",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": None, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}}


def test_the_trainer_puts_the_traces_in_its_dump_folder(nccl, tmp_path):
    dump = tmp_path / "run"
    with pytest.raises(_Created):
        train.main(["--job.dump_folder", str(dump), "--comm.save_traces_folder", "fr",
                    "--comm.save_traces_file_prefix", "r"])
    assert nccl["env"]["TORCH_FR_DUMP_TEMP_FILE"] == f"{dump}/fr/r"


@pytest.fixture
def folder_as_on_cuda(monkeypatch, clean_env):
    """train.main's call of make_traces_folder, with the device taken as CUDA's (a CPU run has
    no recorder, hence no folder): when in the run the folder is made. [] until it is; then
    whether this process held the dump folder's lock at that moment."""
    held = []

    def on_cuda(comm, dump_folder, device):
        held.append(str(os.getpid()) in (Path(dump_folder) / LOCK_FILE).read_text())
        process.make_traces_folder(comm, dump_folder, torch.device("cuda", 0))

    monkeypatch.setattr(train, "make_traces_folder", on_cuda)
    return held


def test_the_trainer_makes_the_folder_once_it_holds_the_dump_folder(folder_as_on_cuda, tmp_path):
    dump = tmp_path / "run"
    assert train.main([*CPU_RUN, "--job.dump_folder", str(dump), "--comm.save_traces_folder",
                       "fr"]) == 0
    assert folder_as_on_cuda == [True] and (dump / "fr").is_dir()


def test_a_run_refused_its_dump_folder_makes_no_traces_folder(folder_as_on_cuda, tmp_path):
    """The dump folder in use by another run: nothing of this one is left there."""
    dump = tmp_path / "run"
    other = acquire(dump)
    try:
        with pytest.raises(DumpFolderInUse):
            train.main([*CPU_RUN, "--job.dump_folder", str(dump)])
    finally:
        release(other)
    assert folder_as_on_cuda == [] and os.listdir(dump) == [LOCK_FILE]


def test_an_absolute_folder_stands_alone(nccl, tmp_path):
    """As torchtitan's os.path.join and [checkpoint] folder: not under the dump folder."""
    comm = Comm(save_traces_folder=str(tmp_path / "fr"))
    with pytest.raises(_Created):
        process.init_distributed("cuda", comm, str(tmp_path / "run"))
    assert nccl["env"]["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/fr/rank_"
    process.make_traces_folder(comm, str(tmp_path / "run"), torch.device("cuda", 0))
    assert (tmp_path / "fr").is_dir() and not (tmp_path / "run").exists()


def test_trace_buf_size_0_turns_the_recorder_off(nccl, tmp_path):
    """torch records 2000 collectives unless told 0; nothing else is set, no folder made."""
    with pytest.raises(_Created):
        process.init_distributed("cuda", Comm(trace_buf_size=0), str(tmp_path / "run"))
    assert nccl["env"] == {name: "0" if name == "TORCH_FR_BUFFER_SIZE" else None
                           for name in RECORDER_ENV}
    process.make_traces_folder(Comm(trace_buf_size=0), str(tmp_path / "run"),
                               torch.device("cuda", 0))
    assert not (tmp_path / "run").exists()


def test_a_variable_the_user_set_is_replaced_with_a_warning(nccl, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")  # torch's older name
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")  # the same value: no warning
    with pytest.raises(_Created), pytest.warns(UserWarning) as caught:
        process.init_distributed("cuda", Comm(), str(tmp_path))
    assert [str(w.message) for w in caught] == [
        "[comm] sets TORCH_FR_BUFFER_SIZE=20000, replacing the environment's "
        "TORCH_NCCL_TRACE_BUFFER_SIZE=100",
        "[comm] sets TORCH_NCCL_ASYNC_ERROR_HANDLING=3, replacing the environment's "
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"]
    assert nccl["env"]["TORCH_FR_BUFFER_SIZE"] == "20000"


def test_a_folder_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "run").write_text("a file where the dump folder goes")
    with pytest.raises(FolderNotWritable, match=r"^\[comm\] save_traces_folder .*run/comm_traces "
                       r"cannot be created \(Not a directory\): set another"):
        process.make_traces_folder(Comm(), str(tmp_path / "run"), torch.device("cuda", 0))


@pytest.mark.parametrize("launched", [True, False], ids=["gloo", "no process group"])
def test_a_cpu_run_sets_nothing_and_makes_no_folder(clean_env, monkeypatch, tmp_path, launched):
    """gloo reads none of it and writes no record: no empty comm_traces folder in every run."""
    if launched:
        for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(free_port())).items():
            monkeypatch.setenv(name, value)
    with process.process_group("cpu", Comm(), str(tmp_path)):
        assert dist.is_initialized() == launched
        assert [name for name in RECORDER_ENV if name in os.environ] == []
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_cuda_two_gpus_a_timeout_leaves_the_ranks_records(tmp_path):
    """NCCL's watchdog ends rank 0 once rank 1 has stalled past the train timeout, and rank 0's
    flight recorder record is in <dump_folder>/comm_traces/ (torch writes it, not the trainer)."""
    from test_comm_timeouts import run_with_a_stalled_rank
    code, waited, output = run_with_a_stalled_rank(tmp_path, "--training.device", "cuda")
    assert code != 0, output[-3000:]
    assert waited < 150, waited
    record = tmp_path / "run" / "comm_traces" / "rank_0"
    assert record.is_file() and record.stat().st_size > 0, (
        sorted(p.name for p in (tmp_path / "run").rglob("*")), output[-3000:])
