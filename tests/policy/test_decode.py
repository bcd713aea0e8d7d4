"""The decoder against transformers' generate on a tiny random model (fp32): the same tokens, less work."""

from __future__ import annotations

import pytest
import torch

from autoevolve.envs.life import LifeEnv
from autoevolve.harness.hcp import HCPConfig
from autoevolve.policy import ChatRequest
from autoevolve.policy.decode import Decoder, supports
from autoevolve.policy.local import LocalPolicy


@pytest.fixture(scope="module")
def pair(tiny_model_dir):  # noqa: ANN001, ANN201
    """The tiny model twice: through the decoder and through model.generate."""
    return LocalPolicy(str(tiny_model_dir), 8, "float32"), LocalPolicy(str(tiny_model_dir), 8, "float32", engine="hf")


def _requests(n: int, tokens: int, env: LifeEnv | None = None) -> list[ChatRequest]:
    hcp = HCPConfig.from_yaml("prompts/life.yaml")
    tasks = (env or LifeEnv()).tasks("dev")[:n]
    return [ChatRequest(messages=hcp.render(t)[0], max_new_tokens=tokens) for t in tasks]


def _same_or_tied(policy: LocalPolicy, request: ChatRequest, a: str, b: str) -> bool:
    """Equal texts, or the first token where they part is an exact tie of the reference logits (either is argmax)."""
    if a == b:
        return True
    tok = policy.tokenizer
    x, y = tok(a, add_special_tokens=False)["input_ids"], tok(b, add_special_tokens=False)["input_ids"]
    k = next(i for i in range(min(len(x), len(y))) if x[i] != y[i])
    prompt = tok(policy._template(request), add_special_tokens=False)["input_ids"]  # noqa: SLF001
    with torch.inference_mode():
        logits = policy.base(torch.tensor([prompt + x[:k]])).logits[0, -1]
    return abs(float(logits[x[k]] - logits[y[k]])) < 1e-4


def test_greedy_tokens_equal_generate(pair) -> None:  # noqa: ANN001
    fast, reference = pair
    assert fast.decoder is not None and reference.decoder is None
    requests = _requests(8, 24)
    mine, theirs = fast.generate(requests), reference.generate(requests)
    assert all(_same_or_tied(reference, r, a.text, b.text) for r, a, b in zip(requests, mine, theirs, strict=True))
    assert sum(a.text == b.text for a, b in zip(mine, theirs, strict=True)) >= 6
    assert [c.completion_tokens for c in mine] == [24] * 8  # a random model never stops early
    assert [c.prompt_tokens for c in mine] == [c.prompt_tokens for c in theirs]


def test_the_shared_prefix_is_computed_once_and_ended_rows_leave(pair) -> None:  # noqa: ANN001
    fast, _ = pair
    decoder = Decoder(fast.base, fast._stop_ids)  # noqa: SLF001
    rows = [fast.tokenizer(fast._template(r), add_special_tokens=False)["input_ids"] for r in _requests(4, 8)]  # noqa: SLF001
    shared = next(i for i in range(len(rows[0])) if any(r[i] != rows[0][i] for r in rows))
    decoder.stop_ids = set()
    out = decoder.generate(rows, adapter=None, max_new=8)
    assert decoder.stats.prefill_tokens == shared + sum(len(r) - shared for r in rows)  # the prefix once
    assert decoder.stats.decode_steps == 7 and [len(o) for o in out] == [8] * 4
    again = decoder.generate(rows, adapter=None, max_new=8)
    assert again == out and decoder.stats.reused_tokens == shared  # the prefix came from the cache
    stop = out[0][2]
    decoder.stop_ids = {stop}  # row 0 ends before its third token; each row ends at its first stop token
    ended = decoder.generate(rows, adapter=None, max_new=8)
    assert ended == [o[: o.index(stop)] if stop in o else o for o in out] and len(ended[0]) == 2


def test_a_later_call_with_the_same_key_starts_from_the_stored_rows(pair) -> None:  # noqa: ANN001
    fast, _ = pair
    rows = [fast.tokenizer(fast._template(r), add_special_tokens=False)["input_ids"] for r in _requests(3, 4)]  # noqa: SLF001
    decoder = Decoder(fast.base, fast._stop_ids)  # noqa: SLF001
    decoder.stop_ids = set()
    first = decoder.generate(rows, adapter=None, max_new=4, cache_key="episode")
    # The next call: each prompt plus its reply and more, as an episode's next request would be.
    longer = [r + out + [28, 29, 30] for r, out in zip(rows, first, strict=True)]
    mark = decoder.stats.reused_tokens
    again = decoder.generate(longer, adapter=None, max_new=4, cache_key="episode")
    assert decoder.stats.reused_tokens - mark >= sum(len(r) for r in rows) - 2 * len(rows[0])  # own prompts reused
    fresh = Decoder(fast.base, fast._stop_ids)  # noqa: SLF001
    fresh.stop_ids = set()
    assert again == fresh.generate(longer, adapter=None, max_new=4)  # the same tokens as computing everything
    mark = decoder.stats.reused_tokens
    decoder.generate(longer, adapter=None, max_new=4, cache_key="another batch")
    assert decoder.stats.reused_tokens - mark < len(rows[0])  # another key starts from the shared prefix only


def test_a_lone_row_with_a_key_starts_from_the_longest_stored_prefix(pair) -> None:  # noqa: ANN001
    fast, _ = pair
    rows = [fast.tokenizer(fast._template(r), add_special_tokens=False)["input_ids"] for r in _requests(2, 4)]  # noqa: SLF001
    shared = next(i for i, (a, b) in enumerate(zip(*rows, strict=False)) if a != b)
    decoder = Decoder(fast.base, set())
    alone = decoder.generate([rows[1]], adapter=None, max_new=8)
    decoder.generate([rows[0]], adapter=None, max_new=8, cache_key="k")
    before = decoder.stats.prefill_tokens
    assert decoder.generate([rows[1]], adapter=None, max_new=8, cache_key="k") == alone
    assert decoder.stats.prefill_tokens - before == len(rows[1]) - shared  # the tokens they share came from the store


def test_an_adapter_computed_by_the_decoder_matches_peft(tiny_model_dir, tmp_path, pair) -> None:  # noqa: ANN001
    from peft import LoraConfig, get_peft_model

    from autoevolve.model import load

    lm, _ = load(str(tiny_model_dir), "float32")
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]  # some groups partly adapted
    get_peft_model(lm, LoraConfig(r=4, target_modules=targets, init_lora_weights=False)).save_pretrained(tmp_path)
    fast, reference = pair
    for policy in pair:
        policy.add_adapter("a", str(tmp_path))
    requests = _requests(4, 12)
    mine, theirs = fast.generate(requests, "a"), reference.generate(requests, "a")
    assert all(_same_or_tied(reference, r, a.text, b.text) for r, a, b in zip(requests, mine, theirs, strict=True))
    assert [c.text for c in mine] != [c.text for c in fast.generate(requests)]  # the adapter changes the output


def test_an_adapter_that_changes_the_head_is_served_by_generate(tiny_model_dir, tmp_path, pair, monkeypatch) -> None:  # noqa: ANN001
    from peft import LoraConfig, get_peft_model

    import autoevolve.policy.decode as decode
    from autoevolve.model import load

    lm, _ = load(str(tiny_model_dir), "float32")
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], init_lora_weights=False)
    peft = get_peft_model(lm, config)
    with torch.no_grad():
        peft.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1)  # a head trained apart
    peft.save_pretrained(tmp_path)
    fast, reference = pair
    for policy in pair:
        policy.add_adapter("head", str(tmp_path))
    assert not fast.decoder.serves("head")  # the decoder computes the projections' LoRA only
    with pytest.raises(ValueError, match="lm_head"):
        fast.decoder.generate([[1, 2, 3]], adapter="head", max_new=2)
    monkeypatch.setattr(decode, "beyond_projections", lambda *_: pytest.fail("judged again"))
    assert not fast.decoder.serves("head")  # the verdict is kept until the adapter is loaded anew
    requests = _requests(2, 8)
    assert [c.text for c in fast.generate(requests, "head")] == [c.text for c in reference.generate(requests, "head")]


def test_the_decoder_serves_the_base_beside_adapters_without_switching_peft(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    from peft import LoraConfig, get_peft_model

    from autoevolve.model import load

    lm, _ = load(str(tiny_model_dir), "float32")
    get_peft_model(lm, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(tmp_path)
    policy = LocalPolicy(str(tiny_model_dir), 8, "float32")
    requests = _requests(2, 8)
    alone = [c.text for c in policy.generate(requests)]
    policy.add_adapter("a", str(tmp_path))

    def switched(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - PEFT walks every module to switch (55-80 ms)
        raise AssertionError("the decoder computes each adapter from its own weights")

    policy.lm.disable_adapter = policy.lm.set_adapter = switched
    assert [c.text for c in policy.generate(requests)] == alone
    adapted = policy.generate(requests, "a")
    assert not any(c.error for c in adapted) and [c.text for c in adapted] != alone


def test_sampling_is_seeded_and_kept_to_top_p_top_k_and_min_p() -> None:
    from autoevolve.policy.batch import Sampling, _pick

    logits = torch.randn(4, 50)
    draw = [_pick(logits, Sampling(1.0, 0.9), torch.Generator().manual_seed(s)).tolist() for s in (1, 1, 2)]
    assert draw[0] == draw[1] and draw[0] != draw[2]
    likely = torch.tensor([[5.0, 4.9, 4.0, -20.0]]).repeat(256, 1)
    nucleus = _pick(likely[:, [0, 1, 3, 3]], Sampling(1.0, 0.5), torch.Generator())
    assert set(nucleus.tolist()) <= {0, 1}  # top-p keeps the two likely tokens only
    assert set(_pick(likely, Sampling(1.0), torch.Generator().manual_seed(0)).tolist()) == {0, 1, 2}
    assert set(_pick(likely, Sampling(1.0, top_k=2), torch.Generator()).tolist()) == {0, 1}
    assert set(_pick(likely, Sampling(1.0, min_p=0.5), torch.Generator()).tolist()) == {0, 1}  # e^-1 < 0.5 of the best


def test_the_repetition_penalty_picks_what_transformers_picks(pair) -> None:  # noqa: ANN001
    fast, reference = pair
    requests = [r.model_copy(update={"repetition_penalty": 0.3}) for r in _requests(4, 16)]  # below 1: repeat
    mine, theirs, plain = fast.generate(requests), reference.generate(requests), fast.generate(_requests(4, 16))
    assert all(_same_or_tied(reference, r, a.text, b.text) for r, a, b in zip(requests, mine, theirs, strict=True))
    assert [c.text for c in mine] != [c.text for c in plain]  # it changes what greedy decoding picks


def test_other_architectures_use_generate(tmp_path, tokenizer) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tokenizer))).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    policy = LocalPolicy(str(tmp_path), 4, "float32")
    assert not supports(policy.base) and policy.decoder is None
    out = policy.generate(_requests(2, 5))
    assert [c.completion_tokens for c in out] == [5, 5] and not any(c.error for c in out)


def test_guessed_tokens_are_kept_only_where_the_model_agrees(pair, monkeypatch) -> None:  # noqa: ANN001
    import autoevolve.policy.batch as batch

    fast, _ = pair
    rows = [fast.tokenizer(fast._template(r), add_special_tokens=False)["input_ids"] for r in _requests(3, 4)]  # noqa: SLF001
    decoder = Decoder(fast.base, set())
    monkeypatch.setattr(batch, "GUESS_BUDGET", 0)  # one token per step
    plain = decoder.generate(rows, adapter=None, max_new=12)
    steps = decoder.stats.decode_steps
    monkeypatch.setattr(batch, "GUESS_BUDGET", 40)

    def guesses(right: bool):  # noqa: ANN202
        def guess(self, outs: list[list[int]], max_new: int) -> list[list[int]]:  # noqa: ANN001
            found = []
            for context, prompt, out in zip(self.context, self.prompt, outs, strict=True):
                row = next(i for i, r in enumerate(rows) if context[:prompt] == r)
                found.append(plain[row][len(out) : len(out) + 3] if right else [7, 8, 9])
            return found

        return guess

    for right, fewer in ((True, True), (False, False)):
        monkeypatch.setattr(batch.Guesses, "guess", guesses(right))
        mark = (decoder.stats.decode_steps, decoder.stats.guessed_tokens)
        assert decoder.generate(rows, adapter=None, max_new=12) == plain
        taken, guessed = decoder.stats.decode_steps - mark[0], decoder.stats.guessed_tokens - mark[1]
        assert (taken <= steps // 3 + 1 and guessed >= 2 * steps) if fewer else (taken == steps and guessed == 0)


def test_a_packed_projection_computes_what_linear_computes() -> None:
    from autoevolve.policy.weights import pack

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    proj = pack(weight, bias)
    for shape in ((1, 24), (13, 24), (3, 5, 24)):  # any row count, and prefill's [rows, tokens, in]
        x = torch.randn(*shape, generator=gen)
        assert torch.allclose(proj(x), torch.nn.functional.linear(x, weight, bias), atol=1e-4)
    assert pack(weight.double()).packed is None  # only fp32 is packed; others call F.linear


def test_rows_leaving_move_only_the_live_rows_past_the_end(pair) -> None:  # noqa: ANN001
    from autoevolve.policy.batch import Rows

    fast, _ = pair
    cache = Rows.allocate(fast.decoder, [3, 5, 2, 4, 1], max_new=2)
    for slot in range(5):
        cache.k[0][slot] = slot
    before = cache.k[0].data_ptr()
    moved = cache.keep([1, 3, 4])  # slots 0 and 2 ended: 1 stays, 3 and 4 (past the new end) fill the holes
    assert moved == [3, 1, 4] and cache.lengths == [4, 5, 1]
    assert [int(cache.k[0][s].flatten()[0]) for s in range(3)] == [3, 1, 4]
    assert cache.k[0].data_ptr() == before and cache.k[0].shape[0] == 3  # a view of the same buffer


def test_a_row_may_start_from_the_keys_and_values_another_adapter_computed(tiny_model_dir, tmp_path, pair) -> None:  # noqa: ANN001
    """The router's shared_kv switch: a lone row under adapter 'zero' continues a conversation the bare base
    computed, from the base's stored keys and values; with B = 0 the two agree, so the tokens are the same."""
    from peft import LoraConfig, get_peft_model

    from autoevolve.model import load

    lm, _ = load(str(tiny_model_dir), "float32")
    get_peft_model(lm, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(tmp_path)  # B = 0
    fast, _ = pair
    fast.add_adapter("zero", str(tmp_path))
    [first] = _requests(1, 6)
    [said] = fast.generate([first.model_copy(update={"cache_key": "turn"})])
    later = first.model_copy(
        update={
            "messages": [
                *first.messages,
                {"role": "assistant", "content": said.text},
                {"role": "user", "content": "And tomorrow?"},
            ]
        }
    )
    stats = fast.decoder.stats
    mark, computed = stats.reused_tokens, stats.prefill_tokens
    [borrowed] = fast.generate([later.model_copy(update={"cache_key": "turn", "reuse_kv_of": ""})], "zero")
    assert stats.reused_tokens - mark >= said.prompt_tokens - 1  # the base's stored prompt, not computed again
    assert stats.prefill_tokens - computed < borrowed.prompt_tokens - said.prompt_tokens + 8
    assert {s.adapter for s in fast.decoder.store.entries.values()} == {None}  # mixed keys and values are not kept
    [own] = fast.generate([later], "zero")
    assert _same_or_tied(fast, later, borrowed.text, own.text)


def test_rows_joining_a_running_batch_get_the_tokens_they_get_alone(pair) -> None:  # noqa: ANN001
    """Continuous batching: one row starts (its whole prompt is the batch's prefix), others join after 2 and 5
    steps with prompts that share only part of it; every row decodes what it decodes alone, to its own limit."""
    from autoevolve.policy.batch import Joiner

    fast, _ = pair
    decoder = Decoder(fast.base, fast._stop_ids)  # noqa: SLF001
    decoder.stop_ids = set()
    rows = [fast.tokenizer(fast._template(r), add_special_tokens=False)["input_ids"] for r in _requests(4, 8)]  # noqa: SLF001
    alone = [decoder.generate([r], adapter=None, max_new=n)[0] for r, n in zip(rows, (12, 9, 6, 10), strict=True)]
    finished: dict[int, list[int]] = {}
    heard: list[int] = []
    plan = {2: [1, 2], 5: [3]}  # after how many steps which rows join
    steps = iter(range(1, 100))

    def arrivals(live: int) -> list[Joiner]:
        joining = plan.pop(next(steps), [])
        limits = {1: 9, 2: 6, 3: 10}
        listener = {3: lambda t: heard.extend(t) or True}
        return [
            Joiner(rows[i], limits[i], listener.get(i), done=lambda out, i=i: finished.setdefault(i, out))
            for i in joining
        ]

    before = decoder.stats.prefill_tokens
    [first] = decoder.generate([rows[0]], adapter=None, max_new=12, arrivals=arrivals)
    assert [first, finished[1], finished[2], finished[3]] == alone
    assert heard == alone[3] and not plan
    shared = min(next(i for i in range(len(r)) if r[i] != rows[0][i]) for r in rows[1:])
    # the first row's prompt once (its prefix is kept from the calls alone), the joiners' own tokens after the cut
    assert decoder.stats.prefill_tokens - before == 1 + sum(len(r) - shared for r in rows[1:])


def test_a_guided_row_does_not_join_a_batch_that_guesses(pair) -> None:  # noqa: ANN001
    from autoevolve.policy.batch import Joiner

    fast, _ = pair
    decoder = Decoder(fast.base, fast._stop_ids)  # noqa: SLF001
    rows = [fast.tokenizer(fast._template(r), add_special_tokens=False)["input_ids"] for r in _requests(2, 8)]  # noqa: SLF001
    with pytest.raises(ValueError, match="joins only a batch that decodes it alike"):
        decoder.generate([rows[0]], adapter=None, max_new=8, arrivals=lambda live: [Joiner(rows[1], 8, guide=object())])


def test_one_token_steps_read_a_bf16_copy_and_longer_inputs_the_fp32_weights() -> None:
    from autoevolve.policy.weights import pack

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    proj = pack(weight, bias, compact=True)
    assert proj.half is not None and proj.half.dtype == torch.bfloat16 and pack(weight, bias).half is None
    one = torch.randn(1, 1, 24, generator=gen)
    halved = torch.nn.functional.linear(one.bfloat16(), weight.bfloat16()).float() + bias
    assert torch.equal(proj(one), halved) and not torch.equal(halved, torch.nn.functional.linear(one, weight, bias))
    rows = torch.randn(3, 1, 24, generator=gen)
    assert torch.allclose(proj(rows), torch.nn.functional.linear(rows, weight, bias), atol=1e-4)


def test_a_compact_weights_decoder_keeps_fp32_for_several_rows(tiny_model_dir, pair) -> None:  # noqa: ANN001
    fast, _ = pair
    halved = LocalPolicy(str(tiny_model_dir), 8, "float32", compact_weights=True)
    assert halved.decoder is not None and halved.decoder.logits.half is not None
    requests = _requests(4, 16)
    assert [c.text for c in halved.generate(requests)] == [c.text for c in fast.generate(requests)]  # 4 rows: fp32
    one = halved.generate(requests[:1])[0]
    assert one.completion_tokens == 16 and one.text == halved.generate(requests[:1])[0].text


def test_compact_weights_load_fp32_where_auto_would_pick_bf16(tiny_model_dir, monkeypatch) -> None:  # noqa: ANN001
    """On a CPU with native bf16, "auto" loads bf16 weights, of which no compact copy is made: serving there kept
    every step on bf16 products. Compact weights load fp32 instead; a plain policy keeps "auto"."""
    from autoevolve import model as model_loader

    monkeypatch.setattr(model_loader, "native_bf16", lambda: True)
    assert LocalPolicy(str(tiny_model_dir), 8).base.dtype == torch.bfloat16
    compact = LocalPolicy(str(tiny_model_dir), 8, compact_weights=True)
    assert compact.base.dtype == torch.float32
    assert compact.decoder is not None and compact.decoder.logits.half is not None  # a compact copy, made from fp32
    assert LocalPolicy(str(tiny_model_dir), 8, "bfloat16", compact_weights=True).base.dtype == torch.bfloat16


def _four_bit(weight: torch.Tensor) -> torch.Tensor:
    """The weight snapped to 4 bits per group of 32 inputs (as a Q4_1 GGUF's layers dequantise)."""
    groups = weight.reshape(weight.shape[0], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    return (((groups - low) / step).round() * step + low).reshape(weight.shape)


def test_a_4bit_weight_is_read_as_its_codes_for_a_few_rows_and_fp32_beyond() -> None:
    from autoevolve.policy.weights import FOUR_BIT_ROWS, FourBit, pack

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    assert FourBit.of(weight) is None and pack(weight, compact=True).half is not None  # not 4-bit: a bf16 copy
    snapped = _four_bit(weight)
    proj = pack(snapped, bias, compact=True)
    assert proj.four_bit is not None and proj.half is None
    exact = torch.nn.functional.linear
    for rows in (1, FOUR_BIT_ROWS):
        x = torch.randn(rows, 1, 64, generator=gen)
        assert torch.equal(proj(x), proj.four_bit(x) + bias)
        assert torch.allclose(proj(x), exact(x, snapped, bias), rtol=2e-2, atol=5e-2)
        assert not torch.allclose(proj(x), exact(x, snapped, bias), atol=1e-4)  # computed in bf16
    more = torch.randn(FOUR_BIT_ROWS + 1, 1, 64, generator=gen)
    assert torch.allclose(proj(more), exact(more, snapped, bias), atol=1e-4)


def test_a_decoder_over_4bit_layers_reads_their_codes(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    from autoevolve.model import load

    lm, tokenizer = load(str(tiny_model_dir), "float32")
    with torch.no_grad():
        for layer in lm.model.layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(_four_bit(module.weight))
    lm.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    policy = LocalPolicy(str(tmp_path), 8, "float32", compact_weights=True)
    assert policy.decoder is not None
    assert all(p.four_bit is not None and p.half is None for layer in policy.decoder.base for p in layer.values())
    assert policy.decoder.logits.four_bit is None and policy.decoder.logits.half is not None  # the head is not 4-bit
    one = policy.generate(_requests(1, 16))[0]
    assert one.completion_tokens == 16 and one.text == policy.generate(_requests(1, 16))[0].text


def test_rows_of_other_adapters_join_and_decode_what_they_decode_alone(tiny_model_dir, tmp_path, pair) -> None:  # noqa: ANN001
    """A batch of the bare base is joined by a row under an adapter, then at once by one of the base and one under a
    second adapter (another rank, other layers): the prefix is cut, each prefill and step adds each row's own LoRA,
    and every row gets the tokens it gets alone under its adapter; under a cache key every row's keys and values are
    kept under its own adapter, and a later call under it starts from them."""
    from peft import LoraConfig, get_peft_model

    from autoevolve.model import load
    from autoevolve.policy.batch import Joiner

    fast, _ = pair
    for name, rank, targets in (("mix", 4, ["q_proj", "up_proj"]), ("other", 2, ["v_proj", "up_proj", "down_proj"])):
        lm, _ = load(str(tiny_model_dir), "float32")
        config = LoraConfig(r=rank, target_modules=targets, init_lora_weights=False)
        get_peft_model(lm, config).save_pretrained(tmp_path / name)
        fast.add_adapter(name, str(tmp_path / name))
    decoder = Decoder(fast.base, fast._stop_ids)  # noqa: SLF001
    decoder.stop_ids = set()
    rows = [fast.tokenizer(fast._template(r), add_special_tokens=False)["input_ids"] for r in _requests(4, 8)]  # noqa: SLF001
    under = [None, "mix", None, "other"]
    alone = [decoder.generate([r], adapter=a, max_new=10)[0] for r, a in zip(rows, under, strict=True)]
    for i in (1, 3):  # each adapter changes the tokens
        assert alone[i] != decoder.generate([rows[i]], adapter=None, max_new=10)[0]
    finished: dict[int, list[int]] = {}
    plan, steps = {2: [1], 4: [2, 3]}, iter(range(1, 100))  # the last two join in one pass, each under its own

    def arrivals(live: int) -> list[Joiner]:
        return [
            Joiner(rows[i], 10, done=lambda out, i=i: finished.setdefault(i, out), adapter=under[i])
            for i in plan.pop(next(steps), [])
        ]

    [first] = decoder.generate([rows[0]], adapter=None, max_new=10, arrivals=arrivals)
    assert [first, finished[1], finished[2], finished[3]] == alone and not plan
    plan, steps = {2: [1], 4: [2, 3]}, iter(range(1, 100))
    decoder.generate([rows[0]], adapter=None, max_new=10, arrivals=arrivals, cache_key="chat")
    assert sorted({s.adapter or "" for s in decoder.store.entries.values()}) == ["", "mix", "other"]
    for i in (1, 3):
        mark = decoder.stats.reused_tokens
        assert decoder.generate([rows[i]], adapter=under[i], max_new=10, cache_key="chat") == [alone[i]]
        assert decoder.stats.reused_tokens - mark == len(rows[i]) - 1  # all its prompt but the token it feeds
