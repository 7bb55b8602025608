"""benchmarks/: README.md indexes every result kept there and in archive/, and every result path
the README, docs/ and the benchmarks' own READMEs cite exists (a result moved to archive/ takes its
citations with it)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
CITING = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *BENCHMARKS.rglob("README.md"), *(REPO / "flce").glob("*.py"),
          *(REPO / "models").glob("*.py"), *(REPO / "scripts").glob("*.py")]
# A result file, or a folder of them (`benchmarks/x/`); output paths in usage examples
# (`--out benchmarks/train_h200`) have no suffix and are not results.
CITED = re.compile(r"benchmarks/[\w.*/-]*?(?:\.(?:md|json|png)\b|/(?=[`\s)]))")


def test_every_cited_result_exists():
    missing = []
    for path in CITING:
        for cited in CITED.findall(path.read_text()):
            if not list(REPO.glob(cited.rstrip("/"))):
                missing.append(f"{path.relative_to(REPO)}: {cited}")
    assert missing == []


def test_the_index_names_every_result():
    index = (BENCHMARKS / "README.md").read_text()
    results = [p for folder in (BENCHMARKS, BENCHMARKS / "archive") for p in folder.iterdir()
               if p.suffix == ".md" and p.name != "README.md" or p.is_dir() and p.name != "archive"]
    prefix = lambda p: "archive/" if p.parent.name == "archive" else ""  # noqa: E731
    unindexed = [p.name for p in results
                 if f"`{prefix(p)}{p.name}{'/' if p.is_dir() else ''}`" not in index]
    assert unindexed == []
    # every JSON record has its markdown twin (what the index names)
    orphans = [p.name for p in BENCHMARKS.rglob("*.json") if not p.with_suffix(".md").exists()]
    assert orphans == []

