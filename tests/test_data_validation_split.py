"""The held-out validation split of a text source: every val_every-th document (none for
val_every = 0), disjoint from train, or the train/validation splits a folder is laid out in."""

import json

import pytest

from components.data.sources import load_documents
from test_data_windows import random_texts, write_jsonl


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


def test_a_source_of_one_document_says_it_is_held_out(tmp_path):
    """The train split was empty and TokenWindows said 'there are only 0 (for a held-out validation
    split, a smaller [data] val_every holds out more)': the wrong split and advice."""
    path = write_jsonl(tmp_path / "one.jsonl", ["the only document"])
    with pytest.raises(ValueError, match=r"one\.jsonl: no training documents: it has one, and document 0 "
                                         r"always goes to the held-out validation split"):
        load_documents(str(path), "train", cache_dir=tmp_path / "cache")
    validation = load_documents(str(path), "validation", cache_dir=tmp_path / "cache")
    assert [d["text"] for d in validation] == ["the only document"]


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
