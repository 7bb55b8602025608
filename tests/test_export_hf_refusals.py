"""scripts/export_hf.py refuses bad checkpoints, weights, ids and --out folders by name."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from models import hf
from scripts import export_hf
from scripts.lib import checkpoints as reader
from test_export_hf import DEBUG, sharp_model, train_checkpoints, trainer_state


def _debug_state() -> dict[str, torch.Tensor]:
    return trainer_state(sharp_model(DEBUG))


def _assert_nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")], "temp folder left"


def test_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        reader.load_model_state(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a DCP checkpoint"):
        reader.load_model_state(tmp_path / "empty")
    code = export_hf.main(["--checkpoint", str(tmp_path / "nope"), "--flavor", "debug",
                           "--out", str(tmp_path / "hf")])
    assert code == 1
    assert "nope" in capsys.readouterr().err
    _assert_nothing_written(tmp_path)


def test_not_a_checkpoint_file(tmp_path):
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="not a torch.save file"):
        reader.load_model_state(tmp_path / "junk.pt")


def test_vocab_mismatch_names_the_key_shapes_and_the_fix(tmp_path, capsys):
    ckpt = tmp_path / "state.pt"
    torch.save(trainer_state(sharp_model(dataclasses.replace(DEBUG, vocab_size=600))), ckpt)
    code = export_hf.main(["--checkpoint", str(ckpt), "--flavor", "debug",
                           "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 1
    assert "tok_embeddings.weight: checkpoint shape [600, 128], flavor shape [512, 128]" in err
    assert "output.weight" in err and "--vocab-size 600" in err
    _assert_nothing_written(tmp_path)


def test_wrong_flavor_shape_mismatch(tmp_path):
    state = trainer_state(sharp_model(dataclasses.replace(DEBUG, ffn_dim=256)))
    with pytest.raises(ValueError, match=r"layers\.0\.feed_forward\.w1\.weight: checkpoint shape "
                                         r"\[256, 128\], flavor shape \[384, 128\]"):
        export_hf.export(state, DEBUG, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


def test_missing_key(tmp_path):
    state = _debug_state()
    del state["model.layers.2.ffn_norm.weight"]
    with pytest.raises(ValueError, match=r"missing keys \(1\): layers\.2\.ffn_norm\.weight"):
        export_hf.export(state, DEBUG, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


def test_unexpected_key(tmp_path):
    state = _debug_state()
    state["model.layers.4.attention.wq.weight"] = torch.zeros(128, 128)
    with pytest.raises(ValueError,
                       match=r"unexpected keys \(1\): layers\.4\.attention\.wq\.weight"):
        export_hf.export(state, DEBUG, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


def test_non_finite_weights(tmp_path):
    state = _debug_state()
    state["model.norm.weight"][3] = float("nan")
    with pytest.raises(ValueError, match=r"norm\.weight: holds non-finite"):
        export_hf.export(state, DEBUG, tmp_path / "hf")
    _assert_nothing_written(tmp_path)


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    state = _debug_state()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_hf.export(state, DEBUG, out)
    assert (out / "old.txt").exists()
    (out / "old.txt").unlink()
    export_hf.export(state, DEBUG, out, overwrite=True)  # an empty folder
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "export_hf.json",
                                                     "generation_config.json", "model.safetensors"]
    export_hf.export(state, DEBUG, out, overwrite=True)  # an earlier export
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temp or old folders left


def test_overwrite_replaces_only_an_earlier_export(tmp_path, capsys):
    """--out naming another run's dump folder, or another checkpoint: --overwrite refuses,
    naming what is there, and leaves it as it was."""
    state = _debug_state()
    torch.save(state, tmp_path / "state.pt")
    other_run = tmp_path / "other-run"
    (other_run / "checkpoint" / "step-2").mkdir(parents=True)
    (other_run / "metrics.jsonl").write_text("{}\n")
    for out in (other_run, other_run / "checkpoint"):
        assert export_hf.main(["--checkpoint", str(tmp_path / "state.pt"), "--flavor", "debug",
                               "--out", str(out), "--overwrite"]) == 1
        err = capsys.readouterr().err
        assert f"output {str(out)!r} holds " in err and "no export_hf.json" in err, err
        assert err.count("\n") == 1, err  # one line, before the checkpoint is read
    assert (other_run / "metrics.jsonl").is_file() and (other_run / "checkpoint/step-2").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-run", "state.pt"]


def test_overwrite_keeps_a_run_written_into_an_earlier_export(tmp_path, capsys):
    """A run that trained from an export (initial_load_path) with that folder as its dump folder
    wrote its checkpoints, metrics and lock beside export_hf.json: --overwrite deleted them."""
    torch.save(_debug_state(), tmp_path / "state.pt")
    export = ["--checkpoint", str(tmp_path / "state.pt"), "--flavor", "debug", "--out",
              str(tmp_path / "hf"), "--overwrite"]
    assert export_hf.main(export) == 0
    assert export_hf.main(export) == 0  # an export alone is replaced
    (tmp_path / "hf" / "checkpoint" / "step-2").mkdir(parents=True)
    (tmp_path / "hf" / "metrics.jsonl").write_text("{}\n")
    capsys.readouterr()
    assert export_hf.main(export) == 1
    assert (f"output {str(tmp_path / 'hf')!r} holds checkpoint, metrics.jsonl, besides an export "
            "(export_hf.json): not written by this tool alone") in capsys.readouterr().err
    assert (tmp_path / "hf" / "checkpoint" / "step-2").is_dir()
    assert (tmp_path / "hf" / "metrics.jsonl").is_file()


def test_a_hugging_face_folder_is_not_exported_again(tmp_path, capsys):
    """It was read as a checkpoint without config.toml: "pass --flavor", which led nowhere."""
    folder = train_checkpoints(tmp_path / "run", "--model.vocab_size", "300")
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 0
    assert export_hf.main(["--checkpoint", str(tmp_path / "hf"), "--out",
                           str(tmp_path / "again")]) == 1
    assert (f"{tmp_path / 'hf'} is a Hugging Face folder already: export_hf converts a DCP "
            "checkpoint or a torch.save file") in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_a_run_with_a_logit_softcap_is_refused(tmp_path, capsys):
    folder = train_checkpoints(tmp_path / "run", "--loss.softcap", "30")
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 1
    assert "softcap = 30.0: LlamaForCausalLM has neither" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_a_garbled_train_state_is_named(tmp_path, capsys):
    """train_state.json records the tokenizer the run trained with; garbled, it was read as
    absent and the export went ahead without checking the tokenizer."""
    folder = train_checkpoints(tmp_path / "run")
    state = folder / "step-2" / "train_state.json"
    (folder / "step-2" / "checksums.json").unlink()  # as saved before checksums (else: named by it)
    state.write_text("{")
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err.endswith(
        f"export_hf: error: {state} is damaged (JSONDecodeError: Expecting property name "
        "enclosed in double quotes: line 1 column 2 (char 1))\n")
    assert not (tmp_path / "hf").exists()


def test_a_run_record_changed_since_the_save_is_named(tmp_path, capsys):
    """config.toml and train_state.json are in the save's checksums.json, but export_hf,
    generate and evaluate checked only the tensor files: a config.toml changed since the save
    built another model than the run's without a word (here: Llama-3 RoPE scaling the run
    never trained with, exported as the run's), and a changed tokenizer record was blamed on
    the tokenizer ("other tokens or bos/eos ids"), not named as the damage it is."""
    folder = train_checkpoints(tmp_path / "run")
    step = folder / "step-2"
    config = step / "config.toml"
    assert "rope_scaling_factor = 0.0\n" in config.read_text()
    state = step / "train_state.json"
    record = json.loads(state.read_text())
    record["tokenizer"]["fingerprint"] = "0" * len(record["tokenizer"]["fingerprint"])
    for changed, text in ((config, config.read_text().replace("rope_scaling_factor = 0.0\n",
                                                              "rope_scaling_factor = 8.0\n")),
                          (state, json.dumps(record))):
        original = changed.read_text()
        changed.write_text(text)
        assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 1
        err = capsys.readouterr().err
        assert f"\nexport_hf: error: {changed} " in err, err
        assert "when it was written; restore it, or read an earlier checkpoint" in err or (
            "does not match its checksum: damaged since it was written" in err), err
        assert not (tmp_path / "hf").exists()
        with pytest.raises(ValueError, match=rf"^{changed} .*read an earlier checkpoint"):
            reader.load_model(folder, torch.device("cpu"))  # what generate and evaluate load
        changed.write_text(original)
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 0
    assert "rope_scaling" not in json.loads((tmp_path / "hf" / "config.json").read_text()) or (
        json.loads((tmp_path / "hf" / "config.json").read_text())["rope_scaling"] is None)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_without_config_toml_needs_the_flavor(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": trainer_state(sharp_model(DEBUG))}, checkpoint_id=tmp_path / "step-1",
             no_dist=True)
    assert export_hf.main(["--checkpoint", str(tmp_path / "step-1"), "--out",
                           str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "no config.toml" in err and "pass --flavor" in err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_overwrite_never_replaces_the_checkpoint_being_exported(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    step = tmp_path / "run" / "checkpoint" / "step-1"
    dcp.save({"model": trainer_state(sharp_model(DEBUG))}, checkpoint_id=step, no_dist=True)
    for out in (tmp_path / "run", step.parent, step):  # the dump folder, the checkpoints, it
        assert export_hf.main(["--checkpoint", str(step.parent), "--out", str(out),
                               "--flavor", "debug", "--overwrite"]) == 1
        assert "holds the checkpoint being exported" in capsys.readouterr().err
        assert (step / ".metadata").is_file()


@pytest.mark.parametrize("option, value", [("--bos-id", "300"), ("--eos-id", "-1")])
def test_a_token_id_outside_the_vocabulary_is_refused(tmp_path, capsys, option, value):
    """config.json got it as given, and generation from the folder then failed."""
    torch.save(_debug_state(), tmp_path / "model.pt")
    assert export_hf.main(["--checkpoint", str(tmp_path / "model.pt"), "--flavor", "debug",
                           "--vocab-size", "300", "--out", str(tmp_path / "hf"),
                           option, value]) == 1
    assert capsys.readouterr().err.endswith(f"export_hf: error: {option} {value}: not a token "
                                            "id of the model (0 to 299)\n")
    _assert_nothing_written(tmp_path)


def test_an_out_below_a_file_says_so(tmp_path, capsys):
    torch.save(_debug_state(), tmp_path / "model.pt")
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "hf"
    assert export_hf.main(["--checkpoint", str(tmp_path / "model.pt"), "--flavor", "debug",
                           "--out", str(out)]) == 1
    assert capsys.readouterr().err == (f"export_hf: error: output '{out}': "
                                       f"'{tmp_path / 'a_file'}' is a file, not a folder; pick "
                                       "another --out\n")


def test_damaged_files_name_themselves(tmp_path, capsys):
    """A checkpoint weight file overwritten after the save (its checksums.json says so), a
    safetensors file whose header is garbage ("header too large"), a shard index cut short:
    each is an error naming the file, not a bare library error or silently wrong weights."""
    folder = train_checkpoints(tmp_path / "run")
    distcp = folder / "step-2" / "__0_0.distcp"
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2:len(data) // 2 + 256] = bytes(256)
    distcp.write_bytes(bytes(data))
    assert export_hf.main(["--checkpoint", str(folder), "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert f"export_hf: error: {distcp} does not match its checksum: damaged" in err, err
    assert not (tmp_path / "hf").exists()

    state = _debug_state()
    export_hf.export(state, DEBUG, tmp_path / "one", dtype="float32")
    weights = tmp_path / "one" / "model.safetensors"
    weights.write_bytes((10**12).to_bytes(8, "little") + weights.read_bytes()[8:])
    with pytest.raises(ValueError, match=rf"{weights}: damaged, not a readable safetensors file "
                                         r"\(Error while deserializing header: header too large\)"):
        hf.load_hf_weights(tmp_path / "one", DEBUG)
    export_hf.export(state, DEBUG, tmp_path / "shards", dtype="float32", max_shard_bytes=10**6)
    index = tmp_path / "shards" / hf.INDEX
    index.write_text(index.read_text()[:100])
    with pytest.raises(ValueError, match=rf"{index}: damaged, not a safetensors index"):
        hf.load_hf_weights(tmp_path / "shards", DEBUG)


def test_an_index_naming_files_outside_its_folder_is_refused(tmp_path):
    """model.safetensors.index.json naming ../ read a file outside the folder."""
    export_hf.export(_debug_state(), DEBUG, tmp_path / "hf", dtype="float32", max_shard_bytes=10**6)
    index = tmp_path / "hf" / hf.INDEX
    spec = json.loads(index.read_text())
    first = sorted(set(spec["weight_map"].values()))[0]
    (tmp_path / "hf" / first).rename(tmp_path / "outside.safetensors")
    spec["weight_map"] = {k: "../outside.safetensors" if v == first else v
                          for k, v in spec["weight_map"].items()}
    index.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=rf"{index}: names '\.\./outside\.safetensors', not a "
                                         r"file name in the folder; not reading outside it"):
        hf.load_hf_weights(tmp_path / "hf", DEBUG)
