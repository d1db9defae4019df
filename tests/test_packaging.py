"""The package as pip builds it: every module and config file ends up in the wheel, and the build
prints no warnings about undeclared package folders."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from .conftest import REPO


def test_every_config_folder_is_declared_and_the_wheel_holds_every_yaml(tmp_path: Path):
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    conf = [REPO / "conf", *(p for p in (REPO / "conf").rglob("*") if p.is_dir() and p.name != "__pycache__")]
    folders = {"ddpexp." + ".".join(p.relative_to(REPO).parts) for p in conf}
    code = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "ddpexp").rglob("__init__.py")}
    assert folders | code <= declared, sorted((folders | code) - declared)
    shutil.rmtree(REPO / "build", ignore_errors=True)  # setuptools would pack stale modules left there
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "absent from the `packages` configuration" not in proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("ddpexp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {"ddpexp/conf/" + str(p.relative_to(REPO / "conf")) for p in (REPO / "conf").rglob("*.yaml")}
    assert shipped <= names, sorted(shipped - names)
    assert "ddpexp/predict/validation.json" in names  # the record ddpexp plan's ranges come from
    modules = {str(p.relative_to(REPO)) for p in (REPO / "ddpexp").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    packed = {n for n in names if n.startswith("ddpexp/") and n.endswith(".py")}
    assert packed <= modules | {"ddpexp/conf/__init__.py"}, sorted(packed - modules)  # nothing stale
