"""scripts/export_hf.py's tokenizer: transformers frames and scores text as training did, a
run's tokenizer is copied with its ids, and a tokenizer file replaced since training is refused."""

import json
from pathlib import Path

import pytest
import tokenizers
import torch

transformers = pytest.importorskip("transformers")

from components.config.schema import Data, Loss, Training  # noqa: E402
from components.data.build import build_data  # noqa: E402
from components.data.document_tokens import frame_texts  # noqa: E402
from components.loss import ModelWithLoss, TrainingLoss  # noqa: E402
from components.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from components.validation import evaluate  # noqa: E402
from models import FLAVORS, Llama  # noqa: E402
from parallelisms.context_parallel import NoSharding  # noqa: E402
from scripts import export_hf  # noqa: E402
from test_export_hf import (DEBUG, load_hf, sharp_model, train_checkpoints,  # noqa: E402
                            trainer_state)

DOCUMENTS = ["def f(x):\n    return x", "héllo, 日本 😀"]


def _bpe_tokenizer(folder: Path) -> HFTokenizer:
    """A user's own BPE, trained as docs/data.md shows: its tokenizer.json has no post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(DOCUMENTS * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return HFTokenizer(folder / "tokenizer.json")


def _project_loss(model: Llama, tokenizer, seq_len: int, tmp_path: Path) -> float:
    """The trainer's validation loss on the first window of DOCUMENTS (both held out)."""
    tmp_path.mkdir()
    corpus = tmp_path / "corpus.jsonl"
    rows = [DOCUMENTS[0], "a training document", DOCUMENTS[1]]  # val_every 2: 0 and 2 held out
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    data = Data(source=str(corpus), val_every=2, cache_dir=str(tmp_path / "cache"))
    batches = build_data(data, Training(seq_len=seq_len, local_batch_size=1), split="validation",
                         tokenizer=tokenizer, max_token_id=model.args.vocab_size)
    scored = ModelWithLoss(model, TrainingLoss(Loss(impl="unfused")))
    return evaluate(scored, batches, 1, torch.device("cpu"), shard=NoSharding())["val_loss"]


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_transformers_frames_text_and_scores_it_as_training_did(kind, tmp_path):
    """AutoTokenizer on the export puts bos first, and a pair is two documents joined as
    training joined them; the loss transformers computes on either is the project's validation
    loss on the same window. (A user's BPE without a post-processor got no bos.)"""
    tokenizer = ByteTokenizer() if kind == "byte" else _bpe_tokenizer(tmp_path / "tok")
    model = sharp_model(DEBUG)
    out = export_hf.export(trainer_state(model), DEBUG, tmp_path / "hf", "float32",
                           bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                           extra_files=export_hf.tokenizer_files(tokenizer, DEBUG.max_seq_len))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    framed = frame_texts(tokenizer, DOCUMENTS)[0].tolist()  # bos A eos bos B eos
    first = len(tokenizer.encode(DOCUMENTS[0])) + 1  # bos A
    assert hf_tokenizer(DOCUMENTS[0]).input_ids == framed[:first]
    assert hf_tokenizer(*DOCUMENTS).input_ids == framed[:-1]
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (tokenizer.bos_id,
                                                                      tokenizer.eos_id)

    hf_model = load_hf(out)
    for texts, length in ((DOCUMENTS[:1], first), (DOCUMENTS, len(framed) - 1)):
        ids = hf_tokenizer(*texts, return_tensors="pt").input_ids
        with torch.no_grad():
            theirs = hf_model(input_ids=ids, labels=ids).loss.item()
        ours = _project_loss(model, tokenizer, length - 1, tmp_path / str(len(texts)))
        assert theirs == pytest.approx(ours, abs=1e-5)


def test_a_tokenizers_own_framing_and_flags_give_way_to_trainings(tmp_path):
    """A post-processor that frames "<s> $A </s>" and a tokenizer_config.json with
    add_bos_token = false (transformers 5 would rebuild the framing from it): the export frames
    as training did, keeps the ByteLevel offsets processor, and names training's bos/eos."""
    from tokenizers import processors

    tokenizer = _bpe_tokenizer(tmp_path / "tok")
    raw = tokenizer._tokenizer
    raw.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0),
                                                                            ("</s>", 1)])])
    raw.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
         "add_eos_token": True, "bos_token": "<s>", "eos_token": "</s>"}))
    files = export_hf.tokenizer_files(HFTokenizer(tmp_path / "tok" / "tokenizer.json"), 64)
    (tmp_path / "hf").mkdir()
    for name, content in files.items():
        (tmp_path / "hf" / name).write_bytes(content)
    config = json.loads(files["tokenizer_config.json"])
    assert "add_bos_token" not in config and "add_eos_token" not in config
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    processor = json.loads(files["tokenizer.json"])["post_processor"]
    assert [p["type"] for p in processor["processors"]] == ["ByteLevel", "TemplateProcessing"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = frame_texts(tokenizer, DOCUMENTS[:1])[0].tolist()
    assert hf_tokenizer(DOCUMENTS[0]).input_ids == ids[:-1]


def test_truncation_and_padding_saved_in_the_tokenizer_are_off_in_the_export(tmp_path, capsys):
    """A tokenizer.json saved with truncation and padding on: the trainer turns both off (with a
    warning), but the export copied the file as it was, so transformers cut every text to 4 ids
    and padded the short ones. The export has both off, as training, and says so in one line."""
    path = _bpe_tokenizer(tmp_path / "tok").path
    raw = tokenizers.Tokenizer.from_file(str(path))
    raw.enable_truncation(max_length=4)
    raw.enable_padding(pad_id=raw.token_to_id("</s>"), pad_token="</s>", length=16)
    raw.save(str(path))
    with pytest.warns(UserWarning, match="both off here; documents are encoded whole"):
        tokenizer = HFTokenizer(path)
    files = export_hf.tokenizer_files(tokenizer, 64)
    assert capsys.readouterr().err == (
        f"export_hf: {path} sets truncation (max_length 4) and padding (length 16, with '</s>'): "
        "off in the exported tokenizer.json, as in training\n")
    exported = json.loads(files["tokenizer.json"])
    assert exported["truncation"] is None and exported["padding"] is None
    (tmp_path / "hf").mkdir()
    for name, content in files.items():
        (tmp_path / "hf" / name).write_bytes(content)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = frame_texts(tokenizer, DOCUMENTS)[0].tolist()  # bos A eos bos B eos
    first = len(tokenizer.encode(DOCUMENTS[0])) + 1
    assert first > 4 and hf_tokenizer(DOCUMENTS[0]).input_ids == ids[:first]
    assert hf_tokenizer("a").input_ids == [tokenizer.bos_id, *tokenizer.encode("a")]  # unpadded

    export_hf.tokenizer_files(_bpe_tokenizer(tmp_path / "plain"), 64)  # neither on: no line
    assert capsys.readouterr().err == ""


def test_a_runs_hf_tokenizer_is_copied_with_its_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["some text to learn from, twice or more"] * 20,
                                  trainers.BpeTrainer(
                                      vocab_size=300, special_tokens=["<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "special_tokens_map.json").write_text('{"bos_token": "<s>"}\n')
    folder = train_checkpoints(tmp_path / "run", "--tokenizer.name", "hf", "--tokenizer.path",
                               str(tmp_path / "tok" / "tokenizer.json"))
    out = tmp_path / "hf"
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(out)]) == 0
    # the same tokenizer, with training's framing as its post-processor
    copied, original = (json.loads((folder / "tokenizer.json").read_text())
                        for folder in (out, tmp_path / "tok"))
    assert copied.pop("post_processor")["single"][0] == {"SpecialToken": {"id": "<s>",
                                                                          "type_id": 0}}
    assert original.pop("post_processor") is None and copied == original
    assert json.loads((out / "special_tokens_map.json").read_text()) == {"bos_token": "<s>"}
    written = json.loads((out / "tokenizer_config.json").read_text())
    assert (written["bos_token"], written["eos_token"]) == ("<s>", "</s>")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    assert config["vocab_size"] == FLAVORS["debug"].vocab_size


def test_a_replaced_tokenizer_file_is_refused(tmp_path, capsys):
    """The run's [tokenizer] path (or --tokenizer) holding another vocabulary than the one
    trained with was exported without a word: ids that mean other tokens. generate and evaluate
    refused it already (train_state.json records the tokenizer's fingerprint)."""
    path = _bpe_tokenizer(tmp_path / "tok").path
    folder = train_checkpoints(tmp_path / "run", "--tokenizer.name", "hf", "--tokenizer.path",
                               str(path))
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two tokens' ids swapped
    other = tmp_path / "other.json"
    other.write_text(json.dumps(spec))
    for given in (["--tokenizer", str(other)], []):
        if not given:
            path.write_bytes(other.read_bytes())  # the run's own file replaced since
        out = tmp_path / f"hf{len(given)}"
        assert export_hf.main(["--checkpoint", str(folder), "--out", str(out), *given]) == 1
        assert ("ids as the run's tokenizer had, but other tokens or bos/eos ids: the model's ids "
                "would mean other tokens") in capsys.readouterr().err
        assert not out.exists()
