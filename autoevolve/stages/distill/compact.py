"""SFT that computes only what its loss needs: a batch's shared prompt prefix once, logits only at labelled tokens.

Distillation examples all start with the original config's system prompt, and only the assistant's tokens carry
loss. TRL's SFTTrainer runs every row's whole sequence and scores every position; this trainer runs the rows'
common prefix once (batch of one, its keys and values repeated for the rows), the rest of each row against it,
and projects to the vocabulary only the positions whose next token is labelled. The prefix's forward pass is shared,
so its gradient is the sum of the rows': loss and gradients equal TRL's up to float rounding (tests compare them).
With LoRA dropout the rows share the prefix's dropout mask.
"""

from __future__ import annotations

from typing import Any

MIN_SHARED = 16  # a shorter common prefix is not worth a separate forward pass


def compact_sft_trainer() -> type:
    """TRL's SFTTrainer with the compact loss (the class is built on first use: torch and TRL are slow to import)."""
    import torch
    from trl import SFTTrainer

    class CompactSFTTrainer(SFTTrainer):
        """SFTTrainer whose loss computes a batch's shared prefix once and logits only at labelled positions."""

        def __init__(self, *args: Any, share_prefix: bool = True, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.share_prefix = share_prefix
            self.tokens_seen = 0  # tokens of the examples trained on, padding excluded

        def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None):
            """Mean negative log-likelihood of the labelled tokens (over ``num_items_in_batch`` when given)."""
            ids, labels, mask = inputs["input_ids"], inputs["labels"], inputs["attention_mask"]
            shared = common_prefix(ids, labels) if self.share_prefix else 0
            lm = model.get_base_model() if hasattr(model, "get_base_model") else model
            extra = {}
            if shared >= MIN_SHARED:
                prefix = lm.model(input_ids=ids[:1, :shared], use_cache=True).cache
                prefix.batch_repeat_interleave(ids.shape[0])  # differentiable: the rows' gradients add up
                extra["cache"] = prefix  # the attention mask keeps its full length: cached tokens, then new ones
            else:
                shared = 0
            hidden = lm.model(input_ids=ids[:, shared:], attention_mask=mask, **extra).last_hidden_state
            targets = labels[:, shared + 1 :]  # position t predicts token t + 1
            scored = targets != -100
            logits = lm.lm_head(hidden[:, :-1][scored]).float()
            logp = torch.log_softmax(logits, dim=-1)
            chosen = targets[scored]
            nll = -logp.gather(1, chosen.unsqueeze(1)).squeeze(1)
            count = scored.sum() if num_items_in_batch is None else num_items_in_batch
            loss = nll.sum() / torch.as_tensor(count).clamp(min=1)
            self._record(mask, logp, logits, chosen)
            return (loss, {"logits": logits}) if return_outputs else loss

        @torch.no_grad()
        def _record(self, mask: Any, logp: Any, logits: Any, chosen: Any) -> None:
            """TRL's per-step metrics (entropy, token accuracy, tokens seen) from the labelled positions."""
            mode = "train" if self.model.training else "eval"
            if len(chosen):
                self._metrics[mode]["entropy"].append(float(-(logp.exp() * logp).sum(-1).mean()))
                self._metrics[mode]["mean_token_accuracy"].append(float((logits.argmax(-1) == chosen).float().mean()))
            if mode == "train":
                self.tokens_seen += int(mask.sum())
                self._metrics[mode]["num_tokens"] = [self.tokens_seen]

    return CompactSFTTrainer


def common_prefix(ids: Any, labels: Any) -> int:
    """Leading columns every row of a batch shares, ending before the first token that carries loss."""
    same = (ids == ids[:1]).all(dim=0)
    shared = int(same.long().cumprod(dim=0).sum())
    labelled = (labels != -100).any(dim=0).nonzero()
    first = int(labelled[0]) if len(labelled) else ids.shape[1]
    # Token ``shared`` is predicted from the prefix's last position, which the rest never sees: it must carry no loss.
    return min(shared, first - 1, ids.shape[1] - 1)
