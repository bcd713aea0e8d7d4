"""Run configs: bad input fails before any work, with one line naming the field or file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autoevolve.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_quickstart_loads() -> None:
    config = load_config(ROOT / "configs/quickstart.yaml")
    assert config.distill.trainer == "sft" and config.rounds == 1
    assert config.run_id == "quickstart" and config.gate.test_tasks >= 64
    assert config.original_hcp().tool_names[1] == "book_table"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"hcp: {ROOT}/prompts/life.yaml\nevolve:\n  candidatez: 3\n", "evolve.candidatez: unknown key"),
        (
            f"hcp: {ROOT}/prompts/life.yaml\ngate:\n  dev_tasks: many\n",
            "gate.dev_tasks: Input should be a valid integer",
        ),
        ("hcp: prompts/nope.yaml\n", "hcp: file prompts/nope.yaml not found"),
        ("evolve: {}\n", "hcp: required setting is missing"),
        (
            f"hcp: {ROOT}/prompts/life.yaml\nmodel:\n  backend: tpu\n",
            "model.backend: Input should be 'local' or 'openai'",
        ),
        (
            f"hcp: {ROOT}/prompts/life.yaml\nevolve: {{frozen: [tool]}}\n",
            "evolve.frozen: Value error, unknown component 'tool'",
        ),
        (f"hcp: {ROOT}/prompts/fncall.yaml\nenv: {{name: fncall}}\n", "env.args.path: FncallEnv() needs it; add it"),
        (
            f"hcp: {ROOT}/prompts/life.yaml\ndistill: {{trainer: ppo}}\n",
            "distill.trainer: Input should be 'sft', 'dpo' or 'grpo'",
        ),
        (
            f"hcp: {ROOT}/prompts/life.yaml\ndistill: {{trainer: dpo, dpo: {{beta: 0}}}}\n",
            "distill.dpo.beta: Input should be greater than 0",
        ),
        (
            f"hcp: {ROOT}/prompts/life.yaml\ndistill: {{trainer: grpo, batch_size: 6, grpo: {{generations: 4}}}}\n",
            "distill: Value error, distill.batch_size x distill.grad_accum (6) must be a multiple of "
            "distill.grpo.generations (4): each grpo step trains on whole groups of replies",
        ),
        (
            f"hcp: {ROOT}/prompts/life.yaml\ndistill: {{trainer: grpo, grpo: {{genrations: 2}}}}\n",
            "distill.grpo.genrations: unknown key",
        ),
        (
            f"hcp: {ROOT}/prompts/life.yaml\nselect: {{unpaired_after: 16}}\ndistill: {{trainer: dpo}}\n",
            "select.unpaired_after: trainer dpo needs each win paired with the original's rollout on its task; "
            "leave out select.unpaired_after, or train with sft",
        ),
        (
            f"hcp: {ROOT}/prompts/life.yaml\ndistill: {{trainer: dpo, rehearse: true}}\n",
            "distill.rehearse: Value error, only trainer sft rehearses (the trainer is dpo); set rehearse: false",
        ),
        (
            f"hcp: {ROOT}/prompts/bfcl.yaml\nenv: {{name: fncall, args: {{path: {ROOT}/autoevolve/envs/data/"
            "bfcl_sample.jsonl}}\nmodel: {backend: openai}\nevolve: {mutators: [decoding]}\n",
            "the decoding mutator would constrain calls written as python_list (tool_format json), which an "
            "OpenAI-compatible server cannot; use call_syntax json or native tools",
        ),
        (
            f"hcp: {ROOT}/prompts/fncall.yaml\nenv: {{name: fncall, args: {{path: nope.jsonl}}}}\n",
            "env.args.path: file nope.jsonl not found",
        ),
        (
            f"hcp: {ROOT}/prompts/life.yaml\n"
            "evolve: {mutators: [reflective], reflection: {meta_prompts: x.yaml}}\n",
            "evolve.reflection.meta_prompts: file x.yaml not found",
        ),
        (
            f"hcp: {ROOT}/prompts/life.yaml\nenv: {{tiers: [1, 2]}}\ngate: {{guard: {{env: {{tiers: [2, 3]}}}}}}\n",
            "gate.guard.env.tiers: tier 2 is also trained on; a guard set needs another tier",
        ),
        (f"hcp: {ROOT}/prompts/life.yaml\nexpert: ../up\n", "expert: Value error, expert name '../up' is not allowed"),
        (
            f"hcp: {ROOT}/prompts/life.yaml\ngate: {{guard: {{env: {{name: fncall}}}}}}\n",
            "gate.guard.env.args.path: FncallEnv() needs it",
        ),
        (f"hcp: {ROOT}/prompts/life.yaml\nenv: {{name: nope}}\n", "env.name: unknown environment 'nope' (registered: "),
        (
            f"hcp: {ROOT}/prompts/life.yaml\nenv: {{loader: 'no_such_module:make'}}\n",
            "env.loader: loader 'no_such_module:make': cannot import no_such_module",
        ),
        (f"hcp: {ROOT}/prompts/life.yaml\nenv: {{loader: 'envs.py:make'}}\n", "env.loader: file envs.py not found"),
        (
            f"hcp: {ROOT}/prompts/life.yaml\nenv: {{name: life, args: {{size: 3}}}}\n",
            "env.args.size: LifeEnv() takes no argument 'size' (it takes: seed, tiers, n_train, n_dev, n_test)",
        ),
    ],
)
def test_bad_configs_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(_write(tmp_path, text))


@pytest.mark.parametrize(
    ("distill", "message"),
    [
        (
            "{grpo: {generations: 2}}",
            "distill.grpo: Value error, set only with distill.trainer: grpo (the trainer is sft)",
        ),
        ("{trainer: grpo, dpo: {beta: 0.2}}", "distill.dpo: Value error, set only with distill.trainer: dpo"),
        (
            "{trainer: sft, beta: 0.1}",  # the flat form of before: a trainer's own setting beside the shared ones
            "distill: Value error, distill.beta is dpo's own setting: set distill.dpo.beta, with distill.trainer: dpo",
        ),
        ("{trainer: dpo, generations: 2}", "distill.generations is grpo's own setting: set distill.grpo.generations"),
    ],
)
def test_a_trainers_own_setting_is_refused_under_another_trainer(tmp_path: Path, distill: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(_write(tmp_path, f"hcp: {ROOT}/prompts/life.yaml\ndistill: {distill}\n"))


def test_the_selected_trainers_section_round_trips(tmp_path: Path) -> None:
    text = "distill: {trainer: grpo, batch_size: 4, epochs: 1, grpo: {generations: 2, kl: 0.05}}\n"
    config = load_config(_write(tmp_path, f"hcp: {ROOT}/prompts/life.yaml\n{text}"))
    d = config.distill
    assert (d.trainer, d.batch_size, d.epochs, d.sft, d.dpo) == ("grpo", 4, 1, None, None)
    assert (d.grpo.generations, d.grpo.kl, d.grpo.completion_tokens) == (2, 0.05, 96)  # 96: the default
    again = RunConfig.model_validate_json(config.model_dump_json())  # as a deployment's parameters arrive
    assert again.distill == d and again.model_dump() == config.model_dump()
    dumped = yaml.safe_dump({"hcp": str(config.hcp), "distill": d.model_dump(exclude_none=True)})
    assert load_config(_write(tmp_path, dumped)).distill == d
    # A trainer left without its section runs with that section's defaults, and a dump records them.
    dpo = load_config(_write(tmp_path, f"hcp: {ROOT}/prompts/life.yaml\ndistill: {{trainer: dpo}}\n")).distill
    assert dpo.model_dump()["dpo"] == {"beta": 0.1} and dpo.grpo is None
    assert load_config(ROOT / "configs/loop.yaml").distill.sft.share_prefix is True


def test_reading_a_config_loads_no_trainer_or_rollout_engine() -> None:
    heavy = ("torch", "trl", "transformers", "autoevolve.harness.rollout", "autoevolve.stages.distill.grpo")
    code = f"import sys, autoevolve.config; print([m for m in sys.modules if m.startswith({heavy!r})])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_router_config_builds_its_environment() -> None:

    config = load_config(ROOT / "configs/router.yaml")
    env = config.env.make()
    assert config.expert == "L0-chat" and len(env.tasks("dev")) == 48
    assert config.original_hcp().tools_for(env.tasks("dev")[0])[0]["function"]["name"] == "change_model"


def test_fncall_config_builds_its_environment() -> None:

    config = load_config(ROOT / "configs/fncall.yaml")
    env = config.env.make()
    task = env.tasks("train")[0]
    assert env.name == "fncall" and task.tools and len(env.tasks("dev")) == config.evolve.dev_tasks
    messages, _ = config.original_hcp().render(task)
    assert task.tools[0]["function"]["name"] in messages[0]["content"]


def test_bfcl_config_reads_both_files_from_the_installed_package() -> None:
    config = load_config(ROOT / "configs/bfcl.yaml")
    env = config.env.make()
    assert [p.name for p in env.paths] == ["BFCL_v4_simple_python.json", "BFCL_v4_multiple.json"]
    assert [len(env.tasks(s)) for s in ("train", "dev", "test")] == [208, 64, 128] == [208, 64, config.gate.test_tasks]
    original = config.original_hcp()
    assert original.decoding.constrain == "none" and original.call_syntax == "python_list"
    assert "decoding" in config.evolve.mutators


def test_bad_hcp_file_names_that_file(tmp_path: Path) -> None:
    hcp = tmp_path / "h.yaml"
    hcp.write_text((ROOT / "prompts/life.yaml").read_text().replace("tool_format:", "tool_fromat:"))
    with pytest.raises(ConfigError, match=r"h\.yaml: tool_fromat: unknown key"):
        load_config(_write(tmp_path, f"hcp: {hcp}\n"))


def test_cli_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    path = _write(tmp_path, f"hcp: {ROOT}/prompts/life.yaml\nselect:\n  margn: 0.1\n")
    done = subprocess.run([sys.executable, "-m", "autoevolve.cli", "run", str(path)], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"autoevolve: config error: {path}: select.margn: unknown key (check the spelling; see the documented settings)"
    ]
    missing = subprocess.run(
        [sys.executable, "-m", "autoevolve.cli", "run", "nope.yaml"], capture_output=True, text=True
    )
    assert (
        missing.returncode == 2
        and "Traceback" not in missing.stderr
        and "nope.yaml: config file not found" in missing.stderr
    )


def test_cli_help_lists_commands() -> None:
    done = subprocess.run([sys.executable, "-m", "autoevolve.cli", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "run" in done.stdout and "check" in done.stdout
    sub = subprocess.run([sys.executable, "-m", "autoevolve.cli", "run", "--help"], capture_output=True, text=True)
    assert sub.returncode == 0 and "report.json" in sub.stdout


def test_library_never_imports_prefect() -> None:
    pattern = re.compile(r"^\s*(import prefect|from prefect)", re.M)
    offenders = [p for p in (ROOT / "autoevolve").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
