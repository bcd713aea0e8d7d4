"""docs/environments.md as a new user follows it: its files written into an empty folder (they are the units
example's, byte for byte), then its commands run there: check, a full round on SmolLM2, and eval."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from autoevolve import cli

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "environments.md"


def blocks() -> list[tuple[str, str]]:
    """(language, body) of each fenced block of the page, in order."""
    return re.findall(r"```(\w+)\n(.*?)```", DOC.read_text(), flags=re.S)


def walkthrough() -> tuple[dict[str, str], list[str]]:
    """The walk-through's files (a block whose first line is '# NAME' with NAME a file of examples/units) and its
    commands (the lines of its bash blocks)."""
    files, commands = {}, []
    for lang, body in blocks():
        first, _, rest = body.partition("\n")
        name = first.removeprefix("# ").strip()
        if lang in ("python", "yaml") and (ROOT / "examples" / "units" / name).is_file():
            files[name] = rest
        elif lang == "bash":
            commands += [line for line in body.splitlines() if line.startswith("autoevolve ")]
    return files, commands


def test_the_page_writes_the_units_example_verbatim() -> None:
    files, commands = walkthrough()
    assert sorted(files) == ["hcp.yaml", "run.yaml", "units_env.py"]
    for name, text in files.items():
        assert text == (ROOT / "examples" / "units" / name).read_text(), name
    assert [c.split()[1] for c in commands] == ["check", "run", "eval"]


def test_the_check_command_passes_in_the_written_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    files, commands = walkthrough()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    assert cli.main(shlex.split(commands[0])[1:]) == 0
    assert "env units: 64 train, 16 dev, 32 test tasks" in capsys.readouterr().out


@pytest.mark.integration
@pytest.mark.slow  # a full round on SmolLM2: a few minutes
def test_the_walkthrough_runs_a_round_and_eval_scores_its_adapter(
    tmp_path: Path, monkeypatch, capsys, prefect_harness, smol_policy
) -> None:
    files, commands = walkthrough()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("autoevolve.loop.make_policy", lambda config: smol_policy)  # share the loaded model
    codes = [cli.main(shlex.split(c)[1:]) for c in commands]
    assert codes == [0, 0, 0]
    report = json.loads((tmp_path / "trajectories/runs/units/report.json").read_text())
    assert report["selected"] >= 1 and Path(report["adapter_path"], "adapter_model.safetensors").is_file()
    assert report["eval"]["n_tasks"] == 32
    scored = json.loads((tmp_path / "trajectories/runs/units/eval.json").read_text())
    cell = "new_original" if report["promoted"] else "live_original"  # eval scores the live version
    assert scored["n_tasks"] == 32 and scored["run_id"] == "units-eval"
    assert scored["mean"] == pytest.approx(report["eval"][cell], abs=1e-9)
    assert f"mean reward {scored['mean']:.3f}" in capsys.readouterr().out
