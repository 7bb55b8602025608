"""scripts/lib/run_folders.py: the run folders that scripts clear only when they made them."""

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.lib import run_folders

REPO = Path(__file__).resolve().parents[1]


def test_fresh_run_folder_makes_clears_its_own_and_refuses_the_rest(tmp_path):
    made = run_folders.fresh_run_folder(tmp_path / "a" / "run")
    assert sorted(p.name for p in made.iterdir()) == [run_folders.MARKER]
    (made / "metrics.jsonl").write_text("{}\n")
    (made / "checkpoint").mkdir()
    assert sorted(p.name for p in run_folders.fresh_run_folder(made).iterdir()) == [
        run_folders.MARKER]
    (tmp_path / "empty").mkdir()
    run_folders.fresh_run_folder(tmp_path / "empty")
    mine = tmp_path / "mine"
    (mine / "checkpoint").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="holds files that no script run made"):
        run_folders.fresh_run_folder(mine)
    assert (mine / "checkpoint").is_dir() and not (mine / run_folders.MARKER).exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        run_folders.fresh_run_folder(tmp_path / "file")


@pytest.mark.parametrize("target", ["marked", "missing"])
def test_a_symlinked_run_folder_is_refused_in_one_line(tmp_path, target):
    """`run_folders fresh LINK` to a marked folder was rmtree's traceback ("Cannot call rmtree
    on a symbolic link"); to a missing one it made the folder through the link."""
    real = tmp_path / "real"
    if target == "marked":
        run_folders.fresh_run_folder(real)
        (real / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "link").symlink_to(real)
    result = subprocess.run([sys.executable, "-m", "scripts.lib.run_folders", "fresh",
                             str(tmp_path / "link")], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr == (f"error: {tmp_path / 'link'} is a symbolic link (to {real}), not a "
                             "run folder: not clearing it; name the folder itself\n")
    assert (real / "metrics.jsonl").is_file() if target == "marked" else not real.exists()


def test_run_folders_command_checks_every_folder_before_clearing_any(tmp_path):
    ours = run_folders.fresh_run_folder(tmp_path / "ours")
    (ours / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes").write_text("x")
    cmd = [sys.executable, "-m", "scripts.lib.run_folders", "fresh", str(ours),
           str(tmp_path / "mine")]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and result.stderr.startswith(f"error: {tmp_path / 'mine'}")
    assert (ours / "metrics.jsonl").is_file()  # nothing cleared: one folder was refused
    result = subprocess.run(cmd[:-1] + [str(tmp_path / "new")], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert not (ours / "metrics.jsonl").exists() and (tmp_path / "new" / run_folders.MARKER).is_file()


def test_claim_folder_keeps_its_own_folder_and_refuses_a_users(tmp_path):
    work = run_folders.claim_folder(tmp_path / "work")
    (work / "corpus.txt").write_text("kept across runs")
    assert run_folders.claim_folder(work) == work and (work / "corpus.txt").is_file()
    mine = tmp_path / "mine"
    (mine / "shards").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="holds files that no script run made"):
        run_folders.claim_folder(mine)
    assert not (mine / run_folders.MARKER).exists()


def test_bench_data_refuses_a_work_dir_it_did_not_make(tmp_path):
    """A rerun of bench.data clears work/shards: pointed at a user's folder, it deleted the
    user's shards there before anything was checked."""
    from scripts.bench import data as bench_data
    mine = tmp_path / "corpus"
    (mine / "shards").mkdir(parents=True)
    (mine / "shards" / "index.json").write_text("{}")
    with pytest.raises(SystemExit, match="--work-dir: .*no script run made"):
        bench_data.main(["--work-dir", str(mine), "--out", str(tmp_path / "out")])
    assert (mine / "shards" / "index.json").read_text() == "{}"
