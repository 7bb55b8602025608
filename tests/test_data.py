"""Documents become consecutive token windows, shared disjointly between ranks, resumable exactly."""

import functools
import json
import logging
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from components.config.schema import Data, Training
from components.data import checks as data_check, windows as data_windows
from components.data.build import build_data
from components.data.checks import BadDocumentError, MissingTextField
from components.data.sources import STDLIB_CORPUS_BYTES, embedded_corpus, load_documents
from components.data.windows import Batches, DataStateMismatch, SyntheticTokens, TokenWindows
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


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_continues_exactly_across_epochs(tmp_path, rng, streaming):
    path = write_jsonl(tmp_path / "docs.jsonl", random_texts(rng, 7, max_length=30))
    documents = load_documents(str(path), "train", streaming=streaming, cache_dir=tmp_path / "cache")

    def fresh() -> Batches:
        return Batches(TokenWindows(documents, BYTE, seq_len=8, dp_rank=1, dp_world=2), local_batch_size=2)

    reference = fresh()
    states, batches = [], []
    for _ in range(16):
        states.append(plain(reference.state_dict()))
        batches.append(next(reference))
    assert max(s["epoch"] for s in states) >= 2, "the run must cross epoch boundaries"
    assert any(s["token_offset"] > 0 for s in states), "some batch must end inside a document"

    for k in range(len(states) - 3):
        resumed = fresh()
        resumed.load_state_dict(states[k])
        for n in range(k, k + 3):
            inputs, labels = next(resumed)
            assert torch.equal(inputs, batches[n][0]) and torch.equal(labels, batches[n][1]), (k, n)

    # Loading into a source that has read ahead must drop what it had buffered.
    reference.load_state_dict(states[5])
    assert torch.equal(next(reference)[0], batches[5][0])


def test_state_of_another_rank_is_refused(tmp_path, rng):
    documents = datasets.Dataset.from_dict({"text": random_texts(rng, 6)})
    state = TokenWindows(documents, BYTE, 4, dp_rank=0, dp_world=2).state_dict()
    with pytest.raises(ValueError, match="saved by rank 0 of 2, this is rank 1 of 2"):
        TokenWindows(documents, BYTE, 4, dp_rank=1, dp_world=2).load_state_dict(state)


def test_state_of_other_documents_is_refused_and_a_misfit_position_is_one_line(rng):
    """A state saved under another val_every (or text_field) points into other documents: refused
    at load (the checkpoint then warns and reads from the start). A position that does not fit
    the documents (a changed source) was a traceback from the data thread at the first batch; it
    is an error the trainer shows as one line."""
    texts = [t + "x" * 40 for t in random_texts(rng, 6)]  # each longer than the offset below
    documents = datasets.Dataset.from_dict({"text": texts})
    windows = TokenWindows(documents, BYTE, 9, selection={"val_every": 10})
    next(windows)
    state = plain(windows.state_dict())
    assert state["token_offset"] == 10 and state["selection"] == {"text_field": "text",
                                                                  "val_every": 10}
    with pytest.raises(ValueError, match=r"saved reading other documents \(\[data\] val_every "
                                         r"10 -> 7\)"):
        TokenWindows(documents, BYTE, 9, selection={"val_every": 7}).load_state_dict(state)
    unselected = dict(state)
    del unselected["selection"]  # a state saved before the selection was kept: loads
    TokenWindows(documents, BYTE, 9, selection={"val_every": 10}).load_state_dict(unselected)

    other = TokenWindows(datasets.Dataset.from_dict({"text": ["ab"] * 6}), BYTE, 9,
                         selection={"val_every": 10})
    other.load_state_dict(state)
    with pytest.raises(DataStateMismatch, match=r"document 0 of epoch 0 on rank 0 has 4 tokens, "
                                                r"the state points at token 10. Has \[data\] source"):
        next(other)
    assert DataStateMismatch.user_error


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


@pytest.mark.parametrize("streaming", [False, True])
def test_validation_split_is_held_out_from_train(tmp_path, rng, streaming):
    texts = random_texts(rng, 20)
    path = write_jsonl(tmp_path / "docs.jsonl", texts)
    split_texts = {}
    for split in ("train", "validation"):
        documents = load_documents(str(path), split, streaming=streaming, val_every=3,
                                   cache_dir=tmp_path / "cache")
        split_texts[split] = [d["text"] for d in documents]
    assert split_texts["validation"] == texts[::3]
    assert not set(split_texts["validation"]) & set(split_texts["train"])
    assert sorted(split_texts["validation"] + split_texts["train"]) == sorted(texts)


def test_stdlib_corpus_builds_offline_once_and_yields_windows(tmp_path):
    path = embedded_corpus(tmp_path / "a")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    paths = [r["path"] for r in rows]
    assert paths == sorted(paths)
    assert not any(set(p.split("/")) & {"site-packages", "test", "tests", "idlelib"} for p in paths)
    text_bytes = sum(len(r["text"].encode("utf-8")) for r in rows)
    assert 0.9 * STDLIB_CORPUS_BYTES < text_bytes <= STDLIB_CORPUS_BYTES

    modified = path.stat().st_mtime_ns
    assert embedded_corpus(tmp_path / "a") == path and path.stat().st_mtime_ns == modified
    assert embedded_corpus(tmp_path / "b").read_bytes() == path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir() if p.is_file()) == [path.name]  # no temp file

    seq_len = 32
    stdlib = Data(source="stdlib", cache_dir=str(tmp_path / "a"), num_workers=0)
    batches = build_data(stdlib, Training(seq_len=seq_len, local_batch_size=3), split="train",
                         tokenizer=BYTE, max_token_id=BYTE.vocab_size)
    inputs, labels = next(batches)
    assert inputs.shape == labels.shape == (3, seq_len)
    expected = framed([r["text"] for i, r in enumerate(rows[:100]) if i % 100])[:3 * (seq_len + 1)]
    assert torch.cat([inputs, labels[:, -1:]], dim=1).flatten().tolist() == expected

    validation = build_data(stdlib, Training(seq_len=seq_len, local_batch_size=2),
                            split="validation", tokenizer=BYTE)
    assert next(validation)[0].tolist()[0][:seq_len] == framed([rows[0]["text"]])[:seq_len]


def test_token_ids_beyond_the_model_vocab_are_refused():
    documents = datasets.Dataset.from_dict({"text": ["abc", "xyz"]})
    with pytest.raises(ValueError, match=r"token id 256 .* vocab size 200"):
        next(TokenWindows(documents, BYTE, 4, max_token_id=200))
    next(TokenWindows(documents, BYTE, 4, max_token_id=BYTE.vocab_size))


def test_parquet_with_another_text_field(tmp_path, rng):
    texts = random_texts(rng, 10)
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "content": texts}), path)
    documents = load_documents(str(path), "train", text_field="content", val_every=2,
                               cache_dir=tmp_path / "cache")
    assert [d["content"] for d in documents] == texts[1::2]
    assert read_tokens(TokenWindows(documents, BYTE, 5, text_field="content"), 3) == framed(texts[1::2])[:18]

    with pytest.raises(MissingTextField, match=r"no field 'text' \(their fields: id, content\)"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache")


def test_text_file_gives_one_document_per_paragraph(tmp_path, rng):
    paragraphs = ["\n".join(random_texts(rng, rng.randint(1, 3))) for _ in range(8)]
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(paragraphs), encoding="utf-8")
    documents = load_documents(str(path), "train", val_every=4, cache_dir=tmp_path / "cache")
    assert [d["text"] for d in documents] == [p for i, p in enumerate(paragraphs) if i % 4]


def test_directory_of_files_in_name_order(tmp_path, rng):
    texts = random_texts(rng, 9)
    folder = tmp_path / "corpus"
    (folder / "part").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    write_jsonl(folder / "b.jsonl", texts[5:])
    write_jsonl(folder / "part" / "a.jsonl", texts[:5])  # "b.jsonl" < "part/a.jsonl"
    write_jsonl(folder / ".hidden" / "stale.jsonl", ["never read"])
    documents = load_documents(str(folder), "train", val_every=1000, cache_dir=tmp_path / "cache")
    assert [d["text"] for d in documents] == (texts[5:] + texts[:5])[1:]

    (folder / "notes.txt").write_text("a paragraph", encoding="utf-8")
    with pytest.raises(ValueError, match=r"corpus: mixes file types \.jsonl, \.txt"):
        load_documents(str(folder), "train", cache_dir=tmp_path / "cache")


def test_bad_sources_and_fields_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing/docs.jsonl"):
        load_documents(str(tmp_path / "missing" / "docs.jsonl"), "train", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="val_every=1"):
        load_documents("stdlib", "train", val_every=1, cache_dir=tmp_path)
    path = write_jsonl(tmp_path / "docs.jsonl", ["a", "b"])
    with pytest.raises(ValueError, match=r"no split 'test' \(it has train\)"):
        load_documents(str(path), "test", cache_dir=tmp_path)

    documents = datasets.Dataset.from_dict({"body": ["x", "y"]})
    with pytest.raises(MissingTextField, match=r"document 0 has no field 'text' \(its fields: body\)"):
        next(TokenWindows(documents, BYTE, 4))
    with pytest.raises(ValueError, match="rank 2 of 3 gets no documents: there are only 2"):
        TokenWindows(documents, BYTE, 4, dp_rank=2, dp_world=3, text_field="body")


def test_hub_name_offline_says_what_to_use_instead(tmp_path):
    # The Hub client reads its offline switch at import, so this runs in a fresh interpreter; offline it
    # fails at once instead of retrying the network.
    code = ("from components.data.sources import load_documents\n"
            "try:\n"
            "    load_documents('nobody/no-such-dataset', 'train')\n"
            "except ValueError as err:\n"
            "    print(err)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert "could not load data source 'nobody/no-such-dataset'" in result.stdout, result.stderr
    assert "network access" in result.stdout and '"stdlib"' in result.stdout


def test_synthetic_batches_do_not_depend_on_the_data_parallel_layout(rng):
    """2 ranks x local batch 2 see exactly the windows of 1 rank x local batch 4, step by step."""
    vocab_size, seq_len, seed = rng.randint(2, 1000), rng.randint(1, 32), rng.randrange(2**31)
    one = Batches(SyntheticTokens(vocab_size, seq_len, seed, 0, 1, 4), 4)
    two = [Batches(SyntheticTokens(vocab_size, seq_len, seed, r, 2, 2), 2) for r in (0, 1)]
    for _ in range(3):
        inputs, _ = next(one)
        parts = torch.cat([next(b)[0] for b in two])
        assert torch.equal(inputs, parts)


def documents_read(documents, count: int) -> list[str]:
    """The first `count` documents a TokenWindows reads, as text."""
    tokens = read_tokens(TokenWindows(documents, BYTE, 7), len(framed(["x"] * count)) * 50)
    return split_documents(tokens)


def bad_jsonl(tmp_path: Path, rng) -> tuple[Path, list[str], dict[int, str]]:
    """A .jsonl of good documents with bad ones in the middle: the path, the good texts in order and
    {line number: what is wrong with it}."""
    texts = random_texts(rng, 12)
    lines = [json.dumps({"text": t}, ensure_ascii=False).encode() for t in texts]
    bad = {4: (b'{"text": "caf\xe9 au lait"}', r"not UTF-8 \(byte 0xe9 at column 14\)"),  # Latin-1
           7: (b'{"text": "cut off', r"invalid JSON: Unterminated string starting \(column 10\)"),
           9: (b'["text", "an array"]', "a JSON array, not an object"),
           12: (b'{"text": null}', "field 'text' holds a JSON null, not text"),
           13: (b'{"body": "elsewhere"}', r"no field 'text' \(its fields: body\)")}
    for number in sorted(bad):
        lines.insert(number - 1, bad[number][0])
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, texts, {number: why for number, (_, why) in bad.items()}


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_documents_are_named_or_skipped(tmp_path, rng, caplog, streaming):
    """A non-UTF-8 document killed the run when it was reached (and after every resume) with a bare
    UnicodeDecodeError; a malformed line failed the whole file. Now "error" names the first bad one
    before anything is read, and "skip" reads exactly the good documents, naming each skipped one."""
    path, texts, bad = bad_jsonl(tmp_path, rng)
    def load(split="train", **kwargs):
        return load_documents(str(path), split, streaming=streaming, val_every=1000,
                              cache_dir=tmp_path / "cache", **kwargs)
    first = rf"^{re.escape(str(path))}: line 4: {bad[4]}; 5 bad document\(s\) in this file\. "
    with pytest.raises(BadDocumentError, match=first + r"Set \[data\] on_bad_document = \"skip\""):
        load()
    with caplog.at_level(logging.WARNING):
        documents = load(on_bad_document="skip")
    assert documents_read(documents, len(texts))[:len(texts) - 1] == texts[1:]  # 0 is held out
    warnings = [r.getMessage() for r in caplog.records]
    for number, why in bad.items():
        named = rf"data: skipped a bad document: {re.escape(str(path))}: line {number}: {why}"
        assert any(re.fullmatch(named, w) for w in warnings), (number, warnings)
    assert warnings[-1] == 'data: skipped 5 bad document(s) in 1 file(s) ([data] on_bad_document = "skip")'
    validation = load(split="validation", on_bad_document="skip")
    assert documents_read(validation, 1)[0] == texts[0]


def test_an_escaped_lone_surrogate_is_a_named_bad_document(tmp_path):
    """'\\ud83d' alone is valid JSON but no text: the check passed it, then pyarrow failed the whole
    file with a DatasetGenerationError naming neither file nor line."""
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "held out"}\n{"text": "a"}\n{"text": "cut \\ud83d emoji"}\n{"text": "b"}\n')
    load = functools.partial(load_documents, str(path), "train", val_every=1000,
                             cache_dir=tmp_path / "cache")
    with pytest.raises(BadDocumentError, match=rf"^{re.escape(str(path))}: line 3: field 'text' holds a lone "
                                               r"surrogate \(\\ud83d at character 4\), not UTF-8 text; 1 bad"):
        load()
    assert [d["text"] for d in load(on_bad_document="skip")] == ["a", "b"]
    array = tmp_path / "docs.json"  # a JSON array: a bare UnicodeEncodeError while checking it
    array.write_text('[{"text": "held out"}, {"text": "a"}, {"text": "cut \\ud83d emoji"}, {"text": "b"}]')
    with pytest.raises(BadDocumentError, match=r"docs\.json: element \[2\] of the array: field 'text' holds "
                                               r"a lone surrogate"):
        load_documents(str(array), "train", val_every=1000, cache_dir=tmp_path / "cache")
    skipped = load_documents(str(array), "train", val_every=1000, cache_dir=tmp_path / "cache",
                             on_bad_document="skip")
    assert [d["text"] for d in skipped] == ["a", "b"]


def test_checked_files_are_read_once_until_they_change(tmp_path, rng, monkeypatch):
    path, texts, _ = bad_jsonl(tmp_path, rng)
    load = functools.partial(load_documents, str(path), "train", val_every=1000, cache_dir=tmp_path / "cache",
                             on_bad_document="skip")
    load()

    def read_again(*args, **kwargs):
        raise AssertionError("read again")
    monkeypatch.setattr(data_check, "_scan", read_again)
    assert documents_read(load(), len(texts))[:len(texts) - 1] == texts[1:]  # from the cache
    path.write_bytes(path.read_bytes() + json.dumps({"text": "one more"}).encode() + b"\n")
    with pytest.raises(AssertionError, match="read again"):
        load()


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_paragraph_of_a_text_file(tmp_path, rng, streaming):
    paragraphs = [t.replace("\n", " ") for t in random_texts(rng, 6)]
    raw = [p.encode() for p in paragraphs]
    raw.insert(3, b"line one\nline tw\xff")  # the fourth paragraph, lines 7 and 8
    path = tmp_path / "notes.txt"
    path.write_bytes(b"\r\n\r\n".join(raw) + b"\n")  # universal newlines, as datasets reads
    load = functools.partial(load_documents, str(path), "train", streaming=streaming, val_every=1000,
                             cache_dir=tmp_path / "cache")
    where = r"line 8 \(in the paragraph from line 7\): not UTF-8 \(byte 0xff at column 8\)"
    with pytest.raises(BadDocumentError, match=rf"^{re.escape(str(path))}: {where}; 1 bad document"):
        load()
    got = documents_read(load(on_bad_document="skip"), 5)
    assert got[:4] == paragraphs[1:5] and got[4] == paragraphs[5] + "\n"


def test_json_array_file(tmp_path):
    path = tmp_path / "docs.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": "b"}, 3, {"text": "d"}, {"text": "e"}]))
    with pytest.raises(BadDocumentError, match=r"docs\.json: element \[2\] of the array: a JSON number, not "
                                               r"an object; 1 bad document"):
        load_documents(str(path), "train", val_every=2, cache_dir=tmp_path / "cache")
    documents = load_documents(str(path), "train", val_every=2, cache_dir=tmp_path / "cache",
                               on_bad_document="skip")
    assert [d["text"] for d in documents] == ["b", "e"]  # a, b, d, e: every second one held out
    path.write_bytes(b'[{"text": "a"},\n {"text": "\xff"}]')
    with pytest.raises(BadDocumentError, match=r"line 2: not UTF-8 .*; a JSON array is read as one piece, so "
                                               r"nothing in it can be skipped"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache", on_bad_document="skip")


@pytest.mark.parametrize("name,content,why", [
    ("empty.jsonl", b"", "the file is empty"),  # was a bare StopIteration
    ("blank.jsonl", b"\n  \n\n", "only blank lines"),
    ("empty.txt", b"", "the file is empty"),  # was a DatasetGenerationError
    ("empty.json", b" [ ]", "an empty JSON array"),
    ("bad.jsonl", b"\xff\n", "all 1 were bad and skipped"),
])
def test_a_source_without_documents_is_named(tmp_path, name, content, why):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^no documents in {re.escape(str(path))} \({why}\)$"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache", on_bad_document="skip")


def test_a_source_of_one_document_says_it_is_held_out(tmp_path):
    """The train split was empty and TokenWindows said 'there are only 0 (for a held-out validation
    split, a smaller [data] val_every holds out more)': the wrong split and advice."""
    path = write_jsonl(tmp_path / "one.jsonl", ["the only document"])
    with pytest.raises(ValueError, match=r"one\.jsonl: no training documents: it has one, and document 0 "
                                         r"always goes to the held-out validation split"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache")
    validation = load_documents(str(path), "validation", cache_dir=tmp_path / "cache")
    assert [d["text"] for d in validation] == ["the only document"]


def test_an_empty_file_among_others_is_a_warning(tmp_path, caplog):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b"")
    write_jsonl(folder / "b.jsonl", ["x", "y", "z"])
    with caplog.at_level(logging.WARNING):
        documents = load_documents(str(folder), "train", val_every=2, cache_dir=tmp_path / "cache")
    assert [d["text"] for d in documents] == ["y"]
    assert f"data: {folder / 'a.jsonl'} holds no documents (the file is empty)" in caplog.messages
    with pytest.raises(MissingTextField, match=r"b\.jsonl: the documents have no field 'body' "
                                               r"\(their fields: text\); set \[data\] text_field"):
        load_documents(str(folder), "train", text_field="body", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("streaming", [False, True])
def test_tokenizer_workers_give_the_same_windows_and_resume(tmp_path, rng, monkeypatch, streaming):
    """num_workers > 0 tokenizes in worker processes ahead of the loop: the same windows and states
    as on the calling thread, across batches of documents, epochs and resumes; close() ends them."""
    monkeypatch.setattr(data_windows, "DOCUMENTS_PER_TASK", 3)  # many batches of documents per epoch
    path = write_jsonl(tmp_path / "docs.jsonl", random_texts(rng, 50, max_length=30))
    documents = load_documents(str(path), "train", streaming=streaming, val_every=5,
                               cache_dir=tmp_path / "cache")

    def fresh(workers: int) -> Batches:
        return Batches(TokenWindows(documents, BYTE, seq_len=9, dp_rank=1, dp_world=2, num_workers=workers),
                       local_batch_size=3)

    children = set(multiprocessing.active_children())
    inline, pooled = fresh(0), fresh(2)
    states, batches = [], []
    while len(states) < 40 or states[-1]["epoch"] < 2:  # a random corpus: epochs vary in length
        assert len(states) < 1000, "two epochs never came"
        states.append(plain(pooled.state_dict()))
        assert states[-1] == plain(inline.state_dict())
        batches.append(next(pooled))
        expected = next(inline)
        assert torch.equal(batches[-1][0], expected[0]) and torch.equal(batches[-1][1], expected[1])
    for k in rng.sample(range(len(states) - 3), 3):
        pooled.load_state_dict(states[k])
        for n in range(k, k + 3):
            assert torch.equal(next(pooled)[0], batches[n][0]), (k, n)
    assert len(set(multiprocessing.active_children()) - children) == 2
    pooled.close()
    assert not set(multiprocessing.active_children()) - children


def test_errors_in_tokenizer_workers_reach_the_training_loop():
    documents = datasets.Dataset.from_dict({"text": ["abc", None, "xyz"]})
    windows = TokenWindows(documents, BYTE, 4, num_workers=1)
    with pytest.raises(TypeError, match="document 1: field 'text' holds NoneType, not text"):
        next(windows)
    windows.close()
    windows = TokenWindows(datasets.Dataset.from_dict({"text": ["abc", "xyz"]}), BYTE, 4, max_token_id=200,
                           num_workers=1)
    with pytest.raises(ValueError, match=r"document 0: token id 256 .* vocab size 200"):
        next(windows)
    windows.close()


def test_a_tokenizer_worker_that_dies_is_an_error_not_a_hang(rng, monkeypatch):
    monkeypatch.setattr(data_windows, "DOCUMENTS_PER_TASK", 2)
    children = set(multiprocessing.active_children())
    windows = TokenWindows(datasets.Dataset.from_dict({"text": random_texts(rng, 200)}), BYTE, 8, num_workers=1)
    next(windows)
    (worker,) = set(multiprocessing.active_children()) - children
    os.kill(worker.pid, signal.SIGKILL)
    signal.alarm(120)  # a hang fails the test instead of the whole run
    try:
        with pytest.raises(RuntimeError, match="a tokenizer worker process died"):
            for _ in range(2000):
                next(windows)
    finally:
        signal.alarm(0)
    windows.close()


@pytest.mark.parametrize("streaming", [False, True])
def test_a_state_past_the_end_of_the_documents_is_named(tmp_path, rng, streaming):
    """A checkpoint's data state that points past this rank's documents (the source shrank) is an
    error; a stream started a new epoch without a word. A state exactly at the end is the next
    epoch's start."""
    path = write_jsonl(tmp_path / "docs.jsonl", random_texts(rng, 12))
    load = lambda streaming: load_documents(str(path), "train", streaming=streaming,  # noqa: E731
                                            val_every=4, cache_dir=tmp_path / "cache")
    share = len(load(False)) // 2  # rank 1 of 2 reads training documents 1, 3, 5, ...
    documents = load(streaming)

    def resumed(document: int) -> TokenWindows:
        windows = TokenWindows(documents, BYTE, seq_len=4, dp_rank=1, dp_world=2)
        windows.load_state_dict({"epoch": 0, "document": document, "token_offset": 0,
                                 "dp_rank": 1, "dp_world": 2})
        next(windows)
        return windows

    with pytest.raises(ValueError, match=rf"data state points at document {share + 1}\b"):
        resumed(share + 1)
    assert resumed(share).state_dict()["epoch"] == 1


@pytest.mark.parametrize("bars_were_off", [False, True])
def test_local_files_load_without_datasets_progress_bar(tmp_path, capfd, bars_were_off):
    """datasets drew "Generating train split" into the training log when a file first went
    into its Arrow cache; the bars are off for that call only, as they were before it."""
    before = datasets.are_progress_bars_disabled()
    (datasets.disable_progress_bars if bars_were_off else datasets.enable_progress_bars)()
    try:
        corpus = write_jsonl(tmp_path / "corpus.jsonl", ["one", "two", "three"])
        documents = load_documents(str(corpus), "train", val_every=2,
                                   cache_dir=tmp_path / "cache")
        assert documents["text"] == ["two"]
        assert "Generating" not in capfd.readouterr().err
        assert datasets.are_progress_bars_disabled() == bars_were_off
    finally:
        (datasets.disable_progress_bars if before else datasets.enable_progress_bars)()


class _FinalizedIn:
    """Cyclic garbage whose finalizer records the process that ran it."""

    def __init__(self, path):
        self.path, self.me = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def _collect():
    import gc
    gc.collect()


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")
@pytest.mark.parametrize("frozen", [True, False])
def test_forked_workers_do_not_finalize_what_they_inherit(tmp_path, frozen):
    """A forked tokenizer worker that garbage-collected its parent's objects ran their
    finalizers without the parent's threads, and a telemetry library's aborted the worker
    (prepare_data: "a worker process died"). Forked under `inherited_objects_frozen` it leaves
    them alone; the unfrozen run shows the test can tell."""
    import contextlib
    import gc
    from components.data.document_tokens import inherited_objects_frozen, worker_context
    marks = tmp_path / "finalized"
    marks.touch()
    gc.disable()  # the garbage must still exist when the worker is forked
    try:
        _FinalizedIn(marks)
        child = worker_context().Process(target=_collect)
        with inherited_objects_frozen() if frozen else contextlib.nullcontext():
            child.start()
        child.join(60)
    finally:
        gc.enable()
        gc.collect()
    by = marks.read_text().split()
    assert (str(child.pid) in by) is not frozen and str(os.getpid()) in by


@pytest.mark.parametrize("layout", ["folders", "files"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_folder_laid_out_in_splits_keeps_them_apart(tmp_path, layout, streaming):
    """train/ and validation/ (or train.jsonl, validation.jsonl, test.jsonl), as `datasets`
    reads a folder: all went into one training corpus, the validation documents trained on and
    a held-out split drawn from the mixture, the test split trained on too."""
    corpus = tmp_path / "corpus"
    texts = {"train": [f"train doc {i}" for i in range(12)],
             "validation": [f"validation doc {i}" for i in range(5)],
             "test": [f"test doc {i}" for i in range(4)]}
    for split, docs in texts.items():
        path = corpus / split / "part-0.jsonl" if layout == "folders" else corpus / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    read = {split: [d["text"] for d in load_documents(str(corpus), split, streaming=streaming,
                                                      cache_dir=tmp_path / "cache")]
            for split in ("train", "validation")}
    assert read == {"train": texts["train"], "validation": texts["validation"]}
    # a file outside the layout's splits is named, not trained on or dropped unsaid
    (corpus / "stray.jsonl").write_text(json.dumps({"text": "stray"}) + "\n")
    with pytest.raises(ValueError, match=r"laid out in splits \(.*\), but .*stray\.jsonl is in "
                       "none of them"):
        load_documents(str(corpus), "train", cache_dir=tmp_path / "cache")


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


@pytest.mark.parametrize("encoding", ["dictionary", "string_view"])
def test_a_parquet_text_column_dictionary_encoded_or_a_view_is_text(tmp_path, encoding):
    """A pandas category column (dictionary<string>) or a string_view one: `datasets` and
    prepare_data read them as text, the trainer refused them ("holds dictionary<...>, not text").
    Their empty texts are still found."""
    texts = ["alpha beta", "gamma", "", "delta epsilon", "alpha beta"]
    column = pa.array(texts)
    column = column.dictionary_encode() if encoding == "dictionary" else column.cast(pa.string_view())
    pq.write_table(pa.table({"text": column}), tmp_path / "c.parquet")
    with pytest.raises(BadDocumentError, match=r"row 2: field 'text' is empty"):
        load_documents(str(tmp_path / "c.parquet"), "train", cache_dir=tmp_path / "cache")
    documents = load_documents(str(tmp_path / "c.parquet"), "train", cache_dir=tmp_path / "cache",
                               on_bad_document="skip")
    assert [d["text"] for d in documents] == ["gamma", "delta epsilon", "alpha beta"]



@pytest.mark.parametrize("streaming", [False, True])
def test_val_every_0_holds_no_document_out(tmp_path, streaming):
    """With validation off, every 100th document was still held out of training, and a source of
    one document could not train at all ([data] val_every had to be >= 2)."""
    path = write_jsonl(tmp_path / "docs.jsonl", [f"document {i}" for i in range(5)])
    documents = load_documents(str(path), "train", streaming=streaming, val_every=0,
                               cache_dir=tmp_path / "cache")
    assert [d["text"] for d in documents] == [f"document {i}" for i in range(5)]
    with pytest.raises(ValueError, match=r"no validation split, and \[data\] val_every = 0 holds "
                       r"no document out for one: set \[validation\] enable = false"):
        load_documents(str(path), "validation", streaming=streaming, val_every=0,
                       cache_dir=tmp_path / "cache")


def _jsonl_with(path: Path, texts: list[str], fields) -> None:
    path.write_text("".join(json.dumps({"text": t, **fields(i)}) + "\n"
                            for i, t in enumerate(texts)))


@pytest.mark.parametrize("streaming", [False, True])
def test_files_whose_other_fields_differ_are_read_for_their_text(tmp_path, rng, streaming):
    """Per-file metadata (an id in one file, a repo in another): `datasets` loads files together
    only when their fields agree, and the trainer died with a CastError traceback."""
    texts = random_texts(rng, 30)
    folder = tmp_path / "mixed"
    folder.mkdir()
    _jsonl_with(folder / "a_web.jsonl", texts[:10], lambda i: {"id": i})
    _jsonl_with(folder / "b_code.jsonl", texts[10:20],
                lambda i: {"repo": "x/y", "meta": {"stars": i}})
    _jsonl_with(folder / "c_web.jsonl", texts[20:], lambda i: {"id": i})
    for split, expected in (("validation", texts[::4]),
                            ("train", [t for i, t in enumerate(texts) if i % 4])):
        documents = load_documents(str(folder), split, streaming=streaming, val_every=4,
                                   cache_dir=tmp_path / "cache")
        assert [d["text"] for d in documents] == expected, split
    count = len(framed(expected)) // 9
    assert read_tokens(TokenWindows(documents, BYTE, 8), count) == framed(expected)[:count * 9]

    parquet = tmp_path / "parquet"
    parquet.mkdir()
    pq.write_table(pa.table({"text": texts[:10], "id": list(range(10))}), parquet / "a.parquet")
    pq.write_table(pa.table({"text": texts[10:], "repo": ["x/y"] * 20}), parquet / "b.parquet")
    documents = load_documents(str(parquet), "train", streaming=streaming, val_every=0,
                               cache_dir=tmp_path / "cache")
    assert [d["text"] for d in documents] == texts


def test_a_file_datasets_cannot_load_is_one_line_naming_it(tmp_path):
    """What check_files lets through and `datasets` still fails on (a field given twice) was a
    DatasetGenerationError traceback, naming no file."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ["one document", "another"])
    (folder / "b.jsonl").write_text('{"text": "a document", "text": "twice"}\n')
    with pytest.raises(ValueError) as error:
        load_documents(str(folder), "train", val_every=0, cache_dir=tmp_path / "cache")
    message = str(error.value)
    assert message.startswith(f"{folder / 'b.jsonl'}: `datasets` could not load it (ArrowInvalid:")
    assert "\n" not in message and error.value.user_error


def test_a_folder_of_token_shard_folders_says_to_name_one_or_mix_them(tmp_path):
    """It was read as text: "sh_a/index.json: line 1: invalid JSON ... Set [data]
    on_bad_document = "skip"", which leads nowhere."""
    from shard_cases import write_token_shards
    import numpy as np
    parent = tmp_path / "allshards"
    for name in ("sh_a", "sh_b"):
        write_token_shards(parent / name, [np.arange(40) % 250], BYTE.vocab_size, BYTE)
    data = Data(source=str(parent), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError) as error:
        build_data(data, Training(seq_len=8, local_batch_size=1), split="train", tokenizer=BYTE)
    assert str(error.value) == (
        f"{parent}: holds token shard folders made by scripts.prepare_data ({parent / 'sh_a'}, "
        f"{parent / 'sh_b'}), which are not text to read: set [data] source to one of them, or "
        "mix them by weight with [[data.mixture]] tables (source = ..., weight = ...) or "
        f"--data.mixture \"{parent / 'sh_a'}:1,{parent / 'sh_b'}:1\"")
    # one of them as the source is read as shards
    batches = build_data(Data(source=str(parent / "sh_a")), Training(seq_len=8, local_batch_size=1),
                         split="train", tokenizer=BYTE)
    assert next(iter(batches))[0].shape == (1, 8)
    batches.close()
