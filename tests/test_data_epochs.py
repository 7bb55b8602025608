"""Training data that repeats is noted, once per epoch, on rank 0 (data/prefetch.py): the data
modules' logger.info lines said so where nothing configured logging, so nobody saw them."""

import json
import re

import numpy as np

from components.config.schema import Data, Training
from components.data.build import build_data
from components.tokenizer import ByteTokenizer
from shard_cases import write_token_shards

BYTE = ByteTokenizer()
NOTE = re.compile(r"note: data: (.+) is read to its end; epoch (\d+) starts: the training data repeats")


def _notes(out: str) -> list[tuple[str, int]]:
    return [(m[1], int(m[2])) for m in NOTE.finditer(out)]


def _corpus(tmp_path, count: int = 12):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(count)))
    return Data(source=str(path), cache_dir=str(tmp_path / "cache"), num_workers=0)


def test_each_epoch_of_a_text_source_is_noted_when_training_reaches_it(tmp_path, capsys):
    data = _corpus(tmp_path)
    batches = build_data(data, Training(seq_len=16, local_batch_size=2), split="train", tokenizer=BYTE)
    name, epoch = f"{data.source} (train)", 0
    for _ in range(40):
        next(batches)
        now = batches.state_dict()["epoch"]
        assert _notes(capsys.readouterr().out) == ([(name, now)] if now != epoch else [])
        epoch = now
    assert epoch >= 3
    batches.close()
    validation = build_data(data, Training(seq_len=16, local_batch_size=2), split="validation",
                            tokenizer=BYTE)
    for _ in range(5):  # the trainer warns of these itself
        next(validation)
    assert "note:" not in capsys.readouterr().out
    validation.close()


def test_a_resumed_run_notes_the_epochs_it_starts_and_other_ranks_none(tmp_path, capsys, monkeypatch):
    data, training = _corpus(tmp_path), Training(seq_len=16, local_batch_size=2)
    batches = build_data(data, training, split="train", tokenizer=BYTE)
    while batches.state_dict()["epoch"] < 2:
        next(batches)
    state = batches.state_dict()
    batches.close()
    capsys.readouterr()
    resumed = build_data(data, training, split="train", tokenizer=BYTE)
    resumed.load_state_dict(state)
    while resumed.state_dict()["epoch"] < 3:
        next(resumed)
    assert [epoch for _, epoch in _notes(capsys.readouterr().out)] == [3]
    resumed.close()
    monkeypatch.setenv("RANK", "1")
    other = build_data(data, training, split="train", tokenizer=BYTE)
    while other.state_dict()["epoch"] < 2:
        next(other)
    assert "note:" not in capsys.readouterr().out
    other.close()


def test_a_source_smaller_than_a_batch_is_noted_once(tmp_path, capsys):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"text": f"hi {i}"}) + "\n" for i in range(3)))
    data = Data(source=str(path), cache_dir=str(tmp_path / "cache"), num_workers=0)
    batches = build_data(data, Training(seq_len=32, local_batch_size=2), split="train", tokenizer=BYTE)
    for _ in range(5):
        next(batches)
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1 and "is read to its end several times a batch" in out
    batches.close()


def test_each_epoch_of_token_shards_is_noted(tmp_path, capsys):
    folder = write_token_shards(tmp_path / "shards", [np.arange(100) % 250], 256, BYTE)
    data = Data(source=str(folder), cache_dir=str(tmp_path / "cache"))
    seq_len, batch = 16, 2  # (100 - 1) // 16 = 6 windows an epoch
    batches = build_data(data, Training(seq_len=seq_len, local_batch_size=batch), split="train",
                         tokenizer=BYTE)
    noted = []
    for step in range(1, 11):
        next(batches)
        noted += [(step, epoch) for _, epoch in _notes(capsys.readouterr().out)]
    assert noted == [(4, 1), (7, 2), (10, 3)]  # windows 6, 12 and 18 begin epochs 1, 2 and 3
    batches.close()
