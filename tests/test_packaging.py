"""`pip install .` installs the loss, `flce`, and nothing else: the recipe's packages
(components, models, parallelisms, scripts) run from the repository and must not land in
site-packages as top-level modules that collide with other projects'."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "train.py", "configs", "flce", "components", "models",
           "parallelisms", "scripts", "tests"]


def test_the_wheel_holds_only_flce(tmp_path):
    pytest.importorskip("setuptools", minversion="70.1")  # builds wheels without `wheel`
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                             "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    [wheel] = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"flce", wheel.name.split("-py3")[0] + ".dist-info"}, top_level
    assert {f"flce/{p.name}" for p in (REPO / "flce").glob("*.py")} <= set(names)
