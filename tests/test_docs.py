"""README.md and docs/: every relative link (and #anchor) resolves inside the repository, and the
README's two set-up commands stay true: the test command is the one CI runs verbatim, the training
command names a config that loads."""

import re
from pathlib import Path

from components.config.parse import load_config

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks/README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def without_code(text: str) -> str:
    """Fenced blocks and inline code hold example text, not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, -1, -2... for
    repeats."""
    seen: dict[str, int] = {}
    ids = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", without_code(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        ids.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return ids


def test_the_docs_pages_exist():
    assert len(PAGES) > 3  # docs/*.md found: the link check and tests/test_benchmarks.py read them


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(without_code(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not resolved.is_relative_to(REPO) or not resolved.exists():
                broken.append(f"{where}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where}: no heading #{anchor}")
    assert broken == []


def test_the_anchor_rule_matches_githubs():
    page = REPO / "docs/performance.md"
    assert {"the-loss-alone-one-h200", "the-fastest-recipe-float8-against-torchtitan",
            "two-h200s"} <= anchors(page)


def readme_setup_commands() -> list[str]:
    section = (REPO / "README.md").read_text().split("## Set-up on a fresh machine: two commands")[1]
    section = section.split("\n## ")[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_the_readmes_test_command_is_what_ci_runs():
    train_command, test_command, fast_subset = readme_setup_commands()
    ci = (REPO / ".ci/run").read_text().splitlines()
    assert test_command in ci, f"README's test command {test_command!r} is not a line of .ci/run"
    assert fast_subset == 'python3 -m pytest -q -m "not slow"'
    assert 'markers = ["slow:' in (REPO / "pyproject.toml").read_text()


def test_the_readmes_training_command_loads_its_config(monkeypatch):
    train_command = readme_setup_commands()[0]
    install, run = train_command.split(" && ")
    assert install == 'pip install torch==2.13.0 -e ".[recipe]"'
    argv = run.split()
    assert argv[:2] == ["python3", "train.py"]
    monkeypatch.chdir(REPO)  # the README runs it from the repository root
    config = load_config(argv[2:])
    assert config.data.source == "stdlib"  # the embedded, offline default


CODE_SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^((?:flce|components|models|parallelisms)(?:\.[A-Za-z_]\w*)+)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:\.\./)*(?:flce|components|models|parallelisms|scripts|configs|"
                       r"tests|docs|benchmarks|shared)/[\w./-]*\.(?:py|md|toml|sh|json|sbatch))")


USER_FILES = {line.strip().lstrip("/") for line in (REPO / ".gitignore").read_text().splitlines()
              if line.strip().endswith((".sh", ".toml", ".json"))}


def code_spans(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return CODE_SPAN.findall(text)


def resolves(dotted: str) -> bool:
    """Whether `a.b.C.d` names something: the longest importable module prefix, then attributes."""
    import importlib
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_the_code_the_docs_name_exists():
    """Names such as `flce.parallel.VocabParallelLinearLoss` and paths such as `flce/ops.py` in
    the docs' inline code exist in the repository (parallelism.md named a module the class had
    left; performance.md pointed at a file outside the repository)."""
    missing = []
    for page in PAGES:
        where = page.relative_to(REPO)
        for span in code_spans(page):
            dotted = DOTTED.match(span)
            if dotted and not resolves(dotted.group(1)):
                missing.append(f"{where}: `{span}` names nothing importable")
            for path in REPO_PATH.findall(span):
                if path in USER_FILES:  # a file the docs ask the user to write
                    continue
                base = REPO if not path.startswith("..") else page.parent
                resolved = (base / path).resolve()
                if not resolved.is_relative_to(REPO) or not resolved.exists():
                    missing.append(f"{where}: `{span}`: {path} is not a file of the repository")
    assert missing == []


def test_the_readmes_layout_names_every_module():
    """README's layout lists the modules of the packages it enumerates by name: a module added
    without a line there (launch, quantize_kernels, run_folders and two benchmarks were missing)
    fails here."""
    layout = re.search(r"```\ntrain\.py .*?```", (REPO / "README.md").read_text(), re.S).group(0)
    named = set(re.findall(r"\w+", layout))
    missing = [f"{package}/{path.stem}" for package in
               ("flce", "scripts/bench", "scripts/lib", "components", "components/data")
               for path in sorted((REPO / package).glob("*.py"))
               if path.stem != "__init__" and path.stem not in named]
    assert missing == []


def test_each_package_docstring_lists_every_module():
    """A package whose docstring lists its modules ("    name.py  what it holds") lists all of
    them: scripts/bench's list had left out six benchmarks and peer_runs/."""
    checked, missing = [], []
    for init in sorted(REPO.glob("**/__init__.py")):
        if any(part.startswith(".") for part in init.relative_to(REPO).parts):
            continue
        package = init.parent
        text = init.read_text()
        if not re.search(r"^\s+\w+\.py\s", text, re.M):
            continue  # no module list
        checked.append(package.relative_to(REPO))
        named = set(re.findall(r"(\w+)(?:\.py\b|/)", text))
        missing += [f"{package.relative_to(REPO)}/{path.name}" for path in sorted(package.iterdir())
                    if (path.suffix == ".py" and path.stem != "__init__" and path.stem not in named)
                    or (path.is_dir() and not path.name.startswith((".", "__"))
                        and path.name not in named)]
    assert checked and missing == [], missing
