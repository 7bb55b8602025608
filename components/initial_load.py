"""What a run continuing from a Hugging Face folder (`[checkpoint] initial_load_path`) takes from
it when its own config leaves it open: the folder's tokenizer, when `[tokenizer]` is all defaults
(the byte tokenizer), and its vocabulary size, when `[model] vocab_size` is 0 (the flavor's).

An export of a run with its own tokenizer (scripts.export_hf) then continues with nothing but
its path: the same ids, bos and eos, and the same number of embedding rows."""

from pathlib import Path
from typing import Callable

import tokenizers

from components.config.schema import JobConfig, Tokenizer
from components.tokenizer import (TOKENIZER_FILE, ByteTokenizer, HFTokenizer,
                                  byte_tokenizer_json)
from models import hf


def take_settings_from_initial_load(cfg: JobConfig, log: Callable[[str], None]) -> None:
    """Set cfg's tokenizer and vocab size from the initial_load_path folder where the run
    leaves them open, saying so in one line; nothing when the path is not a Hugging Face folder
    (a DCP checkpoint, or missing: the load names that)."""
    folder = Path(cfg.checkpoint.initial_load_path)
    if not cfg.checkpoint.initial_load_path or not hf.is_hf_folder(folder):
        return
    config = hf.read_config(folder)
    taken = []
    tokenizer_file = folder / TOKENIZER_FILE
    if cfg.tokenizer == Tokenizer() and tokenizer_file.is_file() and not _is_byte_tokenizer(
            tokenizer_file):
        cfg.tokenizer.name, cfg.tokenizer.path = "hf", str(folder)
        for key, token in config_special_tokens(config, tokenizer_file).items():
            setattr(cfg.tokenizer, key, token)
        taken.append(f'[tokenizer] name = "hf", path = "{folder}"'
                     + "".join(f", {role}_token = {getattr(cfg.tokenizer, role + '_token')!r}"
                               for role in ("bos", "eos")
                               if getattr(cfg.tokenizer, role + "_token")))
    vocab = config.get("vocab_size")
    if cfg.model.vocab_size == 0 and isinstance(vocab, int) and vocab > 0:
        cfg.model.vocab_size = vocab
        taken.append(f"[model] vocab_size = {vocab}")
    if taken:
        log(f"from [checkpoint] initial_load_path {folder} (the run does not set them): "
            + "; ".join(taken))


def config_special_tokens(config: dict, tokenizer_file: Path) -> dict[str, str]:
    """{"bos_token": ..., "eos_token": ...}: the tokens a Hugging Face folder's config.json names
    by id (the ids the model was trained with, which win over the usual token names), for those
    it names that tokenizer_file has."""
    file = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    names = {f"{role}_token": file.id_to_token(config[f"{role}_token_id"])
             for role in ("bos", "eos") if isinstance(config.get(f"{role}_token_id"), int)}
    return {key: token for key, token in names.items() if token is not None}


def other_tokenizer_warning(initial_load_path: str, fingerprint: str) -> str | None:
    """A warning line when the run's tokenizer (its fingerprint) is not the tokenizer.json of a
    Hugging Face folder it starts from, with config.json's bos/eos ids: the embeddings are then
    read as other tokens' (a new tokenizer may be meant: a DCP checkpoint gets the same warning).
    None where they agree or the folder has no tokenizer.json to compare."""
    folder = Path(initial_load_path)
    file = folder / TOKENIZER_FILE
    if not initial_load_path or not hf.is_hf_folder(folder) or not file.is_file():
        return None
    try:
        if _is_byte_tokenizer(file):
            theirs = ByteTokenizer()
        else:
            theirs = HFTokenizer(file, **config_special_tokens(hf.read_config(folder), file))
    except Exception:  # a file it cannot read, or no bos/eos it can tell: nothing to compare
        return None
    if theirs.fingerprint() == fingerprint:
        return None
    return (f"warning: [tokenizer] is not the tokenizer of [checkpoint] initial_load_path {folder} "
            f"(its {TOKENIZER_FILE}: {theirs.vocab_size} ids, bos {theirs.bos_id}, eos "
            f"{theirs.eos_id}): the model's embeddings are read as this tokenizer's ids")


def _is_byte_tokenizer(path: Path) -> bool:
    """Whether a tokenizer.json is the byte tokenizer as export_hf writes it (the same ids)."""
    ours = tokenizers.Tokenizer.from_str(byte_tokenizer_json())
    theirs = tokenizers.Tokenizer.from_file(str(path))
    return theirs.get_vocab(with_added_tokens=True) == ours.get_vocab(with_added_tokens=True)
