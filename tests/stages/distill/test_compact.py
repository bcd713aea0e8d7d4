"""The compact SFT loss: a batch's shared prefix once, logits only where labels are; TRL's loss and gradients."""

from __future__ import annotations

import pytest
import torch

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.model import load
from autoevolve.records import Trajectory
from autoevolve.stages.distill.compact import MIN_SHARED, common_prefix, compact_sft_trainer
from autoevolve.stages.distill.dataset import build_dataset, render_examples
from autoevolve.stages.distill.fit import with_adapter
from autoevolve.stages.distill.sft import _config
from autoevolve.stages.distill.training import TrainSettings


def _loss_and_grads(trainer_class: type, model_dir: str, tmp: str, **kwargs: object) -> tuple[float, dict, int]:
    """One batch of four life conversations through a trainer class: its loss, LoRA gradients and shared prefix."""
    env, original = LifeEnv(tiers=(1,)), HCPConfig.from_yaml("prompts/life.yaml")
    tasks = env.tasks("train")[:4]
    trajs = [Trajectory(run_id="r", task_id=t.id, split="train", hcp_id="h", messages=env.reference(t), reward=1)
             for t in tasks]  # fmt: skip
    examples = render_examples(trajs, {t.id: t for t in tasks}, original)
    settings = TrainSettings(precision="float32", batch_size=4)
    torch.manual_seed(0)
    model, tokenizer = load(model_dir, "float32")
    tokenizer.padding_side = "right"
    model = with_adapter(model, settings, None)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; give the adapter an effect so its A gets gradients too
            torch.nn.init.normal_(p, std=0.02)
    dataset = build_dataset(examples, tokenizer, max_length=1024)
    trainer = trainer_class(model=model, args=_config(settings, tmp, False), train_dataset=dataset,
                            processing_class=tokenizer, **kwargs)  # fmt: skip
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    model.train()
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads, common_prefix(batch["input_ids"], batch["labels"])


@pytest.mark.parametrize("share_prefix", [True, False])
def test_loss_and_gradients_equal_trls(tiny_model_dir, tmp_path, share_prefix: bool) -> None:  # noqa: ANN001
    from trl import SFTTrainer

    theirs, their_grads, shared = _loss_and_grads(SFTTrainer, str(tiny_model_dir), str(tmp_path))
    mine, my_grads, _ = _loss_and_grads(
        compact_sft_trainer(), str(tiny_model_dir), str(tmp_path), share_prefix=share_prefix
    )
    assert shared > MIN_SHARED  # the system prompt: the shared path really ran
    assert mine == pytest.approx(theirs, abs=1e-5) and mine > 1.0
    assert my_grads.keys() == their_grads.keys() and len(my_grads) == 28  # A and B of 7 projections x 2 layers
    assert all(torch.allclose(my_grads[k], their_grads[k], atol=1e-6) for k in my_grads)
    assert any(g.abs().sum() > 0 for g in my_grads.values())


def test_the_shared_prefix_ends_before_the_first_labelled_token() -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 5, 7]])
    labels = torch.full_like(ids, -100)
    assert common_prefix(ids, labels) == 4
    labels[1, 3] = 4  # row 1's fourth token is an assistant token: the prefix must stop before position 3
    assert common_prefix(ids, labels) == 2
    assert common_prefix(ids[:, :4], torch.full((3, 4), -100)) == 3  # every row keeps a token after the prefix
