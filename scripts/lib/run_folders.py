"""The dump folders that the comparison and benchmark scripts run the trainer in.

Each run starts from an empty folder (metrics.jsonl is appended to and a checkpoint would be
resumed), so a rerun clears the folder of the run before. A folder is cleared only when one of
these scripts made it, which it marks with MARKER; a folder holding anything else may be a
user's own run (an OUT_DIR or --runs-dir shared with training) and is refused, before any run
starts. A working folder a script reuses across runs (`bench.data --work-dir`) is claimed the
same way (`claim_folder`) before the script clears anything inside it. The shell scripts call it as
    python3 -m scripts.lib.run_folders check DIR ...   (exit 2 naming the first refused folder)
    python3 -m scripts.lib.run_folders fresh DIR ...   (check all, then clear and mark each)
"""

import shutil
import sys
from pathlib import Path

MARKER = ".scratch-run"


def check_clearable(path: Path | str) -> None:
    """Raise FileExistsError unless path is absent, an empty folder, or a folder MARKER marks."""
    path = Path(path)
    if path.is_symlink():  # clearing one would clear, or refuse, what it points to
        raise FileExistsError(f"{path} is a symbolic link (to {path.readlink()}), not a run "
                              "folder: not clearing it; name the folder itself")
    if not path.exists():
        return
    if not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a run folder: not replacing it")
    if any(path.iterdir()) and not (path / MARKER).is_file():
        raise FileExistsError(f"{path} holds files that no script run made (no {MARKER}): not "
                              "clearing it; pick another output folder or remove it yourself")


def fresh_run_folder(path: Path | str) -> Path:
    """path as an empty folder but for MARKER: made if absent, cleared if a script made it,
    refused (FileExistsError, nothing touched) if it holds anything else."""
    path = Path(path)
    check_clearable(path)
    if path.exists():
        shutil.rmtree(path)
    return claim_folder(path)


def claim_folder(path: Path | str) -> Path:
    """path as a folder a script may clear the contents of, kept as it is (a working folder
    reused across runs, e.g. a corpus and its tokenizer): made and marked if absent or empty,
    reused if MARKER marks it, refused (FileExistsError, nothing touched) if it holds anything
    else."""
    path = Path(path)
    check_clearable(path)
    path.mkdir(parents=True, exist_ok=True)
    marker = path / MARKER
    if not marker.is_file():
        marker.write_text("made by a script of this repository; a rerun of that script may "
                          "clear what this folder holds\n")
    return path


def exit_unless_clearable(paths) -> None:
    """Before a script's first run: exit 2 with a one-line error naming the first of paths that
    `fresh_run_folder` would refuse, so that no run starts (and none is lost) over it."""
    for path in paths:
        try:
            check_clearable(path)
        except FileExistsError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("check", "fresh"):
        print("usage: python3 -m scripts.lib.run_folders check|fresh DIR ...", file=sys.stderr)
        return 2
    exit_unless_clearable(argv[1:])
    if argv[0] == "fresh":
        for path in argv[1:]:
            fresh_run_folder(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
