"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, atomic, optionally async.

<dump_folder>/<folder>/step-<N>/ holds the model and optimizer (DCP, any parallel layout can
load them), `train_state.json` (step, tokens seen, lr schedule), `rank-<r>.pt` per rank (data
iterator position and RNG states) and the resolved `config.toml`. A run with no checkpoint of
its own can start from `initial_load_path`'s model weights: a DCP step folder, or a Hugging Face
LlamaForCausalLM folder (safetensors, read through the reader the trainer passes in). Which step
folders are whole checkpoints, and which one a run resumes from: components/checkpoint_folders.py.

Nothing damaged is resumed: each save writes checksums.json (components/checkpoint_manifest.py),
and a resume falls back to the previous checkpoint, naming the file, when a file of the chosen one
is missing or does not match.

Nothing is lost to a kill at any point:
- a save is written to `step-<N>.tmp/` (each file synced: components/synced_files.py) and
  renamed to `step-<N>/` by rank 0 as soon as DCP reports it written (DCP writes `.metadata`
  only after gathering every rank's write results, and each rank wrote its rank file before
  that). An async save is committed by a callback in DCP's writer thread, not at the next save.
  Folders without the final name or without `.metadata` are skipped (with a warning) when
  looking for the latest;
- pruning (keep_latest_k) renames a checkpoint to `step-<N>.pruned` before deleting it, and
  never touches the checkpoint just written;
- resuming from a step before the latest (load_step) moves the later step folders, another
  timeline, into `superseded-<time>-from-step-<N>/` rather than letting this run prune or
  overwrite them, or a later resume pick them. The checkpoints of such a run record its
  load_step: the same command again (a requeued job) resumes from them, not from load_step
  (components/checkpoint_folders.py).

Trust: loading a checkpoint runs no code from it. Rank files are read with
`torch.load(weights_only=True)` (tensors and plain data only), train_state.json is JSON, and
DCP's pickled `.metadata` and non-tensor entries go through components/safe_dcp.py, which admits
only DCP's metadata classes and plain data.
"""

import contextlib
import functools
import io
import json
import os
import pickle
import shutil
import signal
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from components import safe_dcp
from components.checkpoint_folders import STEP_DIR, ResumePoint, list_checkpoints, saved_tokenizer
from components.checkpoint_manifest import ChecksummingWriter, find_damage
from components.config.schema import JobConfig
from components.config.toml_out import to_toml
from components.float8_linear import plain_weights
from components.process import keep_own_timeout, note_process_group
from components.synced_files import sync_dir, write_synced

@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    metrics_started: Optional[float] = None  # the "time" of its run's first metrics.jsonl line


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _one_process_quiet(no_dist: bool):
    """A single-process run saves and loads without a process group (no_dist): DCP then warns
    "torch.distributed is disabled ... assuming ... a single process" on every call, which is
    what this trainer meant. Silenced for those calls only."""
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        yield


def _fault_point(name: str, step: int) -> None:
    """Test-only (tests/test_faults.py): FLCE_FAULT_POINT=<name>@<step> makes the process SIGKILL
    itself here, to prove that a kill at that point loses nothing. Unset, it does nothing."""
    if os.environ.get("FLCE_FAULT_POINT") == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _remove(path: Path) -> None:
    """A step folder linked in from elsewhere loses its link only: what it points at is not this
    run's to delete (rmtree refuses a link, which crashed every later save); a stray file in a step
    folder's place goes too (rmtree refuses a file)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path)


def _interrupted(error: BaseException | None) -> bool:
    """A Ctrl-C inside torch.save surfaces as the writer's RuntimeError("unexpected pos") with the
    KeyboardInterrupt only in its context; DCP wraps per-rank failures in CheckpointException."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, KeyboardInterrupt):
            return True
        failures = getattr(error, "failures", None)  # rank -> (exception, stack summary)
        if isinstance(failures, dict) and any(
                _interrupted(f[0] if isinstance(f, tuple) else f) for f in failures.values()):
            return True
        error = error.__cause__ or error.__context__
    return False


def _save_failed(final: Path, error: BaseException) -> RuntimeError:
    """DCP's errors span many lines and may not say why (a full disk can read "unexpected pos")."""
    last = (str(error).strip().splitlines() or [type(error).__name__])[-1]
    free = shutil.disk_usage(final.parent).free / 2**30
    return RuntimeError(f"[checkpoint] writing {final} failed ({last}); {free:.1f} GiB free on its "
                        "filesystem. The checkpoints committed before it are intact")


def check_model_shapes(path: Path, model_sd: dict) -> None:
    """A clear error when the checkpoint was saved from a model of another shape."""
    meta = safe_dcp.read_metadata(path).state_dict_metadata
    saved = {k[len("model."):]: v for k, v in meta.items() if k.startswith("model.")}
    missing = sorted(set(model_sd) - set(saved))
    if missing:
        raise ValueError(f"checkpoint {path} lacks model parameters {missing[:5]} "
                         f"({len(missing)} in all): was it saved from another model config?")
    for name, tensor in model_sd.items():
        shape = tuple(getattr(saved[name], "size", ()))
        if shape != tuple(tensor.shape):
            raise ValueError(f"checkpoint {path}: parameter {name} has shape {shape} but the model "
                             f"built from this config has {tuple(tensor.shape)} (check [model])")


class Checkpointer:
    def __init__(self, cfg: JobConfig, model, optimizer, scheduler, data, rank: int,
                 dp_rank: Optional[int] = None,
                 read_hf_folder: Optional[Callable[[Path], dict]] = None,
                 tokenizer: Optional[dict] = None):
        """cfg: the run's config. Its [checkpoint] section says where, when and how to save;
        the dump folder holds the checkpoint folder; each save keeps the whole config (config.toml)
        and resumes the data at [training] gradient_accumulation_steps batches a step.
        model, optimizer, scheduler, data: what a checkpoint saves and restores.
        read_hf_folder: reads a Hugging Face model folder (initial_load_path) as full tensors
        named as in get_model_state_dict(model); the trainer passes models/hf.py's reader.
        dp_rank: this rank's data-parallel rank, whose saved data state it resumes (None: the
        state of the same global rank).
        tokenizer: {"fingerprint", "vocab_size"} of the run's tokenizer, kept in train_state.json
        so that generate/evaluate can refuse another vocabulary (scripts/lib/checkpoints.py)."""
        self.cfg = cfg.checkpoint
        self.tokenizer = tokenizer
        self.read_hf_folder = read_hf_folder
        self.folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder
        self.model, self.optimizer, self.scheduler, self.data = model, optimizer, scheduler, data
        self.batches_per_step = cfg.training.gradient_accumulation_steps
        self.last_step = cfg.training.steps
        self.rank = rank
        self.dp_rank = dp_rank
        # a CPU run on a GPU host leaves CUDA alone: each use makes a context on GPU 0 in every rank
        self.on_cuda = any(p.device.type == "cuda" for p in model.parameters())
        self.config_toml = to_toml(cfg)
        self._pending: Optional[Future] = None  # an async save's commit
        # An async save finishes with collectives in a background thread: they get a group of
        # their own so they never interleave with the training's collectives. They wait on every
        # rank's writes while training goes on, which no [comm] phase bounds: the group keeps
        # torch's gloo default timeout (30 min), as torchtitan's async group does.
        self._async_group = None
        if self.cfg.async_mode == "async" and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")
            note_process_group("gloo", dist.get_world_size())  # see components/process.py
            keep_own_timeout(self._async_group)

    def saves_at(self, step: int, stopping: bool = False) -> bool:
        """Whether this step ends with a save: every [checkpoint] interval steps, at the last
        step, and when the run stops early (a stop signal); never with [checkpoint] enable =
        false. The same answer on every rank."""
        return self.cfg.enable and (stopping or step % self.cfg.interval == 0
                                    or step == self.last_step)

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": plain_weights(model_sd), "optimizer": optim_sd}

    def save(self, step: int, tokens_seen: int, metrics_started: Optional[float] = None) -> None:
        """Write step-<step>; with async_mode = "async" return once the state is staged (it is
        committed in the background as soon as it is written). metrics_started: the run's
        MetricsLogger.started, kept in train_state.json for the run that resumes it."""
        self.wait()
        started = time.perf_counter()
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            if tmp.is_symlink() or tmp.exists():  # a save of this step that was never committed
                _remove(tmp)
            tmp.mkdir(parents=True)
        _barrier()
        rank_state = io.BytesIO()
        torch.save({"data": self.data.state_dict(), "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state() if self.on_cuda else None},
                   rank_state)
        try:
            write_synced(tmp / f"rank-{self.rank}.pt", rank_state.getvalue())
            if self.rank == 0:
                # load_step: a later run with the same one resumes from here (checkpoint_folders.py)
                write_synced(tmp / "train_state.json", json.dumps(
                    {"step": step, "tokens_seen": tokens_seen,
                     "scheduler": self.scheduler.state_dict(),
                     **({"tokenizer": self.tokenizer} if self.tokenizer else {}),
                     **({"load_step": self.cfg.load_step} if self.cfg.load_step >= 0 else {}),
                     # a resumed run appends to its own timeline's metrics.jsonl only
                     **({"metrics_started": metrics_started}
                        if metrics_started is not None else {})}).encode())
                write_synced(tmp / "config.toml", self.config_toml.encode())
        except OSError as e:  # a full disk, before DCP writes anything
            raise _save_failed(final, e) from e
        _fault_point("after_rank_files", step)
        no_dist = not dist.is_initialized()
        own_files = [f"rank-{self.rank}.pt"] + (["train_state.json", "config.toml"]
                                                if self.rank == 0 else [])
        writer = ChecksummingWriter(tmp, self.rank, own_files,  # checksums.json for load()
                                    on_cpu=not self.on_cuda)
        if self.cfg.async_mode == "async":
            with _one_process_quiet(no_dist):
                written = dcp.async_save(self._state(), storage_writer=writer, no_dist=no_dist,
                                         process_group=self._async_group)
            written = getattr(written, "upload_completion", written)  # an AsyncSaveResponse
            self._pending = Future()
            blocked = time.perf_counter() - started
            written.add_done_callback(functools.partial(
                self._commit_when_written, tmp, final, step, self._pending,
                f"in the background; training waited {blocked:.1f} s", started))
            _fault_point("async_started", step)
        else:
            try:
                with _one_process_quiet(no_dist):
                    dcp.save(self._state(), storage_writer=writer, no_dist=no_dist)
            except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
                if _interrupted(e):  # the user's second Ctrl-C, not a failed write
                    raise KeyboardInterrupt from e
                raise _save_failed(final, e) from e
            self._commit(tmp, final, step, "", started)

    def _commit_when_written(self, tmp: Path, final: Path, step: int, committed: Future,
                             how: str, started: float, written: Future) -> None:
        """Runs in DCP's writer thread when the save is done: no collectives here."""
        try:
            written.result()  # a failed save raises here and is never committed
        except BaseException as e:  # handed to the training thread by wait()
            committed.set_exception(_save_failed(final, e))
            return
        try:
            self._commit(tmp, final, step, how, started)
            committed.set_result(None)
        except BaseException as e:
            committed.set_exception(e)

    def wait(self) -> None:
        """Block until an async save in flight is written and committed; raise if it failed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def raise_if_async_save_failed(self, device: torch.device) -> None:
        """Stop the run as soon as an async save has failed, not at the next save (hours later,
        training on without a checkpoint). Every rank calls it at the same steps: the ranks
        agree in one all-reduce (a rank's own save may have succeeded: rank 0 alone commits)."""
        if self.cfg.async_mode != "async":
            return
        pending = self._pending
        failed = pending is not None and pending.done() and pending.exception() is not None
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor(float(failed), device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            anywhere = bool(flag.item())
        else:
            anywhere = failed
        if failed:
            self.wait()  # raises the save's own error
        if anywhere:
            raise RuntimeError("[checkpoint] an asynchronous save failed on another rank (its log "
                               "says why); the checkpoints committed before it are intact")

    def _commit(self, tmp: Path, final: Path, step: int, how: str, started: float) -> None:
        """Every rank's files are on disk once DCP's save returns: rank 0 renames them into place
        (the one atomic step), says so, and prunes."""
        if self.rank != 0:
            return
        _fault_point("before_commit", step)
        os.replace(tmp, final)  # a non-empty final folder makes this fail: it is never replaced
        sync_dir(self.folder)
        print(f"checkpoint: step {step} saved to {final} in {time.perf_counter() - started:.1f} s"
              + (f" ({how})" if how else ""), flush=True)
        _fault_point("after_commit", step)
        self._prune(step)

    def _prune(self, newest: int) -> None:
        """Keep the keep_latest_k latest checkpoints, newest (just written) among them. Only this
        timeline's checkpoints are here: load() set later ones aside."""
        for leftover in self.folder.glob("step-*.pruned"):  # a prune killed mid-way
            _remove(leftover)
        if self.cfg.keep_latest_k <= 0:
            return
        older = sorted(s for s in list_checkpoints(self.folder) if s < newest)
        for step in older[:max(len(older) - (self.cfg.keep_latest_k - 1), 0)]:
            doomed = self.folder / f"step-{step}.pruned"
            os.replace(self.folder / f"step-{step}", doomed)  # never half-deleted under its name
            _fault_point("mid_prune", newest)
            _remove(doomed)

    def load(self, resume: ResumePoint) -> Optional[TrainState]:
        """Resume from the resume point (find_resume_point: load_step, -1 the latest) if it has
        a step, else start from initial_load_path's model weights if given. Returns the state
        to resume at, or None. With [checkpoint] enable = false a run neither saves nor
        resumes: step folders an earlier run left in the dump folder are not this run's
        (initial_load_path still loads)."""
        resumed = None
        step, found = resume.step, resume.found
        if step is not None:
            if self.cfg.load_step >= 0 and step != self.cfg.load_step and self.rank == 0:
                print(f"[checkpoint] load_step = {self.cfg.load_step} was passed: a run with this "
                      f"load_step went on from step {self.cfg.load_step} to step {step} (this "
                      f"command, restarted or requeued), so it resumes from step-{step}. To go back "
                      f"to step {self.cfg.load_step} again, move the later step folders out of "
                      f"{self.folder}", flush=True)
            step = self._intact(found, step)
            try:
                resumed = self._load_full(found[step])
            except safe_dcp.DamagedCheckpointError as e:  # no checksums.json (an older save)
                earlier = sorted(s for s in found if s < step)
                raise safe_dcp.DamagedCheckpointError(
                    f"{e}. Resume from an earlier checkpoint: [checkpoint] load_step = "
                    + (f"one of {earlier}" if earlier else "-1 after moving it out of "
                       f"{self.folder}")) from e
        elif self.cfg.initial_load_path:
            kind = self._load_model_only(Path(self.cfg.initial_load_path))
            if self.rank == 0:
                print(f"checkpoint: the weights come from [checkpoint] initial_load_path "
                      f"{self.cfg.initial_load_path} ({kind}); optimizer and step start afresh",
                      flush=True)
        if self.cfg.enable and self.rank == 0:
            self._set_aside_after(resumed.step if resumed else 0)
        return resumed

    def _intact(self, found: dict[int, Path], step: int) -> int:
        """step, or when a file of it is damaged or missing (its checksums.json says) the latest
        intact earlier checkpoint, with a warning naming the file; an error naming it when
        load_step asked for that checkpoint or none is intact. The ranks agree."""
        damaged = []
        while (damage := self._damage(found[step])) is not None:
            earlier = sorted(s for s in found if s < step)
            if step == self.cfg.load_step:
                raise ValueError(f"[checkpoint] load_step = {step}: {damage}; set load_step to "
                                 + (f"an earlier step (have {earlier})" if earlier else "-1"))
            damaged.append(damage)
            if not earlier:
                raise ValueError(f"[checkpoint] no intact checkpoint in {self.folder}: "
                                 f"{'; '.join(damaged)}. Nothing was moved or deleted; set "
                                 "[checkpoint] folder or load_step, or remove the damaged folders "
                                 "to start afresh")
            if self.rank == 0:
                warnings.warn(f"[checkpoint] not resuming from {found[step]}: {damage}; falling "
                              f"back to step-{earlier[-1]}")
            step = earlier[-1]
        return step

    def _damage(self, path: Path) -> Optional[str]:
        """find_damage over the ranks. config.toml only lists the config changes since the
        checkpoint: train.py warns if it cannot be read, and resumes."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return find_damage(path, self.rank, world, ignore=("config.toml",))

    def _latest_intact(self, folder: Path, steps: dict[int, Path]) -> Path:
        """The latest step folder of initial_load_path's checkpoint folder whose files are intact;
        a damaged later one is named in a warning, as a resume falls back past it."""
        damaged = []
        for step in sorted(steps, reverse=True):
            if (damage := self._damage(steps[step])) is None:
                return steps[step]
            damaged.append(damage)
            if self.rank == 0:
                warnings.warn(f"[checkpoint] initial_load_path: not loading {steps[step]}: "
                              f"{damage}; falling back to an earlier step")
        raise ValueError(f"[checkpoint] initial_load_path = {folder} holds no intact checkpoint: "
                         f"{'; '.join(damaged)}")

    def _set_aside_after(self, step: int) -> None:
        """Step folders after the one this run starts from belong to another timeline (a rollback
        with load_step, or leftovers of an incomplete save): this run would prune them or
        overwrite them, and a later resume would pick them. Move them aside, deleting nothing."""
        if not self.folder.is_dir():
            return
        later = sorted((int(m.group(1)), p) for p in self.folder.iterdir()
                       if (m := STEP_DIR.match(p.name)) and int(m.group(1)) > step)
        if not later:
            return
        aside = self.folder / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}-from-step-{step}"
        aside.mkdir()
        for _, path in later:
            os.replace(path, aside / path.name)
        warnings.warn(f"this run continues from step {step}: moved the later checkpoint folders "
                      f"{', '.join(p.name for _, p in later)} (another timeline) to {aside}; "
                      "nothing was deleted")

    def _load_full(self, path: Path) -> TrainState:
        state = self._state()
        check_model_shapes(path, state["model"])
        with _one_process_quiet(not dist.is_initialized()):
            safe_dcp.load(state, path, no_dist=not dist.is_initialized())
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        try:
            train_state = json.loads((path / "train_state.json").read_text())
            step, tokens_seen = int(train_state["step"]), int(train_state["tokens_seen"])
            scheduler = train_state["scheduler"]
        except (ValueError, KeyError, TypeError) as e:
            raise safe_dcp.DamagedCheckpointError(
                f"{path / 'train_state.json'} is damaged ({type(e).__name__}: {e})") from None
        self.scheduler.load_state_dict(scheduler)
        rank_file = self._rank_file(path)
        if rank_file.is_file():
            try:  # plain data only: unpickling arbitrary objects could run code
                extra = torch.load(rank_file, weights_only=True)
            except Exception as e:
                if safe_dcp.names_a_global(e):
                    raise safe_dcp.UnsafeCheckpointError(
                        f"{rank_file} holds objects other than tensors and plain data; not "
                        "loading it, since unpickling them could run code (this trainer never "
                        "writes such a file)") from e
                raise safe_dcp.DamagedCheckpointError(  # not a zip, cut short, garbled
                    f"{rank_file} is damaged ({type(e).__name__})") from None
            self._load_data_state(extra["data"], step)
            torch.set_rng_state(extra["rng"])
            if extra["cuda_rng"] is not None and self.on_cuda:
                torch.cuda.set_rng_state(extra["cuda_rng"])
        else:
            saved = len(list(path.glob("rank-*.pt")))
            world = dist.get_world_size() if dist.is_initialized() else 1
            self._load_data_state(None, step, f"no data state for this rank: {rank_file.name} is "
                                  f"not in the checkpoint ({saved} rank files; {world} ranks "
                                  "now)")
        started = train_state.get("metrics_started")
        return TrainState(step, tokens_seen, started if isinstance(started, float) else None)

    def _rank_file(self, path: Path) -> Path:
        """The rank file this rank resumes its data from: that of the first saved rank of its
        data-parallel rank. The ranks of one data-parallel rank (its tensor- and context-parallel
        ranks) read the same batches; under another tensor or context degree the same global
        rank belongs to another data-parallel rank, whose windows it must not read."""
        own = path / f"rank-{self.rank}.pt"
        if self.dp_rank is None:
            return own
        try:
            saved_dp_world = int(torch.load(path / "rank-0.pt", weights_only=True)["data"]["dp_world"])
        except (OSError, KeyError, TypeError, ValueError, pickle.UnpicklingError):
            # a data state that is the same on every rank (token shards' global position), or
            # none. A rank with no file of its own (more ranks now) reads rank 0's: placed by
            # step x the new global batch instead, it read other windows than the ranks that
            # had files (the global batches no longer one run of windows, some never read)
            first = path / "rank-0.pt"
            return own if own.is_file() or not first.is_file() else first
        ranks_per_dp_rank = max(len(list(path.glob("rank-*.pt"))) // max(saved_dp_world, 1), 1)
        return path / f"rank-{self.dp_rank * ranks_per_dp_rank}.pt"

    def _load_data_state(self, state: Optional[dict], step: int, why_none: str = "") -> None:
        try:
            if state is None:
                raise ValueError(why_none)
            self.data.load_state_dict(state)
        except ValueError as e:  # saved under another data-parallel layout
            try:
                self.data.resume_at_batch(step * self.batches_per_step)
            except ValueError:
                warnings.warn(f"data iterator not restored ({e}): this rank reads its shard "
                              "from the start")

    def _load_model_only(self, path: Path) -> str:
        """The model's weights from a DCP step folder or a Hugging Face folder; says which."""
        if (path / "config.json").is_file() and not (path / ".metadata").is_file() \
                and self.read_hf_folder is not None:
            self._load_hf_folder(path)
            return "a Hugging Face folder"
        if (path / ".metadata").is_file():
            if (damage := self._damage(path)) is not None:
                raise ValueError(f"[checkpoint] initial_load_path = {path}: {damage}")
        elif steps := list_checkpoints(path, resumable=False):
            # a run's checkpoint folder, as generate, evaluate and export_hf take it
            path = self._latest_intact(path, steps)
            if self.rank == 0:
                print(f"checkpoint: [checkpoint] initial_load_path holds step folders: loading "
                      f"the latest complete and intact one, {path}", flush=True)
        else:
            raise FileNotFoundError(f"[checkpoint] initial_load_path = {path}: neither a DCP "
                                    "checkpoint folder (no .metadata) nor a Hugging Face model "
                                    "folder (no config.json), nor a folder of step-<N> checkpoints")
        model_sd = plain_weights(get_model_state_dict(self.model))
        check_model_shapes(path, model_sd)
        saved = saved_tokenizer(path)
        if self.rank == 0 and saved and self.tokenizer \
                and saved["fingerprint"] != self.tokenizer["fingerprint"]:
            # a new tokenizer of the same size may be meant (fine-tuning); resuming refuses one
            warnings.warn(f"[checkpoint] initial_load_path = {path} was trained with another "
                          "tokenizer than [tokenizer] (same vocab_size, other tokens or bos/eos "
                          "ids): its embeddings are read as this tokenizer's ids")
        with _one_process_quiet(not dist.is_initialized()):
            safe_dcp.load({"model": model_sd}, path, no_dist=not dist.is_initialized())
        set_model_state_dict(self.model, model_sd, options=StateDictOptions(strict=True))
        return "a DCP checkpoint"

    def _load_hf_folder(self, path: Path) -> None:
        """Rank 0 alone reads the folder into full CPU tensors (a shared filesystem is read
        once, and one copy is held per node at most); set_model_state_dict broadcasts them one
        at a time and each rank keeps its own shard of every parameter, whatever the layout
        (FSDP, TP, both). The other ranks learn of a failed read from rank 0, with its error,
        instead of waiting in the broadcast."""
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        full, error = {}, None
        if self.rank == 0 or not distributed:
            try:
                full = self.read_hf_folder(path)
            except (OSError, ValueError) as e:
                error = f"[checkpoint] initial_load_path = {path}: {e}"
            except Exception as e:  # still told to the other ranks, which would wait forever
                error = f"[checkpoint] initial_load_path = {path}: {type(e).__name__}: {e}"
        if distributed:
            message = [error]
            dist.broadcast_object_list(message, src=0)
            error = message[0]
        if error is not None:
            raise ValueError(error)
        set_model_state_dict(self.model, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=distributed, strict=True))
