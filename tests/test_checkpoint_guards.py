"""Checkpoint folders as found on disk: a damaged or unchecked initial_load_path, a lost
checksums.json, a `.metadata` pointing outside its folder, a symlinked step folder under
keep_latest_k, a checkpoint folder shared by two dump folders, a read-only dump folder, a planted
pickle as torch words its refusal."""

import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import train
from components import lock, safe_dcp
from components.checkpoint_manifest import find_damage
from components.config.parse import load_config, refusal_line
from components.config.schema import ConfigError
from test_checkpoint import BASE, losses


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run's checkpoint folder (step-2, step-4), copied by each test before it changes it."""
    dump = tmp_path_factory.mktemp("run")
    assert train.main(BASE + ["--training.steps", "4", "--checkpoint.interval", "2",
                              "--job.dump_folder", str(dump)]) == 0
    return dump / "checkpoint"


def _overwrite_middle(file: Path) -> None:
    with open(file, "r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(b"\x7f" * 64)


def _weights_only(tmp_path: Path, name: str, initial: Path) -> list:
    return BASE + ["--training.steps", "1", "--checkpoint.enable", "false",
                   "--checkpoint.initial_load_path", str(initial),
                   "--job.dump_folder", str(tmp_path / name)]


def test_initial_load_path_checks_the_checksums(tmp_path, run):
    """A damaged step folder given directly is refused naming the file; in a folder of step
    folders the latest intact one is loaded, with a warning (both loaded it: a NaN loss)."""
    folder = tmp_path / "checkpoint"
    shutil.copytree(run, folder)
    _overwrite_middle(folder / "step-4" / "__0_0.distcp")
    with pytest.raises(ValueError, match=rf"initial_load_path = {folder}/step-4: {folder}/step-4/"
                                         r"__0_0\.distcp does not match its checksum"):
        train.main(_weights_only(tmp_path, "direct", folder / "step-4"))
    with pytest.warns(UserWarning, match=rf"initial_load_path: not loading {folder}/step-4: "
                                         r".*__0_0\.distcp does not match its checksum"):
        assert train.main(_weights_only(tmp_path, "latest", folder)) == 0
    assert train.main(_weights_only(tmp_path, "step-2", run / "step-2")) == 0
    assert losses(tmp_path / "latest") == pytest.approx(losses(tmp_path / "step-2"), abs=1e-6)
    _overwrite_middle(folder / "step-2" / "__0_0.distcp")
    with pytest.raises(ValueError, match=rf"initial_load_path = {folder} holds no intact "
                                         r"checkpoint: .*step-4.*; .*step-2"):
        train.main(_weights_only(tmp_path, "none", folder))


def test_a_lost_checksums_json_of_a_current_checkpoint_is_damage(tmp_path, run):
    """train_state.json's tokenizer record came with checksums.json: without its manifest such a
    checkpoint is not taken for an older one and loaded unchecked; the resume falls back."""
    dump = tmp_path / "run"
    shutil.copytree(run, dump / "checkpoint")
    step_4 = dump / "checkpoint" / "step-4"
    (step_4 / "checksums.json").unlink()
    _overwrite_middle(step_4 / "__0_0.distcp")
    with pytest.warns(UserWarning, match=rf"not resuming from {step_4}: {step_4}/checksums\.json "
                                         r"is missing .*; falling back to step-2"):
        assert train.main(BASE + ["--training.steps", "4", "--job.dump_folder", str(dump)]) == 0
    assert sorted(losses(dump)) == [3, 4]
    older = tmp_path / "older"  # before checksums: no tokenizer record either; loads unchecked
    shutil.copytree(run / "step-2", older)
    (older / "checksums.json").unlink()
    (older / "train_state.json").write_text('{"step": 2, "tokens_seen": 0, "scheduler": {}}')
    assert find_damage(older) is None


@pytest.mark.parametrize("where", ["/etc/passwd", "../step-4/__0_0.distcp"])
def test_metadata_pointing_outside_its_folder_is_refused(tmp_path, run, where):
    """DCP joins storage paths to the folder as they are: .metadata could read any file."""
    step = tmp_path / "step-2"
    shutil.copytree(run / "step-2", step)
    metadata = safe_dcp.read_metadata(step)
    for info in metadata.storage_data.values():
        info.relative_path = where
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    refused = rf"{step}/\.metadata points tensor reads at '{where}', outside {step}: not loading"
    with pytest.raises(safe_dcp.UnsafeCheckpointError, match=refused):
        safe_dcp.read_metadata(step)
    with pytest.raises(safe_dcp.UnsafeCheckpointError, match=refused):
        safe_dcp.load({"model": {}}, step, no_dist=True)


def test_a_data_file_linked_outside_its_folder_or_a_manifest_path_is_refused(tmp_path, run):
    """A .distcp replaced by a symbolic link was read wherever it led; a checksums.json naming
    "../../x" had the check stat that file and tell its size. A step folder that is itself a
    link (moved and linked back) still loads."""
    step, elsewhere = tmp_path / "step-2", tmp_path / "elsewhere"
    shutil.copytree(run / "step-2", step)
    elsewhere.mkdir()
    data = next(step.glob("*.distcp"))
    shutil.move(data, elsewhere / data.name)
    data.symlink_to(elsewhere / data.name)
    with pytest.raises(safe_dcp.UnsafeCheckpointError,
                       match=rf"{data} is a symbolic link to {elsewhere / data.name}, outside"):
        safe_dcp.read_metadata(step)
    linked = tmp_path / "linked"
    linked.symlink_to(run / "step-2")
    safe_dcp.read_metadata(linked)
    manifest = tmp_path / "manifest"
    shutil.copytree(run / "step-2", manifest)
    listing = json.loads((manifest / "checksums.json").read_text())
    listing["files"]["../../../../etc/hostname"] = [1, "0"]
    (manifest / "checksums.json").write_text(json.dumps(listing))
    assert find_damage(manifest) == (f"{manifest}/checksums.json is damaged (it names "
                                     "'../../../../etc/hostname', not a file of this folder)")


def test_keep_latest_k_unlinks_a_symlinked_step_folder(tmp_path, run):
    """rmtree refuses a link (every later save crashed); what it points at is not the run's."""
    dump, kept = tmp_path / "run", tmp_path / "kept"
    shutil.copytree(run, dump / "checkpoint")
    shutil.move(dump / "checkpoint" / "step-2", kept / "step-2")
    (dump / "checkpoint" / "step-2").symlink_to(kept / "step-2")
    (dump / "checkpoint" / "step-1.pruned").symlink_to(kept)  # a prune killed mid-way
    assert train.main(BASE + ["--training.steps", "6", "--checkpoint.interval", "2",
                              "--checkpoint.keep_latest_k", "2",
                              "--job.dump_folder", str(dump)]) == 0
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-4", "step-6"]
    assert (kept / "step-2" / ".metadata").is_file()


@pytest.mark.parametrize("leftover", ["link", "file"])
def test_a_save_clears_a_linked_or_file_leftover_tmp(tmp_path, run, leftover):
    """rmtree(ignore_errors) left a symlinked or file step-<N>.tmp in place and the save failed;
    a link's target is not the run's to delete."""
    dump, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(run, dump / "checkpoint")
    outside.mkdir()
    (outside / "keep.txt").write_text("not the run's")
    tmp = dump / "checkpoint" / "step-6.tmp"
    tmp.symlink_to(outside) if leftover == "link" else tmp.write_text("stray")
    assert train.main(BASE + ["--training.steps", "6", "--checkpoint.interval", "2",
                              "--job.dump_folder", str(dump)]) == 0
    assert (dump / "checkpoint" / "step-6" / ".metadata").is_file()
    assert not tmp.exists() and not tmp.is_symlink()
    assert (outside / "keep.txt").read_text() == "not the run's"


def test_a_checkpoint_folder_outside_the_dump_folder_is_locked_too(tmp_path):
    """Two dump folders, one absolute [checkpoint] folder: the second run is refused (both ran,
    moving each other's committed steps aside). Inside the dump folder its lock suffices."""
    shared = tmp_path / "shared"
    with lock.dump_folder_lock(tmp_path / "a", 0, shared):
        with pytest.raises(lock.DumpFolderInUse, match=rf"checkpoint folder {shared} is in use by "
                                                       r"another run \(pid .*--checkpoint.folder$"):
            with lock.dump_folder_lock(tmp_path / "b", 0, shared):
                pass
        assert (tmp_path / "b" / lock.LOCK_FILE).read_text() == ""  # released on the refusal
    with lock.dump_folder_lock(tmp_path / "b", 0, "../shared"):
        pass
    with lock.dump_folder_lock(tmp_path / "c", 0, "checkpoint"):
        assert not (tmp_path / "c" / "checkpoint").exists()


def test_a_checkpoint_folder_in_a_live_runs_dump_folder_is_refused(tmp_path):
    """[checkpoint] folder naming another run's <dump>/checkpoint: that run locks its dump
    folder only, and this one would commit into its checkpoints while it runs. Once it ended,
    its checkpoints may be resumed from a new dump folder."""
    theirs = tmp_path / "a" / "checkpoint"
    with lock.dump_folder_lock(tmp_path / "a", 0, "checkpoint"):
        with pytest.raises(lock.DumpFolderInUse, match=rf"checkpoint folder {theirs} lies in the "
                                                       rf"dump folder {tmp_path / 'a'} of a run in "
                                                       r"progress \(pid \d+.*--checkpoint.folder$"):
            with lock.dump_folder_lock(tmp_path / "b", 0, theirs):
                pass
    with lock.dump_folder_lock(tmp_path / "b", 0, theirs):
        assert (tmp_path / "a" / lock.LOCK_FILE).read_text() == ""  # probed, not written


def test_a_checkpoint_folder_in_a_live_run_nested_in_this_dump_folder_is_refused(tmp_path):
    """Run A in <d>/a, run B in <d> with [checkpoint] folder a/checkpoint: inside B's own dump
    folder, so only B's lock was taken, and B resumed from A's live steps, pruned them
    (keep_latest_k) and crashed renaming onto a step A had committed. A live run's folder nested
    in this one's is refused; a run nested in another's dump folder, checkpoints apart, is not."""
    theirs = tmp_path / "a" / "checkpoint"
    with lock.dump_folder_lock(tmp_path / "a", 0, "checkpoint"):
        with pytest.raises(lock.DumpFolderInUse, match=rf"checkpoint folder {theirs} lies in the "
                                                       rf"dump folder {tmp_path / 'a'} of a run in "
                                                       r"progress \(pid \d+"):
            with lock.dump_folder_lock(tmp_path, 0, "a/checkpoint"):
                pass
        assert not (tmp_path / lock.LOCK_FILE).exists()  # refused before taking its own lock
        with lock.dump_folder_lock(tmp_path / "a" / "sweep", 0, "checkpoint"):
            pass
    with lock.dump_folder_lock(tmp_path, 0, "a/checkpoint"):  # A ended: its steps may be resumed
        pass


@pytest.mark.parametrize("where", ["dump", "checkpoints"])
def test_a_run_lock_that_is_a_symlink_is_refused_not_written_through(tmp_path, where):
    """A run.lock planted as a symbolic link (in a checkpoint folder from someone else, resumed
    from a new dump folder) had the holder's pid written into its target, then truncated: any
    file the user could write was emptied."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / ("run" if where == "dump" else "ckpt")
    folder.mkdir()
    (folder / lock.LOCK_FILE).symlink_to(victim)
    what = "dump folder" if where == "dump" else "checkpoint folder"
    with pytest.raises(lock.FolderNotWritable, match=rf"{what} {folder} holds run.lock as a "
                                                     r"symbolic link \(to .*victim.txt\): remove"):
        with lock.dump_folder_lock(tmp_path / "run", 0, tmp_path / "ckpt"):
            pass
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("folder", ["ckfile", "ckfile/inner"])
def test_a_checkpoint_folder_at_a_file_is_refused_before_training(tmp_path, folder):
    """[checkpoint] folder inside the dump folder at a path a file holds: the run trained until
    its first save, then died there with a NotADirectoryError traceback."""
    (tmp_path / "ckfile").write_text("the user's")
    with pytest.raises(lock.FolderNotWritable) as refused:
        with lock.dump_folder_lock(tmp_path, 0, folder):
            pass
    assert refusal_line(refused.value) == (
        f"error: checkpoint folder {tmp_path / folder} cannot be made: {tmp_path / 'ckfile'} is "
        "a file; set another --checkpoint.folder")
    assert (tmp_path / "ckfile").read_text() == "the user's"


def test_a_tilde_in_the_checkpoint_folder_is_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = Path(__file__).resolve().parents[1] / "configs" / "debug.toml"
    cfg = load_config(["--config", str(config), "--checkpoint.folder", "~/ckx"])
    assert cfg.checkpoint.folder == str(tmp_path / "ckx")


def test_a_dump_folder_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(lock.FolderNotWritable) as refused:
        lock.acquire(tmp_path / "file" / "run")
    assert refusal_line(refused.value).startswith(f"error: dump folder {tmp_path}/file/run cannot "
                                                  "be written (Not a directory")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(lock.os, "open", read_only)
    with pytest.raises(lock.FolderNotWritable, match=rf"dump folder {tmp_path} cannot be written "
                                                     r"\(Read-only file system: .*set another "
                                                     r"--job\.dump_folder$"):
        with lock.dump_folder_lock(tmp_path, 0):
            pass


class _Runs:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return self.func, (self.arg,)


@pytest.mark.parametrize("func", [os.system, Path.touch, print])
def test_torch_naming_a_global_is_told_from_damage(tmp_path, func):
    """torch 2.13 refuses os.system as "unsupported GLOBAL posix.system whose module posix is
    blocked": it was reported as a damaged file."""
    file = tmp_path / "planted.pt"
    torch.save({"data": _Runs(func, str(tmp_path / "ran"))}, file)
    with pytest.raises(pickle.UnpicklingError) as refused:
        torch.load(file, weights_only=True)
    assert safe_dcp.names_a_global(refused.value)
    assert not (tmp_path / "ran").exists()
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(Exception) as cut:
        torch.load(file, weights_only=True)
    assert not safe_dcp.names_a_global(cut.value)


@pytest.mark.parametrize("folder", ["metrics.jsonl", "config.toml", "run.lock", "tb",
                                    "tb/checkpoints"])
def test_a_checkpoint_folder_at_a_runs_own_file_or_in_tensorboards_is_refused(tmp_path, folder):
    """[checkpoint] folder at a file the run writes before its first save (metrics.jsonl,
    config.toml, run.lock) failed at that save, after every step before it (a NotADirectoryError
    traceback, exit 1); inside TensorBoard's folder "tb" it went aside with it when a later
    fresh run set an earlier run's outputs aside, and the run after that started again from step
    1 without a word. The profiling folders are refused for both too (test_profiling.py)."""
    with pytest.raises(ConfigError, match=r"\[checkpoint\] folder = .*: name another folder"):
        load_config(["--checkpoint.folder", folder, "--job.dump_folder", str(tmp_path / "run")])


@pytest.mark.parametrize("source", ["text", "shards"])
def test_resuming_a_checkpoint_of_real_data_as_synthetic_tokens_is_not_a_key_error(
        tmp_path, source):
    """A checkpoint of a text (or token-shard) source resumed with [data] synthetic = true: the
    synthetic stream's load_state_dict reads state["windows"] before checking the kind of state
    and dies with a bare KeyError: 'windows' traceback. The other kinds raise ValueError for a
    state of another kind of source, which the checkpoint loader turns into repositioning by step
    (or a warning). docs/checkpoints.md: "a position that does not fit the documents at all,
    after [data] source changed, is a one-line error"; docs/training.md: a data mistake "is one
    line on stderr and exit status 2"."""
    dump = tmp_path / "run"
    args = BASE + ["--checkpoint.interval", "2", "--job.dump_folder", str(dump),
                   "--training.seq_len", "32", "--training.local_batch_size", "2"]
    if source == "shards":
        from scripts.prepare_data import main as prepare
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n"
                                  for i in range(50)))
        prepare(["--source", str(corpus), "--tokenizer", "byte", "--out", str(tmp_path / "sh")])
        args += ["--data.source", str(tmp_path / "sh")]
    assert train.main(args + ["--training.steps", "2"]) == 0
    try:
        code = train.main(args + ["--training.steps", "4", "--data.synthetic", "true"])
    except KeyError as e:
        pytest.fail(f"KeyError {e} instead of a resume by step or a one-line error")
    except (ConfigError, ValueError):
        return  # a one-line refusal is fine
    assert code == 0
    assert sorted(losses(dump)) == [1, 2, 3, 4]
