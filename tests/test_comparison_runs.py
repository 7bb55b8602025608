"""Real and dry runs of the fused/unfused, float8/bf16, layout and loss-parallel comparisons."""

import json
import math
import re
import shlex
import sys

import pytest

from test_compare_losses import compare
from test_launch_scripts import SHORT, option
from test_script_conventions import files_under, run
from torch_threads import ONE_THREAD


# ---- the real thing, on the CPU --------------------------------------------------------------

@pytest.fixture(scope="module")
def fused_vs_unfused(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    result = run(["scripts/compare_fused_vs_unfused.sh", "configs/debug.toml", *SHORT],
                 env={"OUT_DIR": str(out), "PYTHON": sys.executable, "NGPU": "1", **ONE_THREAD},
                 timeout=600)
    return result, out


@pytest.mark.slow
def test_fused_and_unfused_losses_agree(fused_vs_unfused):
    """On the CPU (fp32, deterministic) the script picks the absolute verdict by itself."""
    result, out = fused_vs_unfused
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "=== device cpu: verdict absolute" in result.stdout
    assert "verdict: absolute (--verdict absolute)" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "PASS: every run within 0.02 of A at every step"
    assert (out / "fused_vs_unfused.png").is_file()


def train_short(dump, *overrides):
    result = run([sys.executable, "train.py", "--config", "configs/debug.toml", *SHORT,
                  "--metrics.log_freq", "1", *overrides, "--job.dump_folder", str(dump)],
                 env=ONE_THREAD, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return dump


@pytest.mark.slow
def test_another_learning_rate_is_caught_by_both_verdicts(fused_vs_unfused, tmp_path):
    """Real runs: fused vs unfused sits deep inside the noise band that a run at another seed
    measures; a run at another learning rate is outside it, and outside the tolerance."""
    _, out = fused_vs_unfused  # its flce run is this test's lr 3e-3 run
    other = train_short(tmp_path / "lr_1e-2", "--optimizer.lr", "1e-2")
    seed = train_short(tmp_path / "seed_1", "--training.seed", "1")
    result = compare(out / "flce", other, "--tolerance", "0.02")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL" in result.stdout
    same = compare(out / "flce", out / "unfused", "--seed-run", seed, "--window", "5")
    assert same.returncode == 0, same.stdout + same.stderr
    ratio = float(same.stdout.split(" x the seed-to-seed spread")[0].rsplit("= ", 1)[1])
    assert ratio < 1e-3  # fp32: ~1e-7 of the seed-to-seed spread
    lr = compare(out / "flce", other, "--seed-run", seed, "--window", "5")
    assert lr.returncode == 1 and "OUTSIDE" in lr.stdout, lr.stdout + lr.stderr


@pytest.mark.parametrize("device, verdict", [("cpu", "absolute"), ("cuda", "band")])
def test_fused_vs_unfused_picks_its_verdict(tmp_path, device, verdict):
    """GPU runs are judged against a noise band from a third run at the next seed; CPU runs by
    the absolute tolerance. DRY_RUN=1 prints the commands and deletes nothing, not even an
    earlier run of the script (a folder it marked)."""
    (tmp_path / "flce").mkdir()
    (tmp_path / "flce" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "flce" / ".scratch-run").write_text("")
    result = run(["scripts/compare_fused_vs_unfused.sh", "configs/debug.toml",
                  "--training.device", device, "--training.seed", "3"],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1",
                      "DRY_RUN": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"=== device {device}: verdict {verdict}" in result.stdout
    commands = [shlex.split(line) for line in result.stdout.splitlines()
                if not line.startswith("===")]
    assert [option(c, "--loss.impl") for c in commands[:-1]] == (
        ["flce", "unfused"] + (["flce"] if verdict == "band" else []))
    compare_cmd = commands[-1]
    assert compare_cmd[1].endswith("compare_losses.py")
    assert option(compare_cmd, "--verdict") == verdict
    if verdict == "band":
        seed_run = commands[2]  # the config's seed + 1, after (so over) the caller's
        tail = seed_run[seed_run.index("--loss.impl"):]
        assert tail[:4] == ["--loss.impl", "flce", "--training.seed", "4"]
        assert option(compare_cmd, "--seed-run") == str(tmp_path / "flce_seed4")
    else:
        assert "--seed-run" not in compare_cmd
    assert (tmp_path / "flce" / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize("args", [["configs/nope.toml"],
                                  ["configs/debug.toml", "--training.stepz", "3"],
                                  ["--training.steps", "3"]])
def test_fused_vs_unfused_bad_input_keeps_earlier_results(tmp_path, args):
    (tmp_path / "flce").mkdir()
    (tmp_path / "flce" / "metrics.jsonl").write_text("{}\n")
    result = run(["scripts/compare_fused_vs_unfused.sh", *args],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(("error: ", "usage: ")), result.stderr
    assert (tmp_path / "flce" / "metrics.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize("script", ["run_train.sh", "compare_fused_vs_unfused.sh"])
@pytest.mark.parametrize("ngpu", ["0", "abc", "1 2"])
def test_a_bad_ngpu_is_one_line(tmp_path, script, ngpu):
    """NGPU=0 ran torchrun --nproc-per-node 0 (an AssertionError deep in torch), NGPU=abc was
    bash's "unbound variable", and NGPU="1 2" an arithmetic error before torchrun ran anyway."""
    result = run([f"scripts/{script}", *(["configs/debug.toml"] if script != "run_train.sh"
                                          else []), *SHORT],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": ngpu})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr == (f"error: NGPU={ngpu}: expected the number of processes, 1 or more "
                             "(1: one process, the CPU where there is no GPU)\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("setting", ["TOLERANCE=0.02x", "BAND_RATIO=-1", "BAND_RATIO=0"])
def test_a_bad_tolerance_is_refused_before_any_run(tmp_path, setting):
    """compare_losses.py read TOLERANCE and BAND_RATIO after every run had trained (and the
    earlier results were cleared): a typo cost the whole comparison."""
    (tmp_path / "flce").mkdir()
    (tmp_path / "flce" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "flce" / ".scratch-run").write_text("")
    name, value = setting.split("=")
    result = run(["scripts/compare_fused_vs_unfused.sh", "configs/debug.toml", *SHORT],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1",
                      name: value})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    bound = ">= 0" if name == "TOLERANCE" else "> 0"
    assert result.stderr == f"error: {setting}: expected a number {bound}\n"
    assert (tmp_path / "flce" / "metrics.jsonl").read_text() == "{}\n"


def test_fused_vs_unfused_refuses_a_folder_it_did_not_make(tmp_path):
    """OUT_DIR shared with a real run named flce: the script used to rm -rf it and train over
    it. Now it stops before any run, names the folder, and leaves every file where it was."""
    run_of_yours = tmp_path / "flce"
    (run_of_yours / "checkpoint" / "step-10").mkdir(parents=True)
    (run_of_yours / "metrics.jsonl").write_text('{"step": 10}\n')
    before = files_under(tmp_path)
    result = run(["scripts/compare_fused_vs_unfused.sh", "configs/debug.toml", *SHORT],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1"})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {run_of_yours} holds files that no script run made")
    assert files_under(tmp_path) == before


def test_the_folder_check_names_the_folders_of_an_out_dir_with_an_ampersand(tmp_path):
    """The up-front check took OUT_DIR "a&b" for "ab" (bash 5.2 reads an & in a ${x/#/...}
    replacement as the match): a run of yours in OUT_DIR/unfused went unseen, and a real
    comparison trained (and cleared) OUT_DIR/flce before refusing it."""
    out = tmp_path / "a&b"
    (out / "unfused").mkdir(parents=True)
    (out / "unfused" / "metrics.jsonl").write_text('{"step": 10}\n')
    result = run(["scripts/compare_fused_vs_unfused.sh", "configs/debug.toml", *SHORT],
                 env={"OUT_DIR": str(out), "PYTHON": sys.executable, "NGPU": "1",
                      "DRY_RUN": "1"})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {out / 'unfused'} holds files that no script run "
                                    "made")
    assert (out / "unfused" / "metrics.jsonl").read_text() == '{"step": 10}\n'


@pytest.mark.slow
def test_float8_vs_bf16_trains_both_and_judges_float8_by_the_seed_band(tmp_path):
    """Real CPU runs: the float8 run has float8 layers (emulated on the CPU) and the float8
    loss, its curve differs from bf16's (it is not bf16 again) by far less than another seed's."""
    result = run(["scripts/compare_float8_vs_bf16.sh", "configs/debug.toml", *SHORT],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1",
                      **ONE_THREAD}, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "=== device cpu: verdict band" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("PASS: within the noise band")
    resolved = (tmp_path / "float8" / "config.toml").read_text()
    assert 'converters = ["quantize.linear.float8"]' in resolved
    assert "emulate = true" in resolved and 'float8 = "logits+dx"' in resolved
    assert 'converters = []' in (tmp_path / "bf16" / "config.toml").read_text()
    diffs = result.stdout.split("mean|diff|")[1]  # the table of mean |run - bf16|
    float8_diff = float(re.search(r"/float8 +([\d.]+)", diffs).group(1))
    seed_diff = float(re.search(r"/bf16_seed1 +([\d.]+)", diffs).group(1))
    assert 0 < float8_diff < seed_diff / 10
    assert (tmp_path / "float8_vs_bf16.png").is_file()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_float8_vs_bf16_commands(tmp_path, device):
    """DRY_RUN=1: bf16, float8 (FLOAT8's overrides; emulated on the CPU only), bf16 at the
    config's seed + 1, and the band verdict at 1x the seed spread, on either device."""
    result = run(["scripts/compare_float8_vs_bf16.sh", "configs/debug.toml",
                  "--training.device", device, "--training.seed", "3"],
                 env={"OUT_DIR": str(tmp_path), "PYTHON": sys.executable, "NGPU": "1",
                      "DRY_RUN": "1", "FLOAT8": "--model.converters quantize.linear.float8"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"=== device {device}: verdict band" in result.stdout
    commands = [shlex.split(line) for line in result.stdout.splitlines()
                if not line.startswith("===")]
    bf16, float8, noise, compare_cmd = commands
    assert "--model.converters" not in bf16
    assert option(float8, "--model.converters") == "quantize.linear.float8"
    assert "--loss.float8" not in float8  # FLOAT8 replaced the default overrides
    assert ("--quantize.linear.float8.emulate" in float8) == (device == "cpu")
    seeds = [noise[i + 1] for i, word in enumerate(noise) if word == "--training.seed"]
    assert seeds == ["3", "4"]  # the script's after (so over) the caller's
    assert option(compare_cmd, "--seed-run") == str(tmp_path / "bf16_seed4")
    assert option(compare_cmd, "--band-ratio") == "1.0"
    assert option(compare_cmd, "--out") == str(tmp_path / "float8_vs_bf16.png")
    assert list(tmp_path.iterdir()) == []


# ---- compare_layouts.py ----------------------------------------------------------------------

LAYOUTS = [sys.executable, "-m", "scripts.compare_layouts", "--config", "configs/debug.toml"]


def test_layouts_refuse_a_runs_dir_folder_they_did_not_make(tmp_path):
    (tmp_path / "fsdp_flce").mkdir()
    (tmp_path / "fsdp_flce" / "notes.txt").write_text("mine\n")
    result = run([*LAYOUTS, "--layouts", "fsdp", "--runs-dir", str(tmp_path), "--steps", "4",
                  "--warmup-steps", "2", "--out", str(tmp_path / "report")])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "fsdp_flce holds files that no script run made" in result.stderr
    assert (tmp_path / "fsdp_flce" / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsdp_flce"]


def test_layout_commands(tmp_path):
    result = run([*LAYOUTS, "--nproc", "8", "--layouts", "fsdp,tp2_vocab,hsdp2", "--seed-runs",
                  "--runs-dir", str(tmp_path), "--extra=--training.local_batch_size 2",
                  "--dry-run"])
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    assert len(commands) == 9  # 3 layouts x (flce, unfused, unfused at seed + 1)
    for argv in commands:
        assert argv[argv.index("--nproc_per_node") + 1] == "8"
        assert argv.index("--training.local_batch_size") < argv.index("--loss.impl")
    tp_vocab = commands[3]
    assert option(tp_vocab, "--parallelism.tensor_parallel_degree") == "2"
    assert option(tp_vocab, "--loss.parallel") == "vocab"
    assert option(tp_vocab, "--loss.impl") == "flce"
    assert option(commands[5], "--training.seed") == "1"
    assert option(commands[6], "--parallelism.data_parallel_replicate_degree") == "2"
    assert option(commands[7], "--job.dump_folder") == str(tmp_path / "hsdp2_unfused")
    bad = run([*LAYOUTS, "--layouts", "fsdp,tp2_rows", "--dry-run"])
    assert bad.returncode == 2 and "layout 'tp2_rows'" in bad.stderr


@pytest.mark.slow
def test_layouts_on_two_cpu_processes(tmp_path):
    """Two real torchrun runs (gloo) of the vocab-parallel layout: report, plot and verdict."""
    out = tmp_path / "report"
    result = run([*LAYOUTS, "--nproc", "2", "--layouts", "tp2_vocab", "--steps", "4",
                  "--warmup-steps", "1", "--log-freq", "1", "--out", str(out),
                  "--runs-dir", str(tmp_path / "runs"),
                  "--extra=--training.device cpu --training.seq_len 64 "
                  "--training.local_batch_size 2 --lr_scheduler.warmup_steps 2 "
                  "--validation.enable false"],
                 env={"OMP_NUM_THREADS": "1", "FLCE_GIT_REVISION": "0a1b2c3"})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    assert [(r["layout"], r["loss"], r["status"]) for r in report["runs"]] == [
        ("tp2_vocab", "flce", "ok"), ("tp2_vocab", "unfused", "ok")]
    for r in report["runs"]:
        assert r["final_step"] == 4 and r["tokens_per_second"] > 0 and r["final_loss"] > 0
    [comparison] = report["comparisons"]
    assert comparison["exit_code"] == 0 and comparison["verdict"].startswith("PASS")
    assert (tmp_path / "report_tp2_vocab.png").stat().st_size > 0
    md = out.with_suffix(".md").read_text()
    assert "| tp2_vocab | flce | ok |" in md and "- **tp2_vocab**: PASS" in md
    assert md.splitlines()[0].endswith(" · git 0a1b2c3") and report["meta"]["dirty"] is False


@pytest.mark.slow
def test_loss_parallel_benchmark_on_two_cpu_processes(tmp_path):
    """Both modes run through torchrun (gloo) and compute the same loss."""
    out = tmp_path / "lp"
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node", "2", "-m", "scripts.bench.loss_parallel",
                  "--shapes", "64x16x37,90x24x101", "--warmup", "1", "--reps", "2",
                  "--modes", "sequence,vocab,vocab_unfused", "--out", str(out),
                  "--device", "cpu"],
                 env={"OMP_NUM_THREADS": "1", "FLCE_GIT_REVISION": "0a1b2c3+dirty"})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["results"]
    assert report["meta"]["git"] == "0a1b2c3+dirty" and report["meta"]["dirty"] is True
    assert report["meta"]["command"].startswith(
        "torchrun --nproc_per_node 2 -m scripts.bench.loss_parallel --shapes")
    md = out.with_suffix(".md").read_text()
    assert md.startswith("**DIRTY TREE: not reproducible from a commit** (git 0a1b2c3+dirty")
    assert [(r["shape"], r["mode"]) for r in rows] == [
        (shape, mode) for shape in ("64x16x37", "90x24x101")
        for mode in ("sequence", "vocab", "vocab_unfused")]
    for a, b, c in zip(rows[::3], rows[1::3], rows[2::3]):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5) and a["ms"] > 0
        assert math.isclose(a["loss"], c["loss"], rel_tol=1e-5)
    assert "| 90x24x101 |" in md


def test_layouts_keep_a_dotted_out_whole(tmp_path, monkeypatch):
    """--out name_v1.5 wrote name_v1.json and name_v1.md (Path.with_suffix took ".5" for a
    suffix). The runs and the comparison stand in for train.py and compare_losses.py."""
    from scripts import compare_layouts
    from scripts.lib.runs import throughput

    def execute(run, args):
        return {**{k: v for k, v in run.items() if k != "cmd"}, "status": "ok", "exit_code": 0,
                "wall_seconds": 1.0, "final_step": 4, "final_loss": 1.0, **throughput([], 1)}

    monkeypatch.setattr(compare_layouts, "probe_environment", dict)
    monkeypatch.setattr(compare_layouts, "execute", execute)
    monkeypatch.setattr(compare_layouts, "compare", lambda layout, records, args, out: {
        "layout": layout, "verdict": "PASS", "exit_code": 0})
    monkeypatch.setenv("FLCE_GIT_REVISION", "0a1b2c3")
    out = tmp_path / "name_v1.5"
    assert compare_layouts.main(["--config", "configs/debug.toml", "--nproc", "1", "--steps",
                                 "4", "--warmup-steps", "1", "--layouts", "fsdp", "--out",
                                 str(out), "--runs-dir", str(tmp_path / "runs")]) == 0
    assert sorted(p.name for p in tmp_path.glob("name_v1*")) == ["name_v1.5.json", "name_v1.5.md"]
    assert [r["layout"] for r in json.loads(
        (tmp_path / "name_v1.5.json").read_text())["runs"]] == ["fsdp", "fsdp"]
