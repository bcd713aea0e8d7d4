"""The rollout engine: tool loop, failures as data, store caching (tiny random model)."""

from __future__ import annotations

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.harness.rollout import apply, rollout
from autoevolve.harness.toolcall import PARALLEL_CALLS
from autoevolve.harness.workbench import Workbench
from autoevolve.policy import ChatRequest, Completion
from autoevolve.records import Message
from autoevolve.store import Store


class Scripted:
    """A policy that replays fixed replies: the loop's logic tested without a model's whims."""

    def __init__(self, replies: list[str], error: str = "") -> None:
        self.replies, self.error, self.calls = replies, error, 0

    def generate(self, requests: list[ChatRequest], adapter: str | None = None) -> list[Completion]:
        reply = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        return [Completion(text=reply, error=self.error, prompt_tokens=10, completion_tokens=5) for _ in requests]

    def add_adapter(self, name: str, path: str) -> None:
        pass


def _setup():
    env = LifeEnv(tiers=(1,))
    task = next(t for t in env.tasks("train") if t.goal["kind"] == "table")
    return env, task, HCPConfig.from_yaml("prompts/life.yaml")


def test_a_correct_call_then_a_reply_scores_one() -> None:
    env, task, hcp = _setup()
    g = task.goal
    call = (
        f'{{"name": "book_table", "arguments": {{"restaurant_id": "{g["restaurant_id"]}", '
        f'"party_size": {g["party_size"]}, "time": "{g["time"]}"}}}}'
    )
    [traj] = rollout(Scripted([call, "Booked!"]), env, hcp, [task], run_id="r")
    assert traj.reward == 1.0 and traj.error == "" and traj.feedback == ""
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[1].tool_calls[0].arguments["party_size"] == g["party_size"]
    assert traj.prompt_tokens == 10 and traj.completion_tokens == 10


def test_failures_are_recorded_with_reward_zero() -> None:
    env, task, hcp = _setup()
    cases = {
        '{"name": "teleport", "arguments": {}}': "unknown tool 'teleport'",
        '{"name": "book_table", "arguments": {"party_size": 2}}': "missing required argument",
        '{"name": "book_table", "arguments": {': "unparseable tool call",
    }
    for reply, why in cases.items():
        [traj] = rollout(Scripted([reply]), env, hcp, [task], run_id="r")
        assert traj.reward == 0.0 and why in traj.error and why in traj.feedback
    [traj] = rollout(Scripted(["x"], error="connection reset"), env, hcp, [task], run_id="r")
    assert traj.reward == 0.0 and traj.error == "backend error: connection reset"
    search = '{"name": "search_restaurants", "arguments": {"city": "Lisbon"}}'
    [traj] = rollout(Scripted([search]), env, hcp, [task], run_id="r")
    assert traj.reward == 0.0 and traj.error.startswith("step limit") and len(traj.messages) == 1 + 2 * 4


def test_garbage_model_yields_stored_zero_reward_trajectories(tiny_policy, tmp_path) -> None:
    env, _, hcp = _setup()
    hcp = hcp.model_copy(update={"sampling": hcp.sampling.model_copy(update={"max_new_tokens": 16})})
    tasks = env.tasks("train")[:6]
    with Store(tmp_path / "s.duckdb") as store:
        bench = Workbench(tiny_policy, env, store, run_id="garbage", progress=None)
        trajs = bench.rollouts(hcp, tasks)
        assert len(trajs) == 6 and all(t.reward == 0.0 for t in trajs)
        assert all(t.feedback for t in trajs)  # each says why: an error or the unmet conditions
        assert store.count_trajectories("garbage") == 6
        again = bench.rollouts(hcp, tasks)  # read back, not regenerated
        assert [t.messages for t in again] == [t.messages for t in trajs]
        assert store.count_trajectories("garbage") == 6


def test_a_bad_call_is_answered_with_its_error_when_the_scaffold_retries(tmp_path) -> None:
    env, task, hcp = _setup()
    g = task.goal
    bad = f'{{"name": "book_table", "arguments": {{"restaurant_id": "{g["restaurant_id"]}", "seats": 2}}}}'
    good = (
        f'{{"name": "book_table", "arguments": {{"restaurant_id": "{g["restaurant_id"]}", '
        f'"party_size": {g["party_size"]}, "time": "{g["time"]}"}}}}'
    )
    [ended] = rollout(Scripted([bad, good, "Booked!"]), env, hcp, [task], run_id="r")
    assert ended.reward == 0.0 and "missing required argument" in ended.error

    retrying = hcp.retrying(1)
    assert retrying.scaffold.retry_bad_calls == 1 and retrying.scaffold.max_steps == hcp.scaffold.max_steps + 1
    [traj] = rollout(Scripted([bad, good, "Booked!"]), env, retrying, [task], run_id="r")
    assert traj.reward == 1.0 and traj.error == ""
    assert [m.role for m in traj.messages] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
    failed, answer = traj.messages[1], traj.messages[2]
    assert failed.content == bad and failed.tool_calls == [] and "missing required argument" in failed.call_error
    assert answer.content.startswith("That call could not be run: book_table: missing required argument(s)")
    # On the wire the bad call is plain assistant text and its answer a user message: no tool message answers a
    # call id that was never run.
    wire, _ = retrying.render(task, traj.messages)
    assert [m["role"] for m in wire] == ["system", "user", "assistant", "user", "assistant", "tool", "assistant"]
    assert "tool_calls" not in wire[2] and wire[5]["tool_call_id"] == wire[4]["tool_calls"][0]["id"]
    # The record keeps the mark through the store; a message without it is stored as before.
    with Store(tmp_path / "s.duckdb") as store:
        store.put_trajectories([traj])
        [back] = store.trajectories("r")
    assert back.messages == traj.messages and "call_error" not in traj.messages[3].model_dump()

    # One retry only: the second bad call ends the episode.
    [twice] = rollout(Scripted([bad, bad, good]), env, retrying, [task], run_id="r")
    assert twice.reward == 0.0 and "missing required argument" in twice.error and len(twice.messages) == 4


def test_retrying_leaves_the_config_id_alone_when_off() -> None:
    hcp = HCPConfig.from_yaml("prompts/life.yaml")
    assert hcp.retrying(2).id != hcp.id and hcp.retrying(0).id == hcp.id
    assert hcp.id == "fe54907e90c2"  # as before the knob existed: stored rows and runs still name it


def test_a_reply_with_several_text_calls_runs_them_only_where_the_task_allows_it() -> None:
    """A life task reads a multi-call text reply for its first call, as before; the same task marked as allowing
    parallel calls runs every call of the reply, in order, with one tool result each."""
    env, task, hcp = _setup()
    g = task.goal
    args = f'"restaurant_id": "{g["restaurant_id"]}", "party_size": {g["party_size"]}, "time": "{g["time"]}"'
    other = '{"name": "search_restaurants", "arguments": {"city": "Lisbon"}}'
    reply = f'{{"name": "book_table", "arguments": {{{args}}}}}\n{other}'
    [traj] = rollout(Scripted([reply, "Booked!"]), env, hcp, [task], run_id="r")
    assert traj.reward == 1.0 and traj.error == ""
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert [c.name for c in traj.messages[1].tool_calls] == ["book_table"]

    parallel = task.model_copy(update={"metadata": {**task.metadata, PARALLEL_CALLS: True}})
    messages = [Message(role="user", content=task.request)]
    done, error = apply(Completion(text=reply), hcp, parallel, env.start(parallel), messages)
    assert not done and error == ""
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    calls = messages[1].tool_calls
    assert [(c.id, c.name) for c in calls] == [("call_1", "book_table"), ("call_1_2", "search_restaurants")]
    assert [m.tool_call_id for m in messages[2:]] == ["call_1", "call_1_2"]
