"""TokenWindows: documents become consecutive token windows, shared disjointly between
data-parallel ranks, from a loaded dataset or a stream; SyntheticTokens per rank. Its helpers
(random_texts, write_jsonl, framed, read_tokens, ...) serve the other test_data_* modules."""

import json
import random
from pathlib import Path

import datasets
import pytest
import torch

from components.config.schema import Data, Training
from components.data.build import build_data
from components.data.sources import load_documents
from components.data.windows import Batches, SyntheticTokens, TokenWindows
from components.tokenizer import ByteTokenizer

BYTE = ByteTokenizer()
ALPHABET = "abcdefghij klmnop qrstuvwxyz 0123456789 .,;:!? éüß Ωπ 漢字 🙂"


def random_texts(rng: random.Random, count: int, max_length: int = 40) -> list[str]:
    # The number makes every document distinct, so a document can be recognised in a rank's stream.
    return [f"{i}:" + "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, max_length)))
            for i in range(count)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts), encoding="utf-8")
    return path


def framed(texts: list[str]) -> list[int]:
    return [i for text in texts for i in (BYTE.bos_id, *BYTE.encode(text), BYTE.eos_id)]


def read_tokens(windows, count: int) -> list[int]:
    """The token stream that `count` windows cover (each window is inputs plus the last label)."""
    tokens = []
    for _ in range(count):
        inputs, labels = next(windows)
        tokens += inputs.tolist() + labels[-1:].tolist()
    return tokens


def split_documents(tokens: list[int]) -> list[str]:
    """The complete documents in a byte-tokenizer stream that starts at a document's bos."""
    documents, current = [], None
    for token in tokens:
        if token == BYTE.bos_id:
            current = []
        elif token == BYTE.eos_id:
            documents.append(BYTE.decode(current))
            current = None
        else:
            current.append(token)
    return documents


def plain(state: dict) -> dict:
    # A checkpoint must be able to hold the state; a JSON round trip proves it is plain Python.
    return json.loads(json.dumps(state))


def test_windows_are_consecutive_slices_of_the_framed_documents(tmp_path, rng):
    texts = random_texts(rng, 13)
    path = write_jsonl(tmp_path / "docs.jsonl", texts)
    val_every = 4
    documents = load_documents(str(path), "train", val_every=val_every, cache_dir=tmp_path / "cache")
    seq_len = rng.randint(3, 20)
    windows = TokenWindows(documents, BYTE, seq_len)

    epoch_tokens = framed([t for i, t in enumerate(texts) if i % val_every])
    count = 3 * len(epoch_tokens) // (seq_len + 1) + 1  # reaches into the fourth epoch
    expected = epoch_tokens * 4
    for k in range(count):
        inputs, labels = next(windows)
        assert inputs.dtype == labels.dtype == torch.long
        assert inputs.shape == labels.shape == (seq_len,)
        assert torch.equal(labels[:-1], inputs[1:])
        window = expected[k * (seq_len + 1):(k + 1) * (seq_len + 1)]
        assert inputs.tolist() == window[:-1] and labels.tolist() == window[1:], f"window {k}"
    consumed = count * (seq_len + 1)
    assert windows.state_dict()["epoch"] == (consumed - 1) // len(epoch_tokens) == 3


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_read_disjoint_shares_that_cover_all_documents(tmp_path, rng, world, streaming):
    texts = random_texts(rng, 11)
    path = write_jsonl(tmp_path / "docs.jsonl", texts)
    documents = load_documents(str(path), "train", streaming=streaming, val_every=5,
                               cache_dir=tmp_path / "cache")
    train_texts = [t for i, t in enumerate(texts) if i % 5]
    seq_len = 7
    enough = 2 * len(framed(train_texts)) // (seq_len + 1) + 2  # more than one epoch of any rank

    shares = []
    for rank in range(world):
        read = split_documents(read_tokens(TokenWindows(documents, BYTE, seq_len, rank, world), enough))
        first_epoch = read[:read.index(read[0], 1)] if read.count(read[0]) > 1 else read
        assert len(set(first_epoch)) == len(first_epoch)
        assert first_epoch == sorted(first_epoch, key=train_texts.index), "a rank keeps the source order"
        shares.append(set(first_epoch))
    assert set().union(*shares) == set(train_texts)
    assert sum(len(s) for s in shares) == len(train_texts), "shares overlap"


@pytest.mark.parametrize("split", ["train", "validation"])
def test_streaming_reads_the_same_windows_as_a_loaded_dataset(tmp_path, rng, split):
    # Two files make a two-shard stream, which split_dataset_by_node would hand out a file per rank
    # unless told to split by example.
    texts = random_texts(rng, 25)
    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "a.jsonl", texts[:12])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", texts[12:])
    for rank in range(2):
        streams = []
        for streaming in (False, True):
            documents = load_documents(str(tmp_path / "corpus"), split, streaming=streaming, val_every=3,
                                       cache_dir=tmp_path / "cache")
            windows = TokenWindows(documents, BYTE, 9, rank, 2)
            streams.append(read_tokens(windows, 150))
        assert windows.state_dict()["epoch"] >= 4  # later epochs must not reorder a stream
        assert streams[0] == streams[1]


def test_synthetic_tokens_are_deterministic_per_rank_and_resume(rng):
    vocab_size, seq_len, seed = rng.randint(2, 1000), rng.randint(1, 64), rng.randrange(2**31)

    def windows(rank: int, count: int, source: SyntheticTokens | None = None) -> list[torch.Tensor]:
        source = source or SyntheticTokens(vocab_size, seq_len, seed, dp_rank=rank)
        out = []
        for _ in range(count):
            inputs, labels = next(source)
            assert inputs.shape == labels.shape == (seq_len,) and inputs.dtype == torch.long
            assert torch.equal(labels[:-1], inputs[1:])
            out.append(torch.cat([inputs, labels[-1:]]))
        return out

    run = windows(0, 10)
    assert all(w.min() >= 0 and w.max() < vocab_size for w in run)
    assert all(torch.equal(a, b) for a, b in zip(run, windows(0, 10)))
    assert not all(torch.equal(a, b) for a, b in zip(run, windows(1, 10)))
    assert not torch.equal(run[0], run[1])

    source = SyntheticTokens(vocab_size, seq_len, seed)
    windows(0, 4, source)
    state = plain(source.state_dict())
    resumed = SyntheticTokens(vocab_size, seq_len, seed)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(windows(0, 6, resumed), run[4:]))

    batches = Batches(SyntheticTokens(vocab_size, seq_len, seed), local_batch_size=5)
    inputs, labels = next(batches)
    assert inputs.shape == labels.shape == (5, seq_len)
    assert torch.equal(torch.cat([inputs, labels[:, -1:]], dim=1), torch.stack(run[:5]))


def test_token_ids_beyond_the_model_vocab_are_refused():
    documents = datasets.Dataset.from_dict({"text": ["abc", "xyz"]})
    with pytest.raises(ValueError, match=r"token id 256 .* vocab size 200"):
        next(TokenWindows(documents, BYTE, 4, max_token_id=200))
    next(TokenWindows(documents, BYTE, 4, max_token_id=BYTE.vocab_size))


def test_synthetic_batches_do_not_depend_on_the_data_parallel_layout(rng):
    """2 ranks x local batch 2 see exactly the windows of 1 rank x local batch 4, step by step."""
    vocab_size, seq_len, seed = rng.randint(2, 1000), rng.randint(1, 32), rng.randrange(2**31)
    one = Batches(SyntheticTokens(vocab_size, seq_len, seed, 0, 1, 4), 4)
    two = [Batches(SyntheticTokens(vocab_size, seq_len, seed, r, 2, 2), 2) for r in (0, 1)]
    for _ in range(3):
        inputs, _ = next(one)
        parts = torch.cat([next(b)[0] for b in two])
        assert torch.equal(inputs, parts)


def test_a_stream_that_leaves_a_rank_no_document_is_a_users_error(tmp_path):
    """One document, held out for validation: the stream's training share is empty. It was a
    plain ValueError from the data thread, a traceback that named no cause."""
    from components.data.windows import EmptyStreamShare
    path = write_jsonl(tmp_path / "one.jsonl", ["only one document"])
    batches = build_data(Data(source=str(path), streaming=True, cache_dir=str(tmp_path / "cache")),
                         Training(seq_len=8, local_batch_size=1), split="train", tokenizer=BYTE)
    with pytest.raises(EmptyStreamShare, match="gets no documents from the stream .* a source of "
                       "one document leaves none to train on") as error:
        next(iter(batches))
    assert error.value.user_error
    batches.close()
