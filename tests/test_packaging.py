"""What a non-editable install gets: every module and data file the package reads, under names that are its own."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = out.glob("autoevolve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_the_package_list_names_every_package_folder() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "autoevolve").rglob("__init__.py")}
    assert folders - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - folders == {"autoevolve_flows"}


def test_the_wheel_holds_every_module_and_the_data_it_reads(wheel_names: set[str]) -> None:
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "autoevolve").rglob("*.py")}
    assert sources - wheel_names == set()
    assert "autoevolve/stages/evolve/meta_prompts.yaml" in wheel_names  # the reflective mutator's default meta-prompts
    data = {str(p.relative_to(ROOT)) for p in (ROOT / "autoevolve" / "envs" / "data").glob("*.jsonl")}
    assert data and data <= wheel_names
    flows = {f"autoevolve_flows/{p.name}" for p in (ROOT / "flows").glob("*.py")}
    assert flows and flows <= wheel_names
    assert not any(n.startswith("flows/") for n in wheel_names)  # no generic top-level name


def test_the_default_meta_prompts_ship_inside_the_package() -> None:
    import autoevolve
    from autoevolve.stages.settings import ReflectionSettings

    path = ReflectionSettings().meta_prompts
    assert Path(autoevolve.__file__).parent in path.parents and path.is_file()


def test_no_two_modules_of_the_package_share_a_file_name() -> None:
    names = [p.name for p in (ROOT / "autoevolve").rglob("*.py") if p.name != "__init__.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []
