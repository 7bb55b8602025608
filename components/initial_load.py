"""What a run continuing from a Hugging Face folder (`[checkpoint] initial_load_path`) takes from
it when its own config leaves it open: the folder's tokenizer, when `[tokenizer]` is all defaults
(the byte tokenizer), and its vocabulary size, when `[model] vocab_size` is 0 (the flavor's).

An export of a run with its own tokenizer (scripts.export_hf) then continues with nothing but
its path: the same ids, bos and eos, and the same number of embedding rows."""

from pathlib import Path
from typing import Callable

import tokenizers

from components.config.schema import JobConfig, Tokenizer
from components.tokenizer import TOKENIZER_FILE, byte_tokenizer_json
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
        file = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        cfg.tokenizer.name, cfg.tokenizer.path = "hf", str(folder)
        for role in ("bos", "eos"):  # config.json's ids are the ones the model was trained with
            token_id = config.get(f"{role}_token_id")
            token = file.id_to_token(token_id) if isinstance(token_id, int) else None
            if token is not None:
                setattr(cfg.tokenizer, f"{role}_token", token)
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


def _is_byte_tokenizer(path: Path) -> bool:
    """Whether a tokenizer.json is the byte tokenizer as export_hf writes it (the same ids)."""
    ours = tokenizers.Tokenizer.from_str(byte_tokenizer_json())
    theirs = tokenizers.Tokenizer.from_file(str(path))
    return theirs.get_vocab(with_added_tokens=True) == ours.get_vocab(with_added_tokens=True)
