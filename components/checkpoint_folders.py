"""A run's checkpoint folder as it is read back: which step folders hold a whole checkpoint,
which one a run resumes from, and the tokenizer each was trained with. Reading only, and cheap:
the trainer asks before it builds the model, and scripts/lib/checkpoints.py reads a folder the
same way. Writing, pruning and loading checkpoints: components/checkpoint.py.

<dump_folder>/<folder>/step-<N>/ is a checkpoint once it holds DCP's `.metadata` (and, to resume
from, train_state.json). Other step folders (a save not yet committed, `step-<N>.tmp`; a prune
cut short, `step-<N>.pruned`; one without `.metadata`) are skipped with a warning. A
run resumes from [checkpoint] load_step (-1: the latest); the checkpoints of a run that set
load_step record it, so the same command again (a requeued job) resumes from them instead of
going back to load_step for ever.
"""

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from components.config.schema import Checkpoint
from components.rank_warnings import SameOnEveryRank

STEP_DIR = re.compile(r"^step-(\d+)$")


def is_complete(path: Path, resumable: bool = True) -> bool:
    """Whether a step folder holds a whole checkpoint: DCP writes .metadata last, once every
    rank's files are written (and this trainer commits a save by renaming the folder after
    that). Resuming also needs train_state.json (step, tokens, schedule), which this trainer
    writes before .metadata; with resumable=False a folder of model weights alone (another
    trainer's: torchtitan's) counts too, for what reads only the model
    (scripts/lib/checkpoints.py)."""
    return (path / ".metadata").is_file() and (not resumable
                                               or (path / "train_state.json").is_file())


def list_checkpoints(folder: Path, resumable: bool = True) -> dict[int, Path]:
    """Complete checkpoints (is_complete) by step; incomplete step folders are skipped with a
    warning."""
    found = {}
    if not folder.is_dir():
        return found
    for path in sorted(folder.iterdir()):
        match = STEP_DIR.match(path.name)
        if match and is_complete(path, resumable):
            found[int(match.group(1))] = path
        elif path.is_dir() and path.name.startswith("step-"):
            warnings.warn(f"skipping incomplete checkpoint folder {path}", SameOnEveryRank)
    return found


def _written_with_load_step(path: Path) -> Optional[int]:
    """The [checkpoint] load_step of the run that wrote this checkpoint (None: -1 or unknown)."""
    try:
        return json.loads((path / "train_state.json").read_text()).get("load_step")
    except (OSError, ValueError, AttributeError):
        return None


def step_to_load(cfg: Checkpoint, folder: Path, found: Optional[dict[int, Path]] = None
                 ) -> Optional[int]:
    """The step a run resumes from ([checkpoint] load_step; -1: the latest), None when there is
    none; an error naming load_step when it names a missing one. A load_step that this timeline
    has passed (the latest checkpoint was written by a run with the same load_step: the same
    command, restarted or requeued) gives the latest, or a requeued job would go back to it for
    ever. Cheap: the trainer asks before it builds the model."""
    found = list_checkpoints(folder) if found is None else found
    if found:
        step = max(found) if cfg.load_step == -1 else cfg.load_step
        if (cfg.load_step >= 0 and max(found) > cfg.load_step
                and _written_with_load_step(found[max(found)]) == cfg.load_step):
            step = max(found)
        if step not in found:
            raise FileNotFoundError(f"[checkpoint] load_step = {step}: no complete checkpoint "
                                    f"{folder}/step-{step} (have {sorted(found)})")
        return step
    if cfg.load_step not in (-1, 0):
        raise FileNotFoundError(f"[checkpoint] load_step = {cfg.load_step}, but {folder} holds "
                                "no complete checkpoint")
    return None


@dataclass(frozen=True)
class ResumePoint:
    """Where a run resumes: the step ([checkpoint] load_step; None: none) and the complete
    checkpoints it was chosen among. Found once, before the model is built, so that a wrong
    load_step fails fast; Checkpointer.load() then resumes from it (the run lock keeps other runs
    out of the folder in between)."""
    step: Optional[int]
    found: dict[int, Path]


def find_resume_point(cfg: Checkpoint, folder: Path) -> ResumePoint:
    """The step to resume from and the checkpoints found; none with [checkpoint] enable = false
    (such a run neither saves nor resumes)."""
    if not cfg.enable:
        return ResumePoint(None, {})
    found = list_checkpoints(folder)
    return ResumePoint(step_to_load(cfg, folder, found), found)


def saved_tokenizer(path: Path, strict: bool = False) -> Optional[dict]:
    """{"fingerprint", "vocab_size"} of the tokenizer the checkpoint at path was trained with, as
    its train_state.json records it; None where it records none (older checkpoints) or cannot be
    read (a damaged one falls back to an earlier step when it is loaded). strict: one that cannot
    be read is a ValueError naming it (export_hf, generate and evaluate have no step to fall
    back to, and would otherwise leave the tokenizer unchecked)."""
    file = path / "train_state.json"
    try:
        state = json.loads(file.read_text())
        if not isinstance(state, dict):
            raise TypeError(f"a JSON {type(state).__name__}, expected an object")
        record = state.get("tokenizer")
        if record is None:
            return None
        return {"fingerprint": str(record["fingerprint"]), "vocab_size": int(record["vocab_size"])}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        if strict:
            raise ValueError(f"{file} is damaged ({type(e).__name__}: {e})") from None
        return None


def check_resumed_tokenizer(path: Path, fingerprint: str) -> None:
    """A ValueError naming [tokenizer] when the checkpoint a run resumes from was trained with
    another tokenizer: the ids would mean other tokens, and the saved data position other text
    (a text source failed at its first batch, deep in the data thread)."""
    saved = saved_tokenizer(path)
    if saved is not None and saved["fingerprint"] != fingerprint:
        raise ValueError(f"[tokenizer] is not the tokenizer {path} was trained with (vocab_size "
                         f"{saved['vocab_size']}, another vocabulary or bos/eos ids): resume with "
                         "that one, or start a new run from these weights with [checkpoint] "
                         "initial_load_path in another dump folder")
