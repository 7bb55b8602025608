"""The config written back as TOML: it reads back the same, and config_changes lists the keys a
saved config.toml and a config differ in."""

import tomllib

from components.config.parse import load_config
from components.config.toml_out import config_changes, to_toml


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(["--training.steps", "3", "--job.description", 'a "quoted" name'])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(["--config", str(path)]) == cfg
    assert tomllib.loads(path.read_text())["training"]["steps"] == 3


def test_control_characters_in_strings_round_trip(tmp_path):
    # e.g. --job.description "$(git log -1)": a raw newline made config.toml invalid TOML, so
    # resuming (config_changes), export_hf and evaluate failed on the run's checkpoints
    description = "subject\n\nbody\r\n\x1b[0m\x7f\ttab \"q\" back\\slash é"
    cfg = load_config(["--job.description", description])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(["--config", str(path)]).job.description == description
    assert config_changes(to_toml(cfg), cfg) == []


def test_config_changes_lists_every_differing_key():
    saved = to_toml(load_config(["--lr_scheduler.decay_type", "wsd", "--lr_scheduler.decay_ratio",
                                 "0.2", "--job.description", 'a "b"']))
    cfg = load_config(["--optimizer.lr", "1e-5", "--training.steps", "200"])
    assert config_changes(saved, cfg) == [
        '[job] description: "a \\"b\\"" -> ""',
        "[training] steps: 100 -> 200",
        "[optimizer] lr: 0.0003 -> 1e-05",
        '[lr_scheduler] decay_type: "wsd" -> "cosine"',
        "[lr_scheduler] decay_ratio: 0.2 -> unset",
    ]
    assert config_changes(to_toml(cfg), cfg) == []
