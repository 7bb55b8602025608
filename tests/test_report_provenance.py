"""scripts/lib/report.py: the commit a report names, its dirty-tree warning, the report files."""

import json
import subprocess

import pytest

from scripts.bench import attention as bench_attention, flce as bench_flce, peers as bench_peers
from scripts.bench import chunk_sizes as bench_chunk_sizes, float8_grid as bench_float8_grid
from scripts.bench import logits_epilogue as bench_logits_epilogue
from scripts.lib import report


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv("FLCE_GIT_REVISION", raising=False)
    git(tmp_path, "init", "-q")
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "old.md").write_text("old\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def head(repo) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_clean_tree_records_its_commit(repo):
    # Results written into benchmarks/ by earlier runs are not code: the tree stays clean.
    (repo / "benchmarks" / "new.json").write_text("{}\n")
    assert report.git_revision(repo) == {"git": head(repo), "dirty": False}


@pytest.mark.parametrize("change", ["tracked file edited", "untracked code", "staged"])
def test_a_dirty_tree_is_flagged(repo, change):
    if change == "tracked file edited":
        (repo / "train.py").write_text("print(2)\n")
    elif change == "untracked code":
        (repo / "models").mkdir()
        (repo / "models" / "new.py").write_text("x = 1\n")
    else:
        (repo / "benchmarks" / "old.md").write_text("changed\n")  # tracked, so it counts
        git(repo, "add", "benchmarks/old.md")
    assert report.git_revision(repo) == {"git": head(repo) + "+dirty", "dirty": True}


def test_the_sent_revision_wins_over_a_stale_git(repo, monkeypatch):
    """A tree copied to a GPU machine carries a stale .git: its sender names the commit."""
    (repo / "train.py").write_text("print(2)\n")
    monkeypatch.setenv("FLCE_GIT_REVISION", "0123abc")
    assert report.git_revision(repo) == {"git": "0123abc", "dirty": False}
    monkeypatch.setenv("FLCE_GIT_REVISION", "0123abc+dirty")
    assert report.git_revision(repo) == {"git": "0123abc+dirty", "dirty": True}


def test_no_git_checkout_is_an_unknown_revision(tmp_path, monkeypatch):
    monkeypatch.delenv("FLCE_GIT_REVISION", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above
    assert report.git_revision(tmp_path) == {"git": None, "dirty": None}


def test_warning_lines():
    assert report.warning_lines({"git": "abc1234", "dirty": False}) == []
    assert report.warning_lines({"git": "abc1234+dirty", "dirty": True})[0].startswith(
        "**DIRTY TREE: not reproducible from a commit** (git abc1234+dirty")
    assert report.warning_lines({"git": None, "dirty": None})[0].startswith(
        "**UNKNOWN REVISION: not reproducible from a commit**")


def test_provenance_warns_at_once(monkeypatch, capsys):
    monkeypatch.setenv("FLCE_GIT_REVISION", "abc1234+dirty")
    meta = report.provenance()
    assert meta["git"] == "abc1234+dirty" and meta["dirty"] is True and meta["date"]
    assert "warning: DIRTY TREE: not reproducible from a commit" in capsys.readouterr().err


def test_write_report_writes_both_files_whole(tmp_path):
    out = tmp_path / "deep" / "bench_x"
    report.write_report(out, {"meta": {"git": "abc"}, "results": [1.5]}, "# x\n")
    assert json.loads((tmp_path / "deep" / "bench_x.json").read_text())["results"] == [1.5]
    assert (tmp_path / "deep" / "bench_x.md").read_text() == "# x\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["bench_x.json", "bench_x.md"]


@pytest.mark.parametrize("out, names", [
    ("name_v1.5", ["name_v1.5.json", "name_v1.5.md"]),  # with_suffix: name_v1.json, name_v1.md
    ("bench.x", ["bench.x.json", "bench.x.md"]),
    ("bench_x.json", ["bench_x.json", "bench_x.md"]),  # an --out naming the report, as before
    ("bench_x.md", ["bench_x.json", "bench_x.md"])])
def test_write_report_keeps_a_dotted_name_whole(tmp_path, out, names):
    report.write_report(tmp_path / out, {"meta": {}}, "# x\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    assert [report.report_file(tmp_path / out, s).name for s in (".json", ".md")] == names


DIRTY = {"git": "abc1234+dirty", "dirty": True}
CLEAN = {"git": "abc1234", "dirty": False}
# the provenance a kernel benchmark's report heads with; KERNEL_META: from a clean commit
REPORT_META = {"gpu": "G", "torch": "t", "triton": "tr", "date": "d", "command": "c"}
KERNEL_META = {**REPORT_META, **CLEAN}


def flce_report(meta):
    meta = {**REPORT_META, "dtype": "bfloat16", **meta}
    return bench_flce.markdown(meta, [{"shape": "8x4x16", "method": "flce", "ms": 1.0,
                                       "extra_mib": 2.0, "vs_gemms": 1.1}], {})


def chunk_sizes_report(meta):
    meta = {**REPORT_META, **meta}
    runs = [{"run": "default", "chunk_size": None, "path": "chunks of 8192", "ms": 11.0,
             "extra_mib": 300.0}, {"run": "c16384", "chunk_size": 16384, "path": "one block",
                                   "ms": 10.0, "extra_mib": 500.0},
            {"run": "c4096", "chunk_size": 4096, "path": "chunks of 4096", "ms": None,
             "extra_mib": None}]
    return bench_chunk_sizes.markdown(meta, [{"shape": "16384x8x16", "gemms_ms": 8.0,
                                              "runs": runs}])


def float8_grid_results():
    def r(shape, method, ms, rounds, **extra):
        return {"shape": shape, "method": method, "ms": ms, "rounds_ms": rounds, **extra}
    results = []
    # a: float8 used, faster, 1.10x its floor; b: float8 used, slower in every round, 1.30x its
    # floor; c: below the threshold (the same code), a hair slower within the rounds' spread
    for shape, used, gemms, floor8, bf16, f8, bf16_rounds, f8_rounds in (
            ("a", "logits+dx", 20.0, 12.0, 21.0, 13.2, [20.8, 21.0, 21.4], [13.0, 13.2, 13.3]),
            ("b", "logits+dx", 20.0, 12.0, 15.0, 15.6, [14.9, 15.0, 15.1], [15.5, 15.6, 15.9]),
            ("c", "none", 2.0, 1.5, 2.2, 2.21, [2.1, 2.2, 2.3], [2.15, 2.21, 2.25])):
        results += [r(shape, "bare_gemms", gemms, [gemms], float8_used=used),
                    r(shape, "float8_floor", floor8, [floor8], vs_gemms=floor8 / gemms)]
        for name, ms, rounds in (("flce", bf16, bf16_rounds), ("flce_float8", f8, f8_rounds)):
            results.append(r(shape, name, ms, rounds, extra_mib=100.0, vs_gemms=ms / gemms,
                             vs_float8_floor=ms / floor8))
    return results


def float8_grid_report(meta):
    meta = {**REPORT_META, "dtype": "bfloat16", **meta}
    return bench_float8_grid.markdown(meta, float8_grid_results())


def attention_report(meta):
    meta = {"gpu": "G", "torch": "t", "cudnn": 1, "date": "d", "command": "c", **meta}
    return bench_attention.markdown(meta, [{"shape": "1x2x1x8x4", "backend": "cudnn", "ms": 1.0,
                                            "tflops": 3.0}])


def peers_report(meta):
    meta = {"config": "c.toml", "flavor": "f", "seq_len": 8, "nproc": 1, "gpu": "G", "torch": "t",
            "triton": "tr", "date": "d", "command": "c", "warmup_steps": 1, **meta}
    return bench_peers.markdown(meta, [], None)


def logits_epilogue_report(meta):
    meta = {**REPORT_META, **meta}
    tiles = [{"config": list(c), "plain_ms": 1.0, "stats_ms": 1.2, "logits_max_abs_diff": 0.0,
              "lse_max_abs_diff": 1e-6} for c in bench_logits_epilogue.CONFIGS]
    return bench_logits_epilogue.markdown(meta, [{
        "shape": "8x4x16", "cublas_ms": 1.0, "stats_pass_ms": 0.2, "cublas_tflops": 5.0,
        "triton": tiles, "best_plain_ms": 1.0, "best_stats_ms": 1.2}])


@pytest.mark.parametrize("render", [flce_report, attention_report, peers_report,
                                    logits_epilogue_report, chunk_sizes_report,
                                    float8_grid_report])
def test_benchmark_reports_name_the_commit_and_flag_a_dirty_tree(render):
    """The GPU benchmarks' markdown (their runs need CUDA; bench_train, compare_layouts and
    bench_loss_parallel are run for real in test_bench_train.py and test_comparison_runs.py)."""
    dirty, clean = render(DIRTY), render(CLEAN)
    assert dirty.startswith("**DIRTY TREE: not reproducible from a commit** (git abc1234+dirty")
    assert "DIRTY" not in clean and "git abc1234" in clean
