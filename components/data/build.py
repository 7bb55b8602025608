"""build_data: the batches of one split of the [data] section's source, whatever it is."""

from components.config.schema import Data, Training
from components.data.prefetch import Prefetched
from components.data.shard_batches import build_shard_batches
from components.data.shards import is_shard_folder
from components.data.sources import load_documents
from components.data.windows import Batches, SyntheticTokens, TokenWindows
from components.tokenizer import Tokenizer


def build_data(data: Data, training: Training, *, split: str, tokenizer: Tokenizer,
               dp_rank: int = 0, dp_world: int = 1,
               max_token_id: int | None = None) -> Batches | Prefetched:
    """The batches of one split of the [data] section's source: synthetic tokens; token shards
    (a folder made by scripts.prepare_data, or a [[data.mixture]] of such folders); or text
    documents, tokenized by data.num_workers worker processes (0: by the loading thread;
    validation always is, it reads little). Shards and text are made ahead by a background
    thread (prefetch.py). training gives the windows' seq_len, local_batch_size and seed;
    dp_rank of dp_world: this rank's share; max_token_id: the model's vocabulary."""
    seq_len, local_batch_size, seed = training.seq_len, training.local_batch_size, training.seed
    if data.synthetic:
        vocab_size = max_token_id if max_token_id is not None else tokenizer.vocab_size
        # Validation gets its own stream so it never scores the windows it trained on.
        split_seed = seed if split == "train" else seed + 1
        windows = SyntheticTokens(vocab_size, seq_len, split_seed, dp_rank, dp_world, local_batch_size)
        return Batches(windows, local_batch_size)
    if data.mixture or is_shard_folder(data.source):
        return Prefetched(build_shard_batches(data, training, split=split, tokenizer=tokenizer,
                                              dp_rank=dp_rank, dp_world=dp_world,
                                              max_token_id=max_token_id), note_epochs=split == "train")
    documents = load_documents(data.source, split, text_field=data.text_field, streaming=data.streaming,
                               val_every=data.val_every, cache_dir=data.cache_dir,
                               on_bad_document=data.on_bad_document)
    windows = TokenWindows(documents, tokenizer, seq_len, dp_rank=dp_rank, dp_world=dp_world,
                           max_token_id=max_token_id, text_field=data.text_field,
                           num_workers=data.num_workers if split == "train" else 0,
                           name=f"{data.source} ({split})", selection={"val_every": data.val_every})
    # Validation's repeats are the trainer's warning: it reads the same batches at every evaluation.
    return Prefetched(Batches(windows, local_batch_size), note_epochs=split == "train")
