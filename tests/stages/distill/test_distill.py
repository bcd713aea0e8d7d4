"""Distillation: re-rendering under the original config, the assistant mask, and LoRA SFT on a tiny Llama."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing can be downloaded here; fail fast instead of retrying a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from autoevolve.harness.hcp import Demo, Demos, HCPConfig  # noqa: E402
from autoevolve.model import EMBEDDED, resolve  # noqa: E402
from autoevolve.records import Message, Task, ToolCall, Trajectory  # noqa: E402
from autoevolve.stages.distill import TrainSettings, render_examples, train_sft  # noqa: E402
from autoevolve.stages.distill.dataset import build_dataset, tokenize_with_assistant_mask  # noqa: E402

TOOL = {
    "type": "function",
    "function": {
        "name": "book_table",
        "description": "Book a table.",
        "parameters": {
            "type": "object",
            "properties": {"restaurant_id": {"type": "string"}, "party_size": {"type": "integer"}},
            "required": ["restaurant_id", "party_size"],
        },
    },
}
CONVERSATION = [
    {"role": "system", "content": "You book tables."},
    {"role": "user", "content": "Book R-7 for two people please."},
    {"role": "assistant", "content": 'book_table(restaurant_id="R-7", party_size=2)'},
    {"role": "tool", "content": '{"ok": true, "booking": "B-1"}'},
    {"role": "assistant", "content": "Your table at R-7 is booked (B-1)."},
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # noqa: ANN201
    """Train on one CPU thread: on a shared box, OpenMP threads waiting on a busy core make steps ~3x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> str:  # noqa: ANN001
    """The shared tiny random model (conftest), as the path train_sft loads."""
    return str(tiny_model_dir)


def _examples(n: int) -> list[list[dict]]:
    """``n`` small tool-use conversations that differ in their numbers."""
    out = []
    for i in range(n):
        rid, size = f"R-{10 + i}", 2 + i % 4
        out.append(
            [
                {"role": "system", "content": "You book tables."},
                {"role": "user", "content": f"Book {rid} for {size} people."},
                {"role": "assistant", "content": f'book_table(restaurant_id="{rid}", party_size={size})'},
                {"role": "tool", "content": f'{{"ok": true, "booking": "B-{i}"}}'},
                {"role": "assistant", "content": f"Booked {rid} for {size} (B-{i})."},
            ]
        )
    return out


def _adapter(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a saved adapter."""
    return load_file(str(Path(path) / "adapter_model.safetensors"))


FAST = TrainSettings(epochs=1, batch_size=4, learning_rate=1e-2, lora_r=4, lora_alpha=8, max_length=256, seed=0)


def test_render_examples_uses_the_original_config() -> None:
    """System prompt, call syntax and (absent) demos come from the original config, not the evolved one."""
    original = HCPConfig(system_prompt="Short prompt.\n{tools}\n{call_format}", tools=[TOOL], call_syntax="python")
    task = Task(id="t1", env="life", split="train", tier=1, request="Book R-7 for 2.")
    call = ToolCall.make("c1", "book_table", {"restaurant_id": "R-7", "party_size": 2})
    history = [
        Message(role="user", content=task.request),
        Message(role="assistant", tool_calls=[call]),
        Message(role="tool", content='{"ok": true}', tool_call_id="c1"),
        Message(role="assistant", content="Booked."),
    ]
    evolved = original.model_copy(update={"demos": Demos(items=[Demo(task_id="t0", messages=history)])})
    traj = Trajectory(run_id="r", task_id="t1", split="train", hcp_id=evolved.id, messages=history, reward=1.0)
    [messages] = render_examples([traj], {"t1": task}, original)
    assert len(evolved.render(task, history)[0]) > len(messages)  # the evolved config would have shown a demo
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[0]["content"].startswith("Short prompt.")
    assert messages[2]["content"] == 'book_table(restaurant_id="R-7", party_size=2)'
    assert messages[-1]["content"] == "Booked."
    with pytest.raises(KeyError):
        render_examples([traj], {}, original)
    # A bad call the harness answered with its error (scaffold.retry_bad_calls) is not learned: the example is the
    # conversation without it, the same as a rollout that never made it.
    bad = Message(role="assistant", content='book_table(restaurant="R-7")', call_error="book_table: missing party_size")
    told = Message(role="user", content="That call could not be run: book_table: missing party_size.")
    recovered = traj.model_copy(update={"messages": [history[0], bad, told, *history[1:]]})
    assert render_examples([recovered], {"t1": task}, original) == [messages]


def test_mask_covers_exactly_the_assistant_turns(tokenizer) -> None:  # noqa: ANN001
    """Masked tokens decode to the two assistant contents with their end tokens; headers and others stay 0."""
    row = tokenize_with_assistant_mask(CONVERSATION, tokenizer)
    ids, mask = row["input_ids"], row["assistant_masks"]
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    assert ids == full[: len(ids)] and mask[-1] == 1  # it ends at the last assistant token: nothing after has loss
    assert 0 < len(full) - len(ids) <= 2 and tokenizer.decode(full[len(ids) :]).strip() == ""
    end = tokenizer.eos_token
    assert tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == (
        f"{CONVERSATION[2]['content']}{end}{CONVERSATION[4]['content']}{end}"
    )
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    for message in CONVERSATION[:2] + CONVERSATION[3:4]:
        assert message["content"] in unmasked  # every user, system and tool token is 0
    assert unmasked.count("<|im_start|>assistant\n") == 2  # headers are prompt, not target
    assert row == tokenize_with_assistant_mask(CONVERSATION, tokenizer, max_length=len(ids))
    assert len(tokenize_with_assistant_mask(CONVERSATION, tokenizer, max_length=10)["assistant_masks"]) == 10


def test_mask_rejects_a_template_that_is_not_prefix_consistent(tokenizer) -> None:  # noqa: ANN001
    """A template whose rendering of a turn depends on what follows cannot be masked by difference."""
    odd = tokenizer.__class__.from_pretrained(resolve(EMBEDDED))
    odd.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %} END{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(ValueError, match="prefix-consistent"):
        tokenize_with_assistant_mask(CONVERSATION, odd)


def test_trainer_labels_are_masked_outside_assistant_tokens(tiny: str, tokenizer, monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """The labels the trainer feeds the loss are -100 everywhere but on assistant tokens (padding included)."""
    from autoevolve.stages.distill import compact

    seen: list[dict] = []

    def spying_trainer() -> type:
        class Spy(compact.compact_sft_trainer()):
            def compute_loss(self, model, inputs, *args, **kwargs):  # noqa: ANN001, ANN202
                seen.append({k: v.detach().cpu().clone() for k, v in inputs.items() if torch.is_tensor(v)})
                return super().compute_loss(model, inputs, *args, **kwargs)

        return Spy

    monkeypatch.setattr("autoevolve.stages.distill.sft.compact_sft_trainer", spying_trainer)
    examples = _examples(6)
    train_sft(examples, tiny, tmp_path / "a", FAST)
    expected = {tuple(r["input_ids"]): r["assistant_masks"] for r in build_dataset(examples, tokenizer)}
    rows = 0
    for batch in seen:
        for ids, labels, attention in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True):
            n = int(attention.sum())
            mask = expected[tuple(ids[:n].tolist())]
            want = [t if m else -100 for t, m in zip(ids[:n].tolist(), mask, strict=True)]
            assert labels[:n].tolist() == want
            assert (labels[n:] == -100).all()
            rows += 1
    assert rows == len(examples)


def test_train_sft_learns_and_saves_a_vllm_ready_adapter(tiny: str, tmp_path: Path) -> None:
    """Loss falls, the base folder is untouched, LoRA B moved, and the config names the base."""
    before = load_file(str(Path(tiny) / "model.safetensors"))
    settings = FAST.model_copy(update={"epochs": 5, "batch_size": 1, "learning_rate": 5e-2})
    logs: list[dict] = []
    result = train_sft(_examples(4), tiny, tmp_path / "adapter", settings, progress=logs.append)
    assert result.steps == 20 and result.examples == 4
    assert result.last_loss < result.first_loss
    assert any("loss" in row for row in logs) and logs[-1]["step"] == result.steps
    after = LlamaForCausalLM.from_pretrained(tiny).state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(before[name], after[name])
    tensors = _adapter(result.path)
    b = [t for name, t in tensors.items() if "lora_B" in name]
    assert len(b) == 2 * 7 and all(t.abs().sum() > 0 for t in b)  # 7 target modules in each of 2 layers
    config = json.loads((Path(result.path) / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == tiny
    assert config["r"] == settings.lora_r and config["peft_type"] == "LORA"
    # The folder keeps the trainer's log: a row per step with loss, learning rate and grad norm, then a summary.
    rows = [json.loads(line) for line in (Path(result.path) / "training_log.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == list(range(1, 21)) and "train_runtime" in rows[-1]
    assert steps[0]["loss"] == pytest.approx(result.first_loss) and steps[-1]["loss"] == pytest.approx(result.last_loss)
    assert all(row["learning_rate"] > 0 and row["grad_norm"] > 0 for row in steps)
    assert not (Path(result.path) / "logs").exists()  # nothing streamed: no integration folder


def test_report_to_streams_the_training_log_to_tensorboard_beside_the_adapter(tiny: str, tmp_path: Path) -> None:
    from tensorboardX.proto import event_pb2

    settings = FAST.model_copy(update={"report_to": ["tensorboard"]})
    result = train_sft(_examples(4), tiny, tmp_path / "adapter", settings)
    files = sorted((Path(result.path) / "logs").rglob("events.out.tfevents.*"))
    assert len(files) == 1
    losses = []
    data = files[0].read_bytes()
    while data:  # TFRecord: length (8 bytes), its CRC (4), the event, its CRC (4)
        n = int.from_bytes(data[:8], "little")
        event = event_pb2.Event.FromString(data[12 : 12 + n])
        losses += [(event.step, v.simple_value) for v in event.summary.value if v.tag == "train/loss"]
        data = data[16 + n :]
    assert [step for step, _ in losses] == list(range(1, result.steps + 1))
    assert losses[0][1] == pytest.approx(result.first_loss, rel=1e-5)


def test_report_to_refuses_an_unknown_or_missing_integration() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="'tensorbored' is not a transformers integration"):
        TrainSettings(report_to=["tensorbored"])
    with pytest.raises(ValidationError, match=r"'swanlab' needs its package installed \(pip install swanlab\)"):
        TrainSettings(report_to=["swanlab"])


def test_continued_training_starts_from_the_init_adapter(tiny: str, tmp_path: Path) -> None:
    """With init_adapter the run starts from its weights: lower first loss, and a near-zero LR keeps them."""
    examples = _examples(4)
    trained = FAST.model_copy(update={"epochs": 4, "batch_size": 1, "learning_rate": 5e-2})
    first = train_sft(examples, tiny, tmp_path / "v1", trained)
    still = FAST.model_copy(update={"learning_rate": 1e-9})
    fresh = train_sft(examples, tiny, tmp_path / "fresh", still)
    again = train_sft(examples, tiny, tmp_path / "v2", still, init_adapter=first.path)
    assert again.first_loss < fresh.first_loss - 0.05
    v1, v2 = _adapter(first.path), _adapter(again.path)
    assert v1.keys() == v2.keys()
    for name in v1:
        torch.testing.assert_close(v1[name], v2[name], atol=1e-5, rtol=0)


def test_same_inputs_and_seed_give_identical_adapters(tiny: str, tmp_path: Path) -> None:
    """Two CPU runs with the same seed write bit-identical weights; another seed does not."""
    examples = _examples(6)
    a = _adapter(train_sft(examples, tiny, tmp_path / "a", FAST).path)
    b = _adapter(train_sft(examples, tiny, tmp_path / "b", FAST).path)
    c = _adapter(train_sft(examples, tiny, tmp_path / "c", FAST.model_copy(update={"seed": 1})).path)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
