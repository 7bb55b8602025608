"""The config's values checked once read: ranges, keys that must agree, [[data.mixture]] tables,
and [training] global_batch_size resolved as the gradient accumulation."""

import pytest

from components.config.parse import load_config
from components.config.schema import ConfigError


@pytest.mark.parametrize("tables,argv,match", [
    ('source = "{web}"\nweight = 0', [], r"\[\[data.mixture\]\] #1 \(.*web\): weight = 0.0: must be > 0"),
    ('source = "{web}"\nweight = -1', [], r"weight = -1.0: must be > 0"),
    ('source = "{web}/nope"\nweight = 1', [], r"#1: source '.*web/nope' does not exist"),
    ('source = "{web}"\nwieght = 1', [], r"\[\[data.mixture\]\] #1: unknown key 'wieght' \(did you mean 'weight'\?\)"),
    ('source = "{web}"\nweight = "heavy"', [], r"#1 weight: expected float, got str 'heavy'"),
    ('weight = 1', [], r"#1: source is empty"),
    ('source = "{web}"\n[[data.mixture]]\nsource = "{web}"', [], r"#2: source '.*web' is listed twice"),
    ('source = "{web}"', ["--data.source", "corpus.jsonl"], r"\[data\] source = 'corpus.jsonl' and "
                                                           r"\[\[data.mixture\]\] are both set"),
    ('source = "{web}"', ["--data.mixture", "{web}"], r"\[\[data.mixture\]\] #1: expected folder:weight"),
    ('source = "{web}"', ["--data.num_workers", "-1"], r"num_workers = -1: must be >= 0"),
])
def test_bad_mixtures_are_named(tmp_path, tables, argv, match):
    (tmp_path / "web").mkdir()
    path = tmp_path / "bad.toml"
    path.write_text("[[data.mixture]]\n" + tables.format(web=tmp_path / "web") + "\n")
    with pytest.raises(ConfigError, match=match):
        load_config(["--config", str(path), *[a.format(web=tmp_path / "web") for a in argv]])


@pytest.mark.parametrize("local,dp,accumulation,wanted,expect", [
    (4, 2, 1, -1, 1), (4, 2, 1, 32, 4), (2, 3, 1, 6, 1), (4, 2, 4, 32, 4),
    (4, 2, 1, 12, r"global_batch_size = 12 is not a multiple of local_batch_size x the "
                  r"data-parallel degree = 4 x 2"),
])
def test_global_batch_size_resolves_the_accumulation(local, dp, accumulation, wanted, expect):
    from components.config.checks import resolve_global_batch
    cfg = load_config(["--training.local_batch_size", str(local), "--training.global_batch_size",
                       str(wanted), "--training.gradient_accumulation_steps", str(accumulation)])
    if isinstance(expect, str):
        with pytest.raises(ConfigError, match=expect):
            resolve_global_batch(cfg, dp)
    else:
        assert resolve_global_batch(cfg, dp) is None
        assert cfg.training.gradient_accumulation_steps == expect


def test_global_batch_size_wins_over_the_accumulation_a_config_toml_recorded():
    """A run's config.toml (4 micro-batches on 2 ranks) launched on 8 ranks: 1 micro-batch, with a
    warning line, not a refusal."""
    from components.config.checks import resolve_global_batch
    cfg = load_config(["--training.local_batch_size", "4", "--training.global_batch_size", "32",
                       "--training.gradient_accumulation_steps", "4"])
    assert resolve_global_batch(cfg, 8) == (
        "warning: [training] global_batch_size = 32 makes 1 micro-batch(es) a step at "
        "local_batch_size 4 on 8 data-parallel rank(s): gradient_accumulation_steps = 4 is "
        "replaced by 1")
    assert cfg.training.gradient_accumulation_steps == 1


@pytest.mark.parametrize("wanted", ["0", "-2"])
def test_global_batch_size_must_be_positive_or_minus_one(wanted):
    with pytest.raises(ConfigError, match=rf"\[training\] global_batch_size = {wanted}: must be"):
        load_config(["--training.global_batch_size", wanted])


def test_a_config_built_in_code_is_checked_too():
    from components.config.schema import JobConfig, MixtureSource
    from components.config.checks import check_values
    cfg = JobConfig()
    cfg.training.device = "tpu"
    with pytest.raises(ConfigError, match=r"\[training\] device = 'tpu': expected one of 'auto', 'cuda', 'cpu'"):
        check_values(cfg)
    cfg = JobConfig()
    cfg.data.mixture = [MixtureSource("x", "heavy")]
    with pytest.raises(ConfigError, match=r"\[\[data.mixture\]\] #1 weight: expected float"):
        check_values(cfg)


@pytest.mark.parametrize("argv,message", [
    (["--job.dump_folder", ""], r"\[job\] dump_folder is empty"),  # it wrote into the current folder
    (["--training.max_bad_steps", "0"], r"\[training\] max_bad_steps = 0: must be >= 1"),
    (["--checkpoint.load_step", "-5"], r"\[checkpoint\] load_step = -5: must be a step >= 0"),
    # these two named no section; the tokenizer file was silently not read
    (["--data.val_every", "1"], r"\[data\] val_every = 1: must be 0 \(none held out\) or >= 2"),
    (["--data.val_every", "-2"], r"\[data\] val_every = -2: must be 0 \(none held out\) or >= 2"),
    (["--model.vocab_size", "-3"], r"\[model\] vocab_size = -3: must be >= 1, or 0"),
    # both compiled nothing, or the model once, without a word
    (["--compile.enable", "true", "--compile.components", ""],
     r"\[compile\] enable = true with components empty compiles nothing"),
    (["--compile.components", "model,model"], r"\[compile\] components lists 'model' twice"),
    # torch.manual_seed's traceback, after config.toml was written
    (["--training.seed", str(1 << 64)], r"\[training\] seed = 18446744073709551616: must be "
                                        r"within -2\*\*63 \.\. 2\*\*63 - 2"),
    (["--tokenizer.path", "tok.json"], r"\[tokenizer\] path = 'tok.json' is set, but name = "
                                       r"\"byte\" reads no file"),
])
def test_values_out_of_range(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


def test_load_step_without_checkpoints_enabled_is_refused():
    """It was ignored: the run trained from step 1 and set the folder's metrics aside."""
    with pytest.raises(ConfigError, match=r"\[checkpoint\] load_step = 2 resumes from a "
                                          r"checkpoint, but \[checkpoint\] enable = false"):
        load_config(["--checkpoint.load_step", "2"])
    assert load_config(["--checkpoint.load_step", "2", "--checkpoint.enable", "true"])


@pytest.mark.parametrize("key", ["source", "cache_dir"])
def test_an_empty_data_source_or_cache_dir_is_refused(key):
    """"" is the current folder to Path: --data.source "" trained on every .jsonl/.json/.txt file
    under the folder the run started in (its log naming the source ""), and --data.cache_dir ""
    wrote checked/ and datasets/ there, both without a word (as [job] dump_folder = "" would)."""
    with pytest.raises(ConfigError, match=rf"\[data\] {key} is empty"):
        load_config([f"--data.{key}", ""])
