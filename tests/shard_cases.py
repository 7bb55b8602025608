"""Small corpora, a BPE tokenizer trained here, and token shard folders made from them, for the
shard tests (nothing is downloaded)."""

import json
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from scripts.lib.prepare_shards import held_out
from components.data import SPLITS
from components.data.shards import ShardWriter, token_dtype
from components.tokenizer import HFTokenizer

WORDS = ("the of and to in is was for on that with as by it from at be this an which or are data "
         "model token shard window epoch rank batch loss résumé naïve 漢字 🙂").split()


def random_texts(rng: random.Random, count: int, min_words: int = 1, max_words: int = 60) -> list[str]:
    """Distinct documents (each starts with its number)."""
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            for i in range(count)]


def train_tokenizer(path: Path, rng: random.Random, vocab_size: int = 400) -> HFTokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(random_texts(rng, 200), trainer)
    tokenizer.save(str(path))
    return HFTokenizer(path)


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t}, ensure_ascii=False) + "\n" for t in texts),
                    encoding="utf-8")
    return path


def framed(tokenizer, text: str) -> list[int]:
    return [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]


def shard_documents(folder: Path, split: str) -> list[list[int]]:
    """Every document of a split, in order, as the shards hold them."""
    index = json.loads((folder / "index.json").read_text())
    documents = []
    for shard in index["splits"][split]["shards"]:
        tokens = np.load(folder / shard["file"], mmap_mode="r")
        offsets = np.load(folder / shard["file"].replace(".tokens.npy", ".docs.npy"))
        documents += [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    return documents


def write_token_shards(folder: Path, pieces: list[np.ndarray], vocab_size: int, tokenizer,
                       validation: list[np.ndarray] = ()) -> Path:
    """A shard folder holding the given token arrays as shards of one document each, written the
    way prepare_data.py writes them (for loader tests that need an exact, known stream)."""
    dtype = token_dtype(vocab_size)
    splits = {}
    for split, arrays in zip(SPLITS, (pieces, validation)):
        shards = []
        for i, array in enumerate(arrays):
            writer = ShardWriter(folder / split / f"{i:05d}-00000", dtype)
            writer.add(np.asarray(array), np.array([len(array)]))
            shards.append({"file": f"{split}/{i:05d}-00000.tokens.npy", **writer.finish()})
        splits[split] = {"tokens": sum(s["tokens"] for s in shards), "documents": len(shards),
                         "shards": shards}
    index = {"format": "flce-token-shards", "version": 1, "dtype": dtype.name,
             "tokenizer": {"fingerprint": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size,
                           "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "name": "test",
                           "path": None},
             "val_every": 0, "text_field": "text", "source": {}, "created": "",
             "max_token_id": int(max(int(a.max()) for a in [*pieces, *validation])),
             "splits": splits}
    (folder / "index.json").write_text(json.dumps(index))
    return folder


__all__ = ["held_out", "random_texts", "train_tokenizer", "write_jsonl", "framed", "shard_documents",
           "write_token_shards", "WORDS"]
