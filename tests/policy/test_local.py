"""LocalPolicy on a tiny random model: batching and prefix sharing change no output; adapters switch by name."""

from __future__ import annotations

import torch

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.policy import ChatRequest
from autoevolve.policy.local import LocalPolicy


def _requests(n: int = 6, tokens: int = 12) -> list[ChatRequest]:
    hcp = HCPConfig.from_yaml("prompts/life.yaml")
    return [ChatRequest(messages=hcp.render(t)[0], max_new_tokens=tokens) for t in LifeEnv().tasks("dev")[:n]]


def test_batched_equals_one_at_a_time(tiny_policy: LocalPolicy) -> None:
    requests = _requests()
    batched = tiny_policy.generate(requests)
    tiny_policy.batch_size = 1
    try:
        single = tiny_policy.generate(requests)
    finally:
        tiny_policy.batch_size = 8
    assert [c.text for c in batched] == [c.text for c in single]
    assert all(c.completion_tokens == 12 and c.prompt_tokens > 100 for c in batched)
    assert [c.prompt_tokens for c in batched] == [tiny_policy.prompt_tokens(r) for r in requests]


def test_without_the_decoder_prefix_sharing_changes_no_output(tiny_policy: LocalPolicy) -> None:
    # Two configs in one batch share only the chat template's first tokens: each row keeps its whole prompt.
    requests = _requests(3)
    other = HCPConfig.from_yaml("prompts/life.yaml").model_copy(update={"system_prompt": "Be brief. {tools}"})
    requests += [ChatRequest(messages=other.render(t)[0], max_new_tokens=12) for t in LifeEnv().tasks("dev")[:3]]
    decoder, tiny_policy.decoder = tiny_policy.decoder, None
    try:
        mixed = [c.text for c in tiny_policy.generate(requests)]
        tiny_policy.batch_size = 1
        single = [c.text for c in tiny_policy.generate(requests)]
        tiny_policy.batch_size, tiny_policy.share_prefix = 8, False
        padded = [c.text for c in tiny_policy.generate(requests[:3])]
    finally:
        tiny_policy.decoder, tiny_policy.batch_size, tiny_policy.share_prefix = decoder, 8, True
    assert mixed == single and padded == single[:3]
    assert len(set(single)) > 1  # the rows differ: a dropped prompt would make them alike or change them


def test_named_adapters_switch_and_none_is_the_base(tiny_model_dir, tmp_path) -> None:
    from peft import LoraConfig, get_peft_model

    from autoevolve.model import load

    lm, _ = load(str(tiny_model_dir))
    peft = get_peft_model(lm, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "a")
    policy = LocalPolicy(str(tiny_model_dir), batch_size=4)
    requests = _requests(3, tokens=8)
    base = [c.text for c in policy.generate(requests)]
    policy.add_adapter("L1-life@v1", str(tmp_path / "a"))
    with_adapter = [c.text for c in policy.generate(requests, "L1-life@v1")]
    assert with_adapter != base
    assert [c.text for c in policy.generate(requests, None)] == base
    missing = policy.generate(requests[:1], "L9@v1")
    assert missing[0].error == "adapter 'L9@v1' is not loaded"
    assert isinstance(policy.base.model.layers[0].self_attn.q_proj.base_layer.weight, torch.Tensor)
    policy.add_adapter("L1-life@v1-epoch1", str(tmp_path / "a"))
    policy.remove_adapter("L1-life@v1")
    assert policy.generate(requests[:1], "L1-life@v1")[0].error == "adapter 'L1-life@v1' is not loaded"
    assert [c.text for c in policy.generate(requests, "L1-life@v1-epoch1")] == with_adapter
    policy.remove_adapter("L1-life@v1-epoch1")  # the last one: the bare base serves again, with no LoRA layer
    policy.remove_adapter("L1-life@v1-epoch1")  # not loaded: nothing to do
    assert policy.lm is policy.base and [c.text for c in policy.generate(requests)] == base
    assert isinstance(policy.base.model.layers[0].self_attn.q_proj, torch.nn.Linear) and not policy.adapters
    policy.add_adapter("again", str(tmp_path / "a"))
    assert [c.text for c in policy.generate(requests, "again")] == with_adapter


def test_a_request_joins_a_running_batch_and_fails_with_it_if_it_breaks(tiny_policy: LocalPolicy, monkeypatch) -> None:
    from autoevolve.policy import batch

    ask = ChatRequest(messages=[{"role": "user", "content": "Hello"}], max_new_tokens=8)
    other = ChatRequest(messages=[{"role": "user", "content": "Book a table"}], max_new_tokens=4)
    sampled = other.model_copy(update={"temperature": 0.7})
    answers: list = []
    offers: list[int] = []

    def arrivals(fits, room: int) -> list:  # noqa: ANN001
        offers.append(room)  # two requests arrive once, after the first step: the greedy one fits, not the sampled
        return [(r, None, answers.append, None) for r in (other, sampled) if fits(r, None)] if len(offers) == 1 else []

    [alone] = tiny_policy.generate([other])
    [first] = tiny_policy.generate([ask], arrivals=arrivals)
    assert first.completion_tokens == 8 and offers[0] == tiny_policy.batch_size - 1
    assert [a.text for a in answers] == [alone.text] and answers[0].completion_tokens == 4

    real, steps = batch.Batch.step, []

    def breaking(self) -> bool:  # noqa: ANN001
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("out of memory")
        return real(self)

    monkeypatch.setattr(batch.Batch, "step", breaking)
    answers.clear()
    offers.clear()
    [failed] = tiny_policy.generate([ask], arrivals=arrivals)
    assert failed.error == "generation failed: RuntimeError: out of memory"
    assert [a.error for a in answers] == [failed.error]  # the row that joined is answered, not left waiting
