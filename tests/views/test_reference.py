"""The docs' reference tables are generated from the code and match it."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoevolve.harness.hcp import PLACEHOLDERS, HCPConfig
from autoevolve.records import Task
from autoevolve.views.reference import fields, refresh

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["docs/environments.md", "docs/hcp.md"])
def test_the_docs_tables_match_the_code(doc: str) -> None:
    text = (ROOT / doc).read_text()
    assert "<!-- generated: " in text
    assert refresh(text) == text, f"run: python -m autoevolve.views.reference {doc}"


def test_every_field_of_a_task_and_of_the_hcp_config_has_a_row() -> None:
    task_rows = fields(Task).splitlines()[2:]
    assert [row.split("|")[1].strip(" `") for row in task_rows] == [
        n for n in Task.model_fields if n != "schema_version"
    ]
    assert "| `tier` | int | required | Difficulty, 1 or more" in fields(Task)
    hcp = fields(HCPConfig)
    assert all(f"| `{name}` |" in hcp for name in HCPConfig.model_fields)
    assert "| `demos` | Demos | see `Demos` |" in hcp
    text = (ROOT / "docs/hcp.md").read_text()
    assert all(f"| `{{{p}}}` |" in text for p in PLACEHOLDERS)


def test_refresh_names_an_unknown_section() -> None:
    with pytest.raises(KeyError, match="nonsense"):
        refresh("<!-- generated: nonsense -->\n<!-- end: nonsense -->\n")
