"""Shared fixtures: a tiny random model with the real tokenizer (fast), the real SmolLM2 (integration)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def env():
    """The life environment with tier-1 tasks."""
    from autoevolve.envs.life import LifeEnv

    return LifeEnv(tiers=(1,))


@pytest.fixture(scope="session")
def original():
    """The original HCP config of the life environment."""
    from autoevolve.harness.hcp import HCPConfig

    return HCPConfig.from_yaml("prompts/life.yaml")


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2 tokenizer (from the dequantised cache; built once per machine)."""
    from transformers import AutoTokenizer

    from autoevolve.model import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A randomly initialised two-layer Llama saved with the real tokenizer: loads like any model path."""
    return random_llama(tmp_path_factory.mktemp("tiny"), tokenizer, seed=0)


def random_llama(path, tokenizer, seed: int, **config):
    """Save a random two-layer Llama (``config`` overrides its settings) with the tokenizer at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    LlamaForCausalLM(LlamaConfig(**(settings | config))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_dir):
    """LocalPolicy over the tiny random model (it writes garbage, fast)."""
    from autoevolve.policy.local import LocalPolicy

    return LocalPolicy(str(tiny_model_dir), batch_size=8, dtype="float32")


@pytest.fixture(scope="session")
def smol_policy():
    """LocalPolicy over the real embedded SmolLM2-135M-Instruct."""
    from autoevolve.policy.local import LocalPolicy

    return LocalPolicy("smollm2-135m-instruct", batch_size=32)


@pytest.fixture(scope="session")
def prefect_harness():
    """One ephemeral Prefect API for the whole session (its first start migrates a SQLite database)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def postgres_server():
    """One PostgreSQL server for the session, in a temporary folder (started by the fixture, stopped after)."""
    from autoevolve.store.postgres import LocalServer

    if LocalServer.tool("initdb") is None:
        pytest.skip("PostgreSQL's server is not installed: make install installs it (Debian's postgresql)")
    server = LocalServer()
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh, empty database on the session's PostgreSQL server, by URL."""
    import uuid

    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_server.url, autocommit=True) as con:
        con.execute(f"CREATE DATABASE {name}")
    return postgres_server.url.replace("/postgres?", f"/{name}?")
