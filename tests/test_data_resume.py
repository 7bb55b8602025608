"""The data state of TokenWindows and Batches: a resume continues exactly, across epochs; a
state saved by another rank, for other documents or past their end is refused, named."""

import datasets
import pytest
import torch

from components.data.sources import load_documents
from components.data.windows import Batches, DataStateMismatch, TokenWindows
from test_data_windows import BYTE, plain, random_texts, write_jsonl


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
