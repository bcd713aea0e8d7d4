"""TRLEnvironment: a TRL-style environment class run by autoevolve: tools, reset, reward, feedback, references."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers.utils import get_json_schema

from autoevolve.envs.loading import path_arguments
from autoevolve.envs.trl_style import TRLEnvironment
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.rollout import apply
from autoevolve.policy import Completion
from autoevolve.records import Message, ToolCall


class Shop:
    """A shop with stock from the row; the reward is 1 when exactly the row's order was placed, else -1."""

    def __init__(self) -> None:
        self.stock: dict[str, int] = {}
        self.ordered: dict[str, int] = {}
        self.want: dict[str, int] = {}

    def reset(self, **row: Any) -> str:
        """Fill the shelves and remember the order the row asks for."""
        self.stock, self.ordered = {"apple": 5, "pear": row["pears"]}, {}
        self.want = {row["item"]: row["quantity"]}
        return f"\nIn stock: {self.stock['apple']} apple, {self.stock['pear']} pear."

    def check_stock(self, item: str) -> int:
        """Units of an item in stock.

        Args:
            item: The item's name.
        """
        return self.stock[item]

    def order(self, item: str, quantity: int) -> str:
        """Order units of an item.

        Args:
            item: The item's name.
            quantity: How many units to order.
        """
        if quantity > self.stock[item]:
            raise ValueError(f"only {self.stock[item]} {item} in stock")
        self.stock[item] -= quantity
        self.ordered[item] = self.ordered.get(item, 0) + quantity
        return f"ordered {quantity} {item}"

    def get_reward(self) -> float:
        """1 for the asked order, -1 otherwise."""
        return 1.0 if self.ordered == self.want else -1.0

    def _log(self) -> None:
        """Private: not a tool."""

    @property
    def total(self) -> int:
        """A property: not a tool, and not evaluated while probing."""
        raise AssertionError("probing must not read properties")


class ChattyShop(Shop):
    """A shop that explains its reward."""

    def feedback(self) -> str:
        """What went wrong, for the reflective mutator."""
        return "Nothing was ordered." if not self.ordered else f"Ordered {self.ordered}; wanted {self.want}."


class NoReward:
    """Has reset and a tool but no get_reward."""

    def reset(self, **row: Any) -> None:
        """Nothing to reset."""

    def ping(self) -> str:
        """Answer pong."""
        return "pong"


class Drifting(Shop):
    """reset() text changes between instances: autoevolve's request could not show it."""

    resets = 0

    def reset(self, **row: Any) -> str:
        """Count resets over every instance."""
        super().reset(**row)
        Drifting.resets += 1
        return f" (reset {Drifting.resets})"


SYSTEM = {"role": "system", "content": "You run the shop."}
ROWS = [
    {
        "id": "o1",
        "prompt": [SYSTEM, {"role": "user", "content": "Order 2 apple."}],
        "item": "apple",
        "quantity": 2,
        "pears": 3,
    },
    {"id": "o2", "prompt": [{"role": "user", "content": "Order 1 pear."}], "item": "pear", "quantity": 1, "pears": 0},
    {"id": "o3", "prompt": [{"role": "user", "content": "Order 4 apple."}], "item": "apple", "quantity": 4, "pears": 1},
]
REFERENCE = [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "order", "arguments": '{"item": "apple", "quantity": 2}'}}
        ],
    },
    {"role": "tool", "content": "ordered 2 apple"},
    {"role": "assistant", "content": "Done."},
]


def task_file(tmp_path: Path, rows: list[dict[str, Any]] = ROWS) -> Path:
    """Rows as a JSONL task file."""
    path = tmp_path / "shop.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def shop_env(tmp_path: Path, factory: Any = Shop, **options: Any) -> TRLEnvironment:
    """Every row in train (the split sizes ask for all of them)."""
    return TRLEnvironment(factory, task_file(tmp_path), columns={"id": "id"}, n_train=3, n_dev=0, n_test=0, **options)


def test_tools_are_the_schemas_trl_builds(tmp_path: Path) -> None:
    """Public methods minus reset, get_reward and feedback, with transformers' schemas; a fresh copy per call."""
    env = shop_env(tmp_path, ChattyShop)
    shop = Shop()
    assert env.tools() == [get_json_schema(shop.check_stock), get_json_schema(shop.order)]
    assert env.tools()[1]["function"]["parameters"]["required"] == ["item", "quantity"]
    env.tools()[0]["function"]["name"] = "changed"
    assert env.tools()[0]["function"]["name"] == "check_stock"


def test_a_loader_spec_finds_the_class(tmp_path: Path) -> None:
    """'path/file.py:Class' loads the factory like a config's loader string."""
    env = TRLEnvironment(f"{Path(__file__)}:Shop", task_file(tmp_path), n_train=3, n_dev=0, n_test=0)
    assert [t["function"]["name"] for t in env.tools()] == ["check_stock", "order"]
    assert [t.id for t in env.tasks("train")] == ["trl-1", "trl-2", "trl-3"]  # row numbers without an id column
    assert path_arguments(TRLEnvironment) == {"data"}  # a run config's data path is resolved like its hcp file


def test_tasks_append_the_reset_observation(tmp_path: Path) -> None:
    """Request = last user message + reset(**row); the system message goes to metadata; the row is the goal."""
    env = shop_env(tmp_path, name="shop")
    first, second, _ = env.tasks("train")
    assert first.request == "Order 2 apple.\nIn stock: 5 apple, 3 pear."
    assert (first.id, first.env, first.split, first.tier) == ("shop-o1", "shop", "train", 1)
    assert first.metadata == {"system": "You run the shop."} and second.metadata == {}
    assert first.goal == {"row": ROWS[0]}


def test_episodes_run_tools_on_their_own_instance(tmp_path: Path) -> None:
    """A call changes only its episode's shop; results and errors read as under TRL."""
    env = shop_env(tmp_path)
    task = env.tasks("train")[0]
    one, two = env.start(task), env.start(task)
    assert one.call("order", {"item": "apple", "quantity": 2}) == "ordered 2 apple"
    assert one.call("check_stock", {"item": "apple"}) == "3" and two.call("check_stock", {"item": "apple"}) == "5"
    assert one.call("order", {"item": "apple", "quantity": 9}) == "{'error': 'only 3 apple in stock'}"
    assert one.call("check_stock", {"item": "plum"}) == str({"error": "'plum'"})
    assert one.finished is False
    with pytest.raises(KeyError, match="get_reward"):
        one.call("get_reward", {})
    with pytest.raises(KeyError, match="_log"):
        one.call("_log", {})


def test_reward_range_maps_to_unit_interval(tmp_path: Path) -> None:
    """get_reward in (-1, 1) maps to [0, 1]; the feedback states the raw reward."""
    env = shop_env(tmp_path, reward_range=(-1, 1))
    task = env.tasks("train")[0]
    right, wrong = env.start(task), env.start(task)
    right.call("order", {"item": "apple", "quantity": 2})
    assert right.score([]) == (1.0, "The environment's reward was 1 on a scale from -1 to 1.")
    assert wrong.score([]) == (0.0, "The environment's reward was -1 on a scale from -1 to 1.")
    plain = shop_env(tmp_path, reward_range=(0, 2))
    assert plain.start(task).score([]) == (0.0, "The environment's reward was -1 of 2.")  # clipped
    with pytest.raises(ValueError, match=r"reward_range \(1, 1\)"):
        shop_env(tmp_path, reward_range=(1, 1))


def test_feedback_method_is_used_when_present(tmp_path: Path) -> None:
    """An environment's feedback() gives the sentences; it is not offered as a tool."""
    env = shop_env(tmp_path, ChattyShop)
    episode = env.start(env.tasks("train")[1])
    assert episode.score([]) == (0.0, "Nothing was ordered.")
    with pytest.raises(KeyError):
        episode.call("feedback", {})


def test_a_non_number_reward_is_an_error(tmp_path: Path) -> None:
    """get_reward must give a number, not NaN."""
    env = shop_env(tmp_path, lambda: type("NaNShop", (Shop,), {"get_reward": lambda self: float("nan")})())
    with pytest.raises(ValueError, match=r"NaNShop.get_reward\(\) returned nan"):
        env.start(env.tasks("train")[0]).score([])


def test_the_protocol_is_checked_at_construction(tmp_path: Path) -> None:
    """No get_reward or no reset: a ValueError saying what to add."""
    with pytest.raises(ValueError, match=r"NoReward has no get_reward\(\) method; autoevolve scores with the env"):
        shop_env(tmp_path, NoReward)
    with pytest.raises(ValueError, match=r"Shopless has no reset\(\) method"):
        shop_env(tmp_path, type("Shopless", (), {"get_reward": lambda self: 1.0}))
    with pytest.raises(
        ValueError, match="columns: unknown key 'question'; map any of prompt, id, tier, reference, split"
    ):
        TRLEnvironment(Shop, task_file(tmp_path), columns={"question": "prompt"})


def test_multi_turn_prompts_name_file_and_row(tmp_path: Path) -> None:
    """More than a system and one user message: ValueError at file:row."""
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Order."},
    ]
    path = task_file(tmp_path, [ROWS[0], {**ROWS[1], "prompt": turns}])
    with pytest.raises(ValueError, match=rf"^{path}:2: column 'prompt' holds a multi-turn prompt"):
        TRLEnvironment(Shop, path, n_train=2, n_dev=0, n_test=0)


def test_a_reset_that_drifts_is_refused(tmp_path: Path) -> None:
    """The request shows the probe's observation: a fresh instance must return the same text."""
    env = shop_env(tmp_path, Drifting)
    with pytest.raises(ValueError, match="reset must give the same text for the same row"):
        env.start(env.tasks("train")[0])


def test_references_come_from_the_mapped_column(tmp_path: Path) -> None:
    """A train task with a reference: the request, then its messages; a row without one, and dev tasks: None."""
    rows = [{**ROWS[0], "solution": json.dumps(REFERENCE)}, {**ROWS[1], "solution": None}]
    path = task_file(tmp_path, rows)
    env = TRLEnvironment(Shop, path, columns={"id": "id", "reference": "solution"}, n_train=2, n_dev=0, n_test=0)
    first, second = env.tasks("train")
    assert env.reference(first) == [
        Message(role="user", content=first.request),
        Message(role="assistant", tool_calls=[ToolCall.make("call_1", "order", {"item": "apple", "quantity": 2})]),
        Message(role="tool", content="ordered 2 apple", tool_call_id="call_1"),
        Message(role="assistant", content="Done."),
    ]
    assert env.reference(second) is None
    assert env.reference(first.model_copy(update={"split": "dev"})) is None


def test_a_rollout_step_runs_a_json_call_and_scores(tmp_path: Path) -> None:
    """rollout.apply runs the model's JSON call on the episode's shop; the final reply ends it; reward 1."""
    env = shop_env(tmp_path, ChattyShop)
    hcp = HCPConfig(system_prompt="You run a shop. Tools: {tools}", tools=env.tools())
    task = env.tasks("train")[0]
    episode, messages = env.start(task), [Message(role="user", content=task.request)]
    call = json.dumps({"name": "order", "arguments": {"item": "apple", "quantity": 2}})
    assert apply(Completion(text=call), hcp, task, episode, messages) == (False, "")
    assert apply(Completion(text="Ordered."), hcp, task, episode, messages) == (True, "")
    assert [(m.role, m.content) for m in messages[2:]] == [("tool", "ordered 2 apple"), ("assistant", "Ordered.")]
    assert messages[1].tool_calls == [ToolCall.make("call_1", "order", {"item": "apple", "quantity": 2})]
    assert episode.score(messages) == (1.0, "Ordered {'apple': 2}; wanted {'apple': 2}.")
