"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, atomic, optionally async.

<dump_folder>/<folder>/step-<N>/ holds the model and optimizer (DCP, any parallel layout can
load them), `train_state.json` (step, tokens seen, lr schedule), `rank-<r>.pt` per rank (data
iterator position and RNG states) and the resolved `config.toml`. A save is written to
`step-<N>.tmp/` and renamed once every rank has finished, so a run killed mid-save leaves the
previous checkpoints intact; folders without the final name or without DCP's `.metadata` are
skipped (with a warning) when looking for the latest.
"""

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from components.config import Checkpoint
from components.float8 import plain_weights

STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / "train_state.json").is_file()


def list_checkpoints(folder: Path) -> dict[int, Path]:
    """Complete checkpoints by step; incomplete or foreign folders are skipped with a warning."""
    found = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        match = STEP_DIR.match(path.name)
        if match and _is_complete(path):
            found[int(match.group(1))] = path
        elif path.is_dir():
            warnings.warn(f"skipping incomplete checkpoint folder {path}")
    return found


def check_model_shapes(path: Path, model_sd: dict) -> None:
    """A clear error when the checkpoint was saved from a model of another shape."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
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
    def __init__(self, cfg: Checkpoint, dump_folder: Path, model, optimizer, scheduler, data,
                 batches_per_step: int, rank: int, config_toml: str):
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.model, self.optimizer, self.scheduler, self.data = model, optimizer, scheduler, data
        self.batches_per_step = batches_per_step
        self.rank = rank
        self.config_toml = config_toml
        self._pending = None  # (future, tmp path, final path) of an async save
        # An async save finishes with collectives in a background thread: they get a group of
        # their own so they never interleave with the training's collectives.
        self._async_group = (dist.new_group(backend="gloo")
                             if cfg.async_mode == "async" and dist.is_initialized() else None)

    def _state(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": plain_weights(model_sd), "optimizer": optim_sd}

    def save(self, step: int, tokens_seen: int) -> None:
        """Write step-<step>; with async_mode = "async" return once the state is staged."""
        self.wait()
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        torch.save({"data": self.data.state_dict(), "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                   tmp / f"rank-{self.rank}.pt")
        if self.rank == 0:
            (tmp / "train_state.json").write_text(json.dumps(
                {"step": step, "tokens_seen": tokens_seen, "scheduler": self.scheduler.state_dict()}))
            (tmp / "config.toml").write_text(self.config_toml)
        no_dist = not dist.is_initialized()
        if self._async_group is not None:
            future = dcp.async_save(self._state(), checkpoint_id=str(tmp),
                                    process_group=self._async_group)
            self._pending = (future, tmp, final)
        else:
            dcp.save(self._state(), checkpoint_id=str(tmp), no_dist=no_dist)
            self._finish(tmp, final)

    def wait(self) -> None:
        """Block until an async save in flight is written and renamed into place."""
        if self._pending is not None:
            future, tmp, final = self._pending
            future.result()
            self._pending = None
            self._finish(tmp, final)

    def _finish(self, tmp: Path, final: Path) -> None:
        _barrier()  # every rank's shards are on disk
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()

    def _prune(self) -> None:
        if self.cfg.keep_latest_k > 0:
            steps = sorted(list_checkpoints(self.folder))
            for step in steps[:-self.cfg.keep_latest_k]:
                shutil.rmtree(self.folder / f"step-{step}")

    def load(self) -> Optional[TrainState]:
        """Resume from load_step (-1: the latest) if there is a checkpoint, else start from
        initial_load_path's model weights if given. Returns the state to resume at, or None."""
        found = list_checkpoints(self.folder)
        if found:
            step = max(found) if self.cfg.load_step == -1 else self.cfg.load_step
            if step not in found:
                raise FileNotFoundError(f"[checkpoint] load_step = {step}: no complete checkpoint "
                                        f"{self.folder}/step-{step} (have {sorted(found)})")
            return self._load_full(found[step])
        if self.cfg.load_step not in (-1, 0):
            raise FileNotFoundError(f"[checkpoint] load_step = {self.cfg.load_step}, but "
                                    f"{self.folder} holds no complete checkpoint")
        if self.cfg.initial_load_path:
            self._load_model_only(Path(self.cfg.initial_load_path))
        return None

    def _load_full(self, path: Path) -> TrainState:
        state = self._state()
        check_model_shapes(path, state["model"])
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        train_state = json.loads((path / "train_state.json").read_text())
        self.scheduler.load_state_dict(train_state["scheduler"])
        rank_file = path / f"rank-{self.rank}.pt"
        if rank_file.is_file():
            extra = torch.load(rank_file, weights_only=False)
            self._load_data_state(extra["data"], train_state["step"])
            torch.set_rng_state(extra["rng"])
            if extra["cuda_rng"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(extra["cuda_rng"])
        else:
            self._load_data_state(None, train_state["step"])
        return TrainState(train_state["step"], train_state["tokens_seen"])

    def _load_data_state(self, state: Optional[dict], step: int) -> None:
        try:
            if state is None:
                raise ValueError("no data state for this rank (the world size grew)")
            self.data.load_state_dict(state)
        except ValueError as e:  # saved under another data-parallel layout
            try:
                self.data.resume_at_batch(step * self.batches_per_step)
            except ValueError:
                warnings.warn(f"data iterator not restored ({e}): this rank reads its shard "
                              "from the start")

    def _load_model_only(self, path: Path) -> None:
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"[checkpoint] initial_load_path = {path}: not a DCP checkpoint "
                                    "folder (no .metadata)")
        model_sd = plain_weights(get_model_state_dict(self.model))
        check_model_shapes(path, model_sd)
        dcp.load({"model": model_sd}, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        set_model_state_dict(self.model, model_sd, options=StateDictOptions(strict=True))
