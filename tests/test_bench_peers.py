"""scripts.bench.peers: its run lists, --resume, and the runs' metrics read past a rollback."""

import json
from pathlib import Path

import pytest

from scripts.bench import peers as bench_peers

REPO = Path(__file__).resolve().parents[1]
PEER_RUN_LISTS = sorted((REPO / "scripts/bench/peer_runs").glob("*.args"))


@pytest.mark.parametrize("runs_file", PEER_RUN_LISTS, ids=lambda p: p.stem)
def test_a_shipped_peer_run_list_parses_and_its_runs_configs_load(runs_file, tmp_path):
    """Each run list in scripts/bench/peer_runs/ is read as @FILE (comments and quoted --run
    values as a shell reads them), names both trainers, and every run of this repo's loads as a
    train.py config (a key renamed since would fail here, not on the GPU machine)."""
    from components.config.parse import load_config
    args = bench_peers.parse_args([f"@{runs_file}", "--runs-dir", str(tmp_path)])
    assert {kind for _, kind, _ in args.runs} == {"ours", "titan"}
    assert len({name for name, _, _ in args.runs}) == len(args.runs)
    for name, kind, extra in args.runs:
        if kind == "ours":
            cmd, _ = bench_peers.ours_command(args, extra, tmp_path / name)
            cfg = load_config(cmd[cmd.index("--config"):])
            assert cfg.training.seq_len == args.seq_len


def test_bench_peers_names_a_bad_config_in_one_line(tmp_path, capsys):
    """A missing or invalid --config was a traceback, and one without [model] a KeyError,
    though train.py runs it on the default flavor."""
    from components.config.parse import load_config
    bare = tmp_path / "bare.toml"
    bare.write_text("[training]\nsteps = 3\n")
    assert bench_peers.parse_args(["--run", "a=ours", "--config", str(bare)]).flavor == \
        load_config([]).model.flavor
    missing, bad = tmp_path / "missing.toml", tmp_path / "bad.toml"
    bad.write_text("[model\n")
    for path, said in ((missing, f"--config {missing}: no such file"),
                       (bad, f"{bad}: invalid TOML")):
        with pytest.raises(SystemExit) as e:
            bench_peers.parse_args(["--run", "a=ours", "--config", str(path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "Traceback" not in err
        assert f"error: {said}" in err.splitlines()[-1]


def test_a_peer_run_file_line_is_split_as_a_shell_would(tmp_path):
    runs = tmp_path / "runs.args"
    runs.write_text("# a comment line\n--steps 7  # seven\n"
                    "--run \"a=ours:--training.local_batch_size 2 --loss.impl unfused\"\n")
    args = bench_peers.parse_args([f"@{runs}"])
    assert args.steps == 7
    assert args.runs == [("a", "ours", ["--training.local_batch_size", "2", "--loss.impl",
                                        "unfused"])]


def test_bench_peers_resume_keeps_the_finished_runs_and_runs_the_others(tmp_path, monkeypatch):
    """--resume keeps a run an earlier call finished (its record, commit and folder untouched)
    and runs the ones it lacks; a report of another setup is refused. Real train.py runs of the
    debug model on the CPU."""
    monkeypatch.setenv("FLCE_GIT_REVISION", "aaaaaaa")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the trainers it starts (torch_threads.py)
    common = ["--config", "configs/debug.toml", "--seq-len", "64", "--steps", "5",
              "--warmup-steps", "2", "--log-freq", "1", "--runs-dir", str(tmp_path / "runs"),
              "--out", str(tmp_path / "peers")]
    a, b = "a=ours:--training.local_batch_size 2", "b=ours:--training.local_batch_size 3"
    assert bench_peers.main([*common, "--run", a]) == 0
    first = json.loads((tmp_path / "peers.json").read_text())["runs"][0]
    metrics = tmp_path / "runs/a/metrics.jsonl"
    written = metrics.stat().st_mtime_ns
    monkeypatch.setenv("FLCE_GIT_REVISION", "bbbbbbb")
    assert bench_peers.main([*common, "--resume", "--run", a, "--run", b]) == 0
    report = json.loads((tmp_path / "peers.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["a", "b"]
    assert report["runs"][0] == first and first["git"] == "aaaaaaa"
    assert report["runs"][1]["status"] == "ok" and report["runs"][1]["git"] == "bbbbbbb"
    assert metrics.stat().st_mtime_ns == written
    assert "Kept from earlier calls (--resume): a (git aaaaaaa" in (
        tmp_path / "peers.md").read_text()
    with pytest.raises(SystemExit, match="another setup .*steps=5"):
        bench_peers.main([*common[:5], "7", *common[6:], "--resume", "--run", a])


@pytest.mark.parametrize("runs_file", PEER_RUN_LISTS, ids=lambda p: p.stem)
def test_a_shipped_peer_run_lists_torchtitan_runs_parse_as_torchtitan_reads_them(runs_file,
                                                                                 tmp_path):
    """Where torchtitan 0.2.2 is importable (it is no CI dependency: the peer runs on the GPU
    machine), every titan run of a shipped list parses with its config manager and sets what
    its name says (float8 converters, the float8 all-gather)."""
    manager = pytest.importorskip("torchtitan.config.manager")
    args = bench_peers.parse_args([f"@{runs_file}", "--runs-dir", str(tmp_path)])
    for name, kind, extra in args.runs:
        if kind != "titan":
            continue
        cmd, _ = bench_peers.titan_command(args, extra, tmp_path / name)
        cfg = manager.ConfigManager().parse_args(cmd[cmd.index("--model.name"):])
        float8 = cfg.quantize.linear.float8
        assert ("float8" in name) == (cfg.model.converters == ["quantize.linear.float8"])
        assert float8.enable_fsdp_float8_all_gather == name.endswith("_ag")
        assert cfg.training.seq_len == args.seq_len and cfg.compile.enable


def test_bench_runs_read_the_timeline_a_rollback_left(tmp_path):
    """A benchmark's run resumed from step 2 after logging to step 4 (its steps 3-4 abandoned)
    and stopped at step 3: its throughput rows are steps 1-3, step 3 the resumed run's."""
    from scripts.lib.runs import read_metrics
    lines = [{"step": s, "time": 0.0, "loss": 5.0 - s, "tokens_per_second": 100.0 * s}
             for s in (1, 2, 3, 4)]
    lines += [{"step": 2, "time": 0.0, "val_loss": 3.5},  # a validation line has no throughput
              {"step": 3, "time": 1.0, "loss": 0.5, "tokens_per_second": 777.0},
              "{cut short by a ki"]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["tokens_per_second"] for r in rows] == [100.0, 200.0, 777.0]
    assert rows[2]["loss"] == 0.5
