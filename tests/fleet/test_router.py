"""The router: a change_model tool from the registry, routed conversations over live adapters, the router env."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoevolve.envs.life import LifeEnv
from autoevolve.envs.routing import EXPERTS, RouterEnv
from autoevolve.fleet.registry import add_expert, promote, register
from autoevolve.fleet.router import Served, converse, router_env, served_experts
from autoevolve.harness.change_model import change_model_tool
from autoevolve.harness.hcp import Demo, Demos, HCPConfig
from autoevolve.harness.rollout import score_reply
from autoevolve.store import Store

ROUTER = HCPConfig.from_yaml("prompts/router.yaml")
LIFE = HCPConfig.from_yaml("prompts/life.yaml")


def test_change_model_tool_is_generated_from_the_registry(tmp_path: Path) -> None:
    with Store(tmp_path / "s.duckdb") as store:
        for e in EXPERTS:
            add_expert(store, e.name, e.base_model, e.tier, e.routing_rule)
        tool = change_model_tool(store.experts(), entry="L0-chat")["function"]
    assert tool["name"] == "change_model" and tool["parameters"]["required"] == ["model"]
    assert tool["parameters"]["properties"]["model"]["enum"] == ["L1-life", "L2-code"]  # never the entry itself
    assert "\n- L1-life: Bookings: restaurant tables" in tool["description"]
    assert "\n- L2-code: Writing, explaining or fixing program code." in tool["description"]
    with pytest.raises(ValueError, match="no expert besides L0-chat to route to"):
        change_model_tool(EXPERTS[:1], entry="L0-chat")


def test_router_env_rewards_the_right_expert_only() -> None:
    env = RouterEnv()
    splits = {s: env.tasks(s) for s in ("train", "dev", "test")}
    assert [len(t) for t in splits.values()] == [96, 48, 48]
    requests = [t.request for tasks in splits.values() for t in tasks]
    assert len(set(requests)) == len(requests)  # disjoint splits, no repeats
    life, chat, code = splits["dev"][:3]
    assert [t.goal["expert"] for t in (life, chat, code)] == ["L1-life", "L0-chat", "L2-code"]
    call = '{{"name": "change_model", "arguments": {{"model": "{}"}}}}'
    assert score_reply(env, ROUTER, life, call.format("L1-life")) == 1.0
    assert score_reply(env, ROUTER, code, call.format("L2-code")) == 1.0
    assert score_reply(env, ROUTER, code, call.format("L1-life")) == 0.0
    assert score_reply(env, ROUTER, chat, "I'm great, thanks!") == 1.0  # the entry expert answers small talk
    assert score_reply(env, ROUTER, chat, call.format("L2-code")) == 0.0
    assert score_reply(env, ROUTER, life, "Sure, booked!") == 0.0  # not routed
    episode = env.start(code)
    episode.call("change_model", {"model": "L1-life"})
    assert episode.score([]) == (0.0, "Expected change_model(L2-code); got change_model(L1-life).")
    for task in splits["train"][:6]:  # the labelled solutions the demo mutator bootstraps from score 1
        gold = env.reference(task)
        replay = env.start(task)
        for m in gold:
            for c in m.tool_calls:
                replay.call(c.name, c.arguments)
        assert replay.score(gold) == (1.0, "")
    with pytest.raises(ValueError, match="at most 240 tasks"):
        RouterEnv(n_train=300)


def _fresh_adapter(out: Path, seed: int) -> str:
    """A new, untrained LoRA on SmolLM2 (B = 0: it answers as the base does), saved as a registry accepts it."""
    import torch
    from peft import LoraConfig, get_peft_model

    from autoevolve.model import EMBEDDED, base_model_id, load
    from autoevolve.stages.distill.fit import save_adapter

    torch.manual_seed(seed)
    model, _ = load(EMBEDDED)
    lora = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    return str(save_adapter(lora, out, base_model_id(EMBEDDED)))


@pytest.mark.integration
def test_a_conversation_routes_l0_to_l1_and_back(tmp_path: Path, smol_policy) -> None:  # noqa: ANN001
    """Two live adapters on one LocalPolicy: SmolLM2 routes a booking to L1-life, the next message starts at L0."""
    from autoevolve.model import EMBEDDED, base_model_id

    base = base_model_id(EMBEDDED)
    env = RouterEnv()
    shown = [t for t in env.tasks("train") if t.goal["expert"] != "L2-code"][:4]  # route to L1-life, or answer
    demos = Demos(items=[Demo(task_id=t.id, messages=env.reference(t)) for t in shown], style="first_call")
    router = ROUTER.model_copy(update={"demos": demos})
    life = LifeEnv(tiers=(1,))
    task = life.tasks("train")[0]
    with Store(tmp_path / "s.duckdb") as store:
        for seed, e in enumerate(EXPERTS[:2]):
            add_expert(store, e.name, base, e.tier, e.routing_rule)
            path = _fresh_adapter(tmp_path / e.name, seed)
            record = register(
                store,
                name=e.name,
                path=path,
                base_model=base,
                parent_version=None,
                run_id="r",
                round=0,
                hcp_id="h",
                evolved_hcp_id="h",
                selection_id="s",
            )
            promote(store, e.name, record.version)
            smol_policy.add_adapter(record.ref, record.path)
        served = served_experts(store, {"L0-chat": router, "L1-life": LIFE})
        assert served == {"L0-chat": Served("L0-chat@v1", router), "L1-life": Served("L1-life@v1", LIFE)}
        followup = "Thanks! How are you today?"
        traj = converse(smol_policy, served, store.experts(), "L0-chat", task, life.start(task), [followup], "r", 4)
        store.put_trajectories([traj])
        [back] = store.trajectories("r")
    assert back == traj and back.adapter == "L0-chat@v1" and back.hcp_id == router.id
    [call] = back.messages[1].tool_calls
    assert (call.name, call.arguments) == ("change_model", {"model": "L1-life"})  # explicit routing ...
    assert json.loads(back.messages[2].content) == {"model": "L1-life", "status": "switched"}
    assert (back.messages[3].role, back.messages[3].adapter) == ("assistant", "L1-life@v1")  # ... serves the turn
    second = next(i for i, m in enumerate(back.messages) if m.role == "user" and m.content == followup)
    turn1 = back.messages[3:second]
    assert all(m.adapter == "L1-life@v1" for m in turn1 if m.role == "assistant")
    assert (back.messages[second + 1].role, back.messages[second + 1].adapter) == ("assistant", "L0-chat@v1")


def test_the_router_env_can_read_its_experts_from_a_registry(tmp_path: Path) -> None:
    with Store(tmp_path / "s.duckdb") as store:
        for e in EXPERTS[:2]:
            add_expert(store, e.name, e.base_model, e.tier, e.routing_rule)
    with pytest.raises(
        ValueError, match=r"s.duckdb: no expert 'L2-code', which the router environment's requests need"
    ):
        router_env(registry=str(tmp_path / "s.duckdb"))
    with Store(tmp_path / "s.duckdb") as store:
        add_expert(store, "L2-code", EXPERTS[2].base_model, 1, "Programs of any kind.")
        add_expert(store, "L3-math", EXPERTS[2].base_model, 1, "Arithmetic.")
    tool = router_env(registry=str(tmp_path / "s.duckdb")).tools()[0]["function"]
    assert tool["parameters"]["properties"]["model"]["enum"] == ["L1-life", "L2-code", "L3-math"]
    assert "- L2-code: Programs of any kind." in tool["description"]
