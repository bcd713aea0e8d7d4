"""A lone row's compiled decode step (autoevolve.policy.stream) on the tiny random model: the tokens the eager
decoder gives, keys and values the batch and the store can go on from, adapters only once warmed."""

from __future__ import annotations

import pytest

from autoevolve.policy.batch import Joiner
from autoevolve.policy.decode import Decoder
from autoevolve.policy.local import LocalPolicy
from tests.policy.test_decode import _requests


def _adapter(model_dir, folder, rank: int):  # noqa: ANN001, ANN202
    """A random LoRA of the tiny model on two projections, saved in ``folder``."""
    from peft import LoraConfig, get_peft_model

    from autoevolve.model import load

    lm, _ = load(str(model_dir), "float32")
    lora = LoraConfig(r=rank, target_modules=["q_proj", "up_proj"], init_lora_weights=False)
    get_peft_model(lm, lora).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def policy(tiny_model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    """The tiny model with a LoRA adapter ("mix")."""
    policy = LocalPolicy(str(tiny_model_dir), 8, "float32")
    policy.add_adapter("mix", _adapter(tiny_model_dir, tmp_path_factory.mktemp("mix"), 4))
    return policy


def _decoders(policy: LocalPolicy) -> tuple[Decoder, Decoder]:
    eager = Decoder(policy.base, set())
    compiled = Decoder(policy.base, set(), compiled_steps=True)
    assert compiled.streams is not None and compiled.streams.warm(None) > 0
    return eager, compiled


def _rows(policy: LocalPolicy, n: int) -> list[list[int]]:
    return [policy.tokenizer(policy._template(r), add_special_tokens=False)["input_ids"] for r in _requests(n, 8)]  # noqa: SLF001


def test_a_lone_row_decodes_through_the_compiled_step_the_eager_tokens(policy, monkeypatch) -> None:  # noqa: ANN001
    import autoevolve.policy.batch as batch

    eager, compiled = _decoders(policy)
    rows = _rows(policy, 3)
    for row in rows:
        assert compiled.generate([row], adapter=None, max_new=40) == eager.generate([row], adapter=None, max_new=40)
    assert compiled.stats.compiled_steps == compiled.stats.decode_steps == 3 * 39
    [row] = rows[:1]
    plain = eager.generate([row], adapter=None, max_new=40)[0]

    def guess(self, outs: list[list[int]], max_new: list[int]) -> list[list[int]]:  # noqa: ANN001
        return [plain[len(outs[0]) : len(outs[0]) + 2] if len(outs[0]) % 5 == 0 else []]  # now and then, right

    monkeypatch.setattr(batch.Guesses, "guess", guess)
    before = (compiled.stats.compiled_steps, compiled.stats.decode_steps, compiled.stats.guessed_tokens)
    assert compiled.generate([row], adapter=None, max_new=40) == [plain]
    streamed, steps, guessed = (now - was for now, was in zip(
        (compiled.stats.compiled_steps, compiled.stats.decode_steps, compiled.stats.guessed_tokens), before, strict=True
    ))  # fmt: skip
    assert guessed >= 10 and steps == 39 - guessed and streamed >= steps - 8  # the stream took the guesses' keys


def test_rows_joining_a_streamed_row_and_a_later_call_from_the_store(policy) -> None:  # noqa: ANN001
    """A lone row streams, two rows join after 3 steps and end; the first streams again; every row gets its tokens
    alone, and the keys and values the stream wrote let a later call with the same key go on alike (its 29 fed
    tokens taken from the store)."""
    eager, compiled = _decoders(policy)
    rows = _rows(policy, 3)
    alone = [eager.generate([r], adapter=None, max_new=n)[0] for r, n in zip(rows, (30, 5, 6), strict=True)]
    finished: dict[int, list[int]] = {}
    plan, steps = {3: [1, 2]}, iter(range(1, 100))

    def arrivals(live: int) -> list[Joiner]:
        return [
            Joiner(rows[i], (30, 5, 6)[i], done=lambda out, i=i: finished.setdefault(i, out))
            for i in plan.pop(next(steps), [])
        ]

    [first] = compiled.generate([rows[0]], adapter=None, max_new=30, arrivals=arrivals, cache_key="k")
    assert [first, finished[1], finished[2]] == alone and compiled.stats.compiled_steps >= 3 + 20
    later = [rows[0] + first + rows[1][-5:], rows[2]]  # the stored row and a new user turn after it; another
    reference = eager.generate(later, adapter=None, max_new=12)
    reused, streamed = compiled.stats.reused_tokens, compiled.stats.compiled_steps
    assert compiled.generate(later, adapter=None, max_new=12, cache_key="k") == reference
    assert compiled.stats.reused_tokens - reused >= 29 and compiled.stats.compiled_steps > streamed


def test_an_adapter_decodes_eagerly_until_warmed_then_compiled(policy) -> None:  # noqa: ANN001
    eager, compiled = _decoders(policy)
    [row] = _rows(policy, 1)
    reference = eager.generate([row], adapter="mix", max_new=20)
    assert reference != eager.generate([row], adapter=None, max_new=20)  # the adapter changes the tokens
    assert compiled.generate([row], adapter="mix", max_new=20) == reference and compiled.stats.compiled_steps == 0
    compiled.streams.warm("mix")
    assert compiled.generate([row], adapter="mix", max_new=20) == reference and compiled.stats.compiled_steps > 10
    compiled.forget("mix")  # its weights may have changed: eager again until warmed again
    steps = compiled.stats.compiled_steps
    assert compiled.generate([row], adapter="mix", max_new=20) == reference and compiled.stats.compiled_steps == steps


def test_adapters_loaded_later_use_the_compiled_step_only_where_their_shapes_were_compiled(
    policy,
    tiny_model_dir,
    tmp_path,  # noqa: ANN001
) -> None:
    served = LocalPolicy(str(tiny_model_dir), 8, "float32", compiled_steps=True)
    served.add_adapter("mix", policy.adapters["mix"])
    assert served.decoder.streams.ready == set() and served.warm_steps() > 0
    assert served.decoder.streams.ready == {None, "mix"}
    served.add_adapter("same", _adapter(tiny_model_dir, tmp_path / "same", 4))  # the shapes of "mix": no compile
    served.add_adapter("wider", _adapter(tiny_model_dir, tmp_path / "wider", 8))  # rank 8: eager
    assert served.decoder.streams.ready == {None, "mix", "same"}
    [row] = _rows(served, 1)
    decoder, eager = served.decoder, Decoder(served.base, set())
    decoder.stop_ids = set()
    for adapter in ("same", "wider"):
        before = decoder.stats.compiled_steps
        assert decoder.generate([row], adapter=adapter, max_new=12) == eager.generate(
            [row], adapter=adapter, max_new=12
        )
        assert (decoder.stats.compiled_steps > before) == (adapter == "same")


def test_the_first_adapter_loaded_at_runtime_does_not_recompile_the_base_step(tiny_model_dir, policy) -> None:  # noqa: ANN001
    import torch

    served = LocalPolicy(str(tiny_model_dir), 8, "float32", compiled_steps=True)
    assert served.warm_steps() > 0 and served.decoder.streams.ready == {None}
    served.add_adapter("mix", policy.adapters["mix"])  # the base becomes a PEFT model's, its weights frozen by PEFT
    [row] = _rows(served, 1)
    decoder, eager = served.decoder, Decoder(served.base, set())
    decoder.stop_ids = set()
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile would stall a server for seconds
        assert decoder.generate([row], adapter=None, max_new=12) == eager.generate([row], adapter=None, max_new=12)
    assert decoder.stats.compiled_steps == 11
