"""Environments by registered name or loader path, their arguments checked by signature, task ids namespaced,
and the original HCP config's tools taken from (or checked against) the environment's."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from autoevolve.config import ConfigError, load_config
from autoevolve.envs import Namespaced, make_env
from autoevolve.envs.loading import EnvLoadError, registered
from autoevolve.harness.hcp import HCPConfig

ROOT = Path(__file__).resolve().parents[2]

TOY = """
from pathlib import Path
from autoevolve.records import Message, Task

class Episode:
    finished = False
    def call(self, name, arguments):
        if name != "ping":
            raise KeyError(name)
        return "pong"
    def score(self, messages):
        return 1.0, ""

class Toy:
    name = "toy"
    def __init__(self, size: int, notes: Path | None = None, n_train: int = 4):
        self.size, self.notes, self.n_train = size, notes, n_train
    def tasks(self, split):
        n = {"train": self.n_train, "dev": 2, "test": 2}[split]
        first = {"train": 0, "dev": 1000, "test": 2000}[split]
        return [Task(id=str(first + i), env="toy", split=split, tier=1, request=f"ping {i}") for i in range(n)]
    def tools(self):
        return [{"type": "function", "function": {"name": "ping", "description": "Ping.",
                 "parameters": {"type": "object", "properties": {"host": {"type": "string"}}, "required": []}}}]
    def start(self, task):
        assert task.id.isdigit(), task.id  # the environment sees its own ids
        return Episode()
    def reference(self, task):
        return [Message(role="user", content=task.id)]

def make_twice():
    env = Toy(1)
    env.tasks = lambda split: [Task(id="same", env="toy", split=split, tier=1, request="x")]
    return env
"""


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    """A local environment module beside a run config's folder."""
    path = tmp_path / "toy_env.py"
    path.write_text(TOY)
    return path


def test_the_built_ins_are_registered_as_entry_points() -> None:
    assert {"life", "fncall", "router", "trl"} <= set(registered())
    assert registered()["life"].value == "autoevolve.envs.life:LifeEnv"
    assert len(make_env("life", tiers=(1,), n_train=8, n_dev=4, n_test=4).tasks("train")) == 8


def test_a_local_file_loads_and_its_task_ids_are_namespaced(toy: Path) -> None:
    env = make_env(loader=f"{toy}:Toy", size=3)
    assert isinstance(env, Namespaced) and env.size == 3  # attributes of its own stay reachable
    train = env.tasks("train")
    assert [t.id for t in train] == ["toy/0", "toy/1", "toy/2", "toy/3"] and {t.env for t in train} == {"toy"}
    assert env.start(train[1]).call("ping", {}) == "pong"  # start() got the environment's own id
    assert env.reference(train[2])[0].content == "2"
    assert env.tools()[0]["function"]["name"] == "ping"


def test_a_built_in_keeps_its_ids() -> None:
    env = make_env("life", tiers=(1,), n_train=4, n_dev=4, n_test=4)
    assert not isinstance(env, Namespaced) and env.tasks("dev")[0].id.startswith("life-")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 1, "colour": "red"}, "env.args.colour: Toy() takes no argument 'colour' (it takes: size, notes"),
        ({}, "env.args.size: Toy() needs it; add it under env.args"),
    ],
)
def test_the_factory_signature_checks_the_arguments(toy: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(EnvLoadError, match=re.escape(message)):
        make_env(loader=f"{toy}:Toy", **kwargs)


def test_task_ids_must_be_unique_across_splits(toy: Path) -> None:
    with pytest.raises(EnvLoadError, match="task id 'same' appears twice"):
        make_env(loader=f"{toy}:make_twice")


def _config(tmp_path: Path, env: str, hcp: str = "") -> Path:
    """A run config in tmp_path/cfg with the given env section (and HCP file text)."""
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    (folder / "hcp.yaml").write_text(hcp or "system_prompt: 'Tools: {tools}'\n")
    path = folder / "run.yaml"
    path.write_text(f"hcp: hcp.yaml\nenv: {env}\n")
    return path


def test_a_config_finds_the_loader_file_and_path_arguments_beside_it(tmp_path: Path, toy: Path) -> None:
    (tmp_path / "cfg").mkdir()
    toy.rename(tmp_path / "cfg" / "toy_env.py")
    (tmp_path / "cfg" / "notes.txt").write_text("hi")
    config = load_config(_config(tmp_path, "{loader: 'toy_env.py:Toy', args: {size: 2, notes: notes.txt}, n_train: 3}"))
    env = config.env.make()
    assert env.notes == tmp_path / "cfg" / "notes.txt" and len(env.tasks("train")) == 3
    assert config.env.make() is env  # built once
    assert config.original_hcp().tools == env.tools()  # the file lists none: the environment's own


def test_a_common_setting_the_factory_does_not_take_is_refused_only_when_set(tmp_path: Path, toy: Path) -> None:
    (tmp_path / "cfg").mkdir()
    toy.rename(tmp_path / "cfg" / "toy_env.py")
    assert load_config(_config(tmp_path, "{loader: 'toy_env.py:Toy', args: {size: 2}}")).env.make().size == 2
    with pytest.raises(ConfigError, match=re.escape("env.n_dev: Toy() takes no 'n_dev' (it takes: size, notes")):
        load_config(_config(tmp_path, "{loader: 'toy_env.py:Toy', args: {size: 2}, n_dev: 5}"))


LIFE_TOOL = """system_prompt: 'Tools: {{tools}}'
tools:
- type: function
  function:
    name: {name}
    description: Book a table, briefly described.
    parameters:
      type: object
      properties: {{restaurant_id: {{type: string}}, party_size: {{type: integer}}, time: {{type: string}}{extra}}}
      required: [restaurant_id]
"""


@pytest.mark.parametrize(
    ("name", "extra", "message"),
    [
        ("fly", "", "tools[0]: the environment has no tool 'fly' (it has: search_restaurants, book_table,"),
        ("book_table", ", seats: {type: integer}", "tools[0] (book_table): the environment's book_table takes no "
         "parameter 'seats' (it takes: restaurant_id, party_size, time)"),
    ],
)  # fmt: skip
def test_an_hcp_tool_or_parameter_the_environment_lacks_is_refused(
    tmp_path: Path, name: str, extra: str, message: str
) -> None:
    path = _config(tmp_path, "{name: life, tiers: [1]}", LIFE_TOOL.format(name=name, extra=extra))
    with pytest.raises(ConfigError, match=re.escape(f"hcp.yaml: {message}")):
        load_config(path)


def test_an_hcp_tool_may_reword_the_environment_description(tmp_path: Path) -> None:
    config = load_config(_config(tmp_path, "{name: life, tiers: [1]}", LIFE_TOOL.format(name="book_table", extra="")))
    [tool] = config.original_hcp().tools
    assert tool["function"]["description"] == "Book a table, briefly described."
    shipped = load_config(ROOT / "configs/quickstart.yaml").original_hcp()
    assert shipped.id == HCPConfig.from_yaml(ROOT / "prompts/life.yaml").id == "fe54907e90c2"  # ids unchanged


def test_a_required_parameter_left_out_is_refused() -> None:
    tools = make_env("life", tiers=(1,), n_train=4, n_dev=4, n_test=4).tools()
    hcp = HCPConfig.model_validate({"system_prompt": "x", "tools": [tools[1] | {"function": {"name": "book_table"}}]})
    with pytest.raises(ValueError, match=r"tools\[0\] \(book_table\): required parameter 'restaurant_id' is missing"):
        hcp.with_env_tools(tools)


def test_the_units_example_loads_from_outside_the_package() -> None:
    config = load_config(ROOT / "examples/units/run.yaml")
    env = config.env.make()
    assert env.name == "units" and [t["function"]["name"] for t in config.original_hcp().tools] == ["convert"]
    assert not any(
        "units_env" in p.read_text() or "UnitsEnv" in p.read_text() for p in (ROOT / "autoevolve").rglob("*.py")
    )
    task = env.tasks("train")[0]
    episode = env.start(task)
    reply = env.reference(task)
    assert episode.call("convert", reply[1].tool_calls[0].arguments) == reply[2].content
    assert episode.score(reply) == (1.0, "")
    half = episode.score(reply[:3] + [reply[3].model_copy(update={"content": "It is 7."})])
    assert half[0] == 0.5 and "The final reply should state" in half[1]


def test_the_protocol_page_exists_and_names_every_method() -> None:
    text = (ROOT / "docs/environments.md").read_text()
    for name in ("tasks(", "tools(", "start(", "reference(", "call(", "score(", "finished", "KeyError", "loader"):
        assert name in text, name
    assert textwrap.dedent(text).count("```") % 2 == 0


def test_check_prints_what_the_environment_skipped_and_why(tmp_path: Path, capsys) -> None:
    from autoevolve import cli

    data = ROOT / "autoevolve/envs/data/bfcl_parallel_sample.jsonl"
    path = tmp_path / "run.yaml"
    path.write_text(f"hcp: {ROOT}/prompts/fncall.yaml\nenv: {{name: fncall, args: {{path: {data}}}, tiers: [1, 2]}}\n")
    assert cli.main(["check", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "env fncall: 5 train, 2 dev, 2 test tasks; 3 references scored 1.0" in lines[0] and len(lines) == 3
    assert (
        lines[1] == "  skipped 1 question: no ground truth (BFCL's irrelevance and relevance categories: the right "
        "reply is no call)"
    )
    assert lines[2].startswith("  skipped 1 question: multi-turn question")


def test_a_loaded_config_survives_a_round_trip_through_json(tmp_path: Path, toy: Path) -> None:
    from autoevolve.config import RunConfig

    (tmp_path / "cfg").mkdir()
    toy.rename(tmp_path / "cfg" / "toy_env.py")
    config = load_config(_config(tmp_path, "{loader: 'toy_env.py:Toy', args: {size: 2}}"))
    again = RunConfig.model_validate_json(config.model_dump_json())  # as a deployment's parameters arrive
    assert again.env.make().size == 2 and again.original_hcp().id == config.original_hcp().id


def test_a_loader_file_imports_the_modules_beside_it(tmp_path: Path) -> None:
    (tmp_path / "helpers_beside.py").write_text("SIZE = 7\n")
    (tmp_path / "uses_helper.py").write_text(
        TOY + "\nfrom helpers_beside import SIZE\n\ndef make():\n    return Toy(SIZE)\n"
    )
    assert make_env(loader=str(tmp_path / "uses_helper.py") + ":make").size == 7
