"""Task files: JSONL, CSV and Parquet rows read with datasets, column mapping, seeded splits, row errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from pydantic import ValidationError

from autoevolve.envs.taskfile import Columns, parse_rows, read_rows, reference_messages, split_rows
from autoevolve.records import Message, ToolCall

ROWS = [
    {"id": "a", "prompt": "Order two apples.", "tier": 1},
    {"id": "b", "prompt": "Order a pear.", "tier": 2},
    {"id": "c", "prompt": "How many plums are left?", "tier": 1},
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Rows as JSON lines."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def numbered(n: int, **extra: Any) -> list[dict[str, Any]]:
    """n rows with ids q0.. and a one-line prompt each."""
    return [{"id": f"q{i}", "prompt": f"Question {i}?", **extra} for i in range(n)]


def ids(rows: list) -> list[str]:
    """The ids of checked rows, in order."""
    return [r.id for r in rows]


def test_jsonl_csv_and_parquet_give_the_same_rows(tmp_path: Path) -> None:
    """The three file types read to the same rows, in file order."""
    jsonl = write_jsonl(tmp_path / "t.jsonl", ROWS)
    csv = tmp_path / "t.csv"
    pd.DataFrame(ROWS).to_csv(csv, index=False)
    parquet = tmp_path / "t.parquet"
    pd.DataFrame(ROWS).to_parquet(parquet)
    for path in (jsonl, csv, parquet):
        assert read_rows(path) == ROWS, path.suffix


def test_parquet_keeps_message_prompts(tmp_path: Path) -> None:
    """A list of messages survives Parquet and becomes the row's prompt messages."""
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path = tmp_path / "m.parquet"
    pd.DataFrame([{"prompt": prompt}]).to_parquet(path)
    [row] = parse_rows(read_rows(path), Columns(), where=str(path))
    assert (row.number, row.id, row.tier, row.prompt) == (1, "1", 1, prompt)


def test_column_mapping(tmp_path: Path) -> None:
    """Mapped columns give the prompt, ids and tiers; every original column stays in the row's data."""
    rows = [{"question": "Q1", "uid": 7, "level": 2, "answer": "x"}, {"question": "Q2", "uid": 9, "level": 1}]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    parsed = parse_rows(read_rows(path), Columns(prompt="question", id="uid", tier="level"), where=str(path))
    assert [(r.id, r.tier, r.prompt[0]["content"]) for r in parsed] == [("7", 2, "Q1"), ("9", 1, "Q2")]
    assert parsed[1].data == {"question": "Q2", "uid": 9, "level": 1, "answer": None}  # arrow fills the gap


def test_a_missing_mapped_column_names_file_column_and_columns(tmp_path: Path) -> None:
    """A mapped column the file lacks is a one-line error with the file, the column and what is there."""
    path = write_jsonl(tmp_path / "m.jsonl", ROWS)
    with pytest.raises(ValueError) as err:
        parse_rows(read_rows(path), Columns(prompt="question"), where=str(path))
    assert str(err.value) == f"{path}: no column 'question' (mapped as prompt); available columns: id, prompt, tier"
    with pytest.raises(ValidationError, match="promt"):
        Columns(promt="question")


def test_same_seed_same_splits_and_file_order(tmp_path: Path) -> None:
    """Same file and seed give the same disjoint splits of the asked sizes, each in file order."""
    path = write_jsonl(tmp_path / "n.jsonl", numbered(40))
    rows = parse_rows(read_rows(path), Columns(id="id"), where=str(path))
    first = split_rows(rows, seed=3, n_train=20, n_dev=8, n_test=10)
    again = split_rows(
        parse_rows(read_rows(path), Columns(id="id"), where=str(path)), seed=3, n_train=20, n_dev=8, n_test=10
    )
    assert {s: ids(r) for s, r in first.items()} == {s: ids(r) for s, r in again.items()}
    assert [len(first[s]) for s in ("train", "dev", "test")] == [20, 8, 10]
    assert len({r.id for split in first.values() for r in split}) == 38
    assert all([r.number for r in split] == sorted(r.number for r in split) for split in first.values())
    other = split_rows(rows, seed=4, n_train=20, n_dev=8, n_test=10)
    assert ids(other["test"]) != ids(first["test"])


def test_held_out_splits_stay_put_when_only_n_train_changes() -> None:
    """Growing or shrinking n_train leaves dev and test as they were."""
    rows = parse_rows(numbered(40), Columns(id="id"), where="n.jsonl")
    small = split_rows(rows, seed=0, n_train=5, n_dev=8, n_test=10)
    large = split_rows(rows, seed=0, n_train=22, n_dev=8, n_test=10)
    assert ids(small["test"]) == ids(large["test"]) and ids(small["dev"]) == ids(large["dev"])
    assert set(ids(small["train"])) < set(ids(large["train"])) and len(large["train"]) == 22


def test_a_small_file_falls_back_to_shares() -> None:
    """Fewer rows than asked: 20% test, 20% dev, the rest train."""
    rows = parse_rows(numbered(10), Columns(), where="n.jsonl")
    splits = split_rows(rows, seed=0, n_train=256, n_dev=64, n_test=96)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [6, 2, 2]


def test_a_split_column_decides() -> None:
    """Rows go where their split column says ('validation' is dev); a split with more rows keeps a seeded sample."""
    parts = ["train", "validation", "test", "train", "dev", "TEST", "train", "train"]
    rows = parse_rows(
        [{**r, "part": p} for r, p in zip(numbered(8), parts, strict=True)], Columns(id="id", split="part"), where="s"
    )
    splits = split_rows(rows, seed=0, n_train=10, n_dev=10, n_test=10)
    assert {s: ids(r) for s, r in splits.items()} == {
        "train": ["q0", "q3", "q6", "q7"],
        "dev": ["q1", "q4"],
        "test": ["q2", "q5"],
    }
    capped = split_rows(rows, seed=0, n_train=2, n_dev=10, n_test=10)
    assert len(capped["train"]) == 2 and set(ids(capped["train"])) < {"q0", "q3", "q6", "q7"}
    assert capped["dev"] == splits["dev"] and capped == split_rows(rows, seed=0, n_train=2, n_dev=10, n_test=10)


BAD_ROWS = [
    ({"prompt": 42}, Columns(), "column 'prompt': the prompt is not a string or a list of messages"),
    (
        {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        Columns(),
        "column 'prompt': the prompt does not end with a user message; give a string or a list of",
    ),
    ({"prompt": "Hi", "id": "q0"}, Columns(id="id"), "column 'id': duplicate id 'q0'; ids must be unique"),
    ({"prompt": "Hi", "level": 0}, Columns(tier="level"), "column 'level': tier 0 is not a positive integer"),
    ({"prompt": "Hi", "level": "two"}, Columns(tier="level"), "column 'level': tier 'two' is not a positive integer"),
    ({"prompt": "Hi", "part": "holdout"}, Columns(split="part"), "column 'part': unknown split 'holdout'; use train"),
    ({"prompt": "Hi", "ref": "not json"}, Columns(reference="ref"), "column 'ref': not valid JSON"),
    (
        {"prompt": "Hi", "ref": [{"role": "user", "content": "again"}]},
        Columns(reference="ref"),
        "column 'ref': message 1: expected an assistant or tool message",
    ),
    (
        {"prompt": "Hi", "ref": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
        Columns(reference="ref"),
        "column 'ref': message 1: call 1: expected {function: {name, arguments}}",
    ),
]


@pytest.mark.parametrize(("bad", "columns", "message"), BAD_ROWS)
def test_a_malformed_row_names_file_row_and_column(bad: dict, columns: Columns, message: str) -> None:
    """The second row is the bad one: the error starts with file:2 and the column, and ends with the fix."""
    good = {"prompt": "Fine.", "id": "q0", "level": 1, "part": "train", "ref": None}
    rows = [good, {**{k: v for k, v in good.items() if k != "id"}, "id": "q1", **bad}]
    with pytest.raises(ValueError) as err:
        parse_rows(rows, columns, where="shop.jsonl")
    assert str(err.value).startswith(f"shop.jsonl:2: {message}"), str(err.value)
    assert "\n" not in str(err.value) and "; " in str(err.value)


def test_reference_messages_from_openai_format() -> None:
    """JSON-string and object arguments both work; arrow's None-filled keys are dropped; tool ids pair up."""
    ref = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c9", "type": "function", "function": {"name": "check_stock", "arguments": '{"item": "apple"}'}}
            ],
        },
        {"role": "tool", "content": "5", "tool_call_id": None},
        {
            "role": "assistant",
            "tool_calls": [
                {"function": {"name": "order", "arguments": {"item": "apple", "quantity": 2, "note": None}}}
            ],
        },
        {"role": "tool", "content": "ordered 2 apple"},
        {"role": "assistant", "content": "Done."},
    ]
    assert reference_messages(json.dumps(ref), "f:1") == [
        Message(role="assistant", tool_calls=[ToolCall.make("c9", "check_stock", {"item": "apple"})]),
        Message(role="tool", content="5", tool_call_id="c9"),
        Message(role="assistant", tool_calls=[ToolCall.make("call_2", "order", {"item": "apple", "quantity": 2})]),
        Message(role="tool", content="ordered 2 apple", tool_call_id="call_2"),
        Message(role="assistant", content="Done."),
    ]


def test_unreadable_sources_say_what_to_do(tmp_path: Path) -> None:
    """An unknown suffix, a missing file, an uncached dataset name: ValueErrors with the fix."""
    odd = tmp_path / "t.txt"
    odd.write_text("hi")
    with pytest.raises(ValueError, match=r"unknown file type '\.txt'; give a \.jsonl, \.json, \.parquet, \.csv file"):
        read_rows(odd)
    with pytest.raises(ValueError, match="no file at .*missing.jsonl"):
        read_rows(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="is neither a file nor in the local HF cache .*download it first"):
        read_rows("autoevolve-tests/no-such-dataset")
