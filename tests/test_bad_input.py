"""Bad input a new user hits on day one: one line naming the file or field and the fix, exit 2, no traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autoevolve.config import ConfigError, changed_settings, load_config
from autoevolve.fleet.registry import decide
from autoevolve.loop import check_run
from autoevolve.records import Cell, EvalReport
from autoevolve.store import Store
from tests.fleet.test_registry import BASE, _adapter, _register

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autoevolve.cli", *args], capture_output=True, text=True, cwd=ROOT)


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a refused command."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _config(tmp_path: Path, extra: str = "", hcp: str = "prompts/life.yaml") -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"hcp: {ROOT / hcp}\nstore: {tmp_path / 's.duckdb'}\nrun_dir: {tmp_path / 'runs'}\n{extra}")
    return path


def test_a_store_that_is_not_duckdb_is_named_with_the_fix(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    for args in (["registry", "--store", str(text), "list"], ["registry", "list", "--store", str(text)]):
        line = _one_line(_cli(*args))
        assert line.startswith(f"autoevolve: {text} is not a DuckDB database: point --store")
    assert _one_line(_cli("inspect", "quickstart", "--store", str(text))).startswith(f"autoevolve: {text} is not a")
    config = _config(tmp_path).read_text().replace(str(tmp_path / "s.duckdb"), str(text))
    (tmp_path / "run.yaml").write_text(config)
    assert f"{text} is not a DuckDB database" in _one_line(_cli("run", str(tmp_path / "run.yaml")))
    assert text.read_text() == "not a database\n"


def test_registry_takes_store_before_or_after_the_action(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    with Store(db) as store:
        store.put_run("r", {})
    after, before = _cli("registry", "list", "--store", str(db)), _cli("registry", "--store", str(db), "list")
    assert after.returncode == before.returncode == 0
    hint = "no experts registered (add one: autoevolve registry add-expert NAME --base-model MODEL)\n"
    assert after.stdout == before.stdout == hint


def test_a_malformed_environment_file_stops_check_and_run(tmp_path: Path) -> None:
    good = (ROOT / "autoevolve/envs/data/bfcl_sample.jsonl").read_text().splitlines()
    broken = tmp_path / "questions.jsonl"
    broken.write_text("\n".join([good[0], good[1][:40], *good[2:]]) + "\n")
    config = _config(tmp_path, f"env:\n  name: fncall\n  args: {{path: {broken}}}\n", hcp="prompts/fncall.yaml")
    for command in ("check", "run"):
        line = _one_line(_cli(command, str(config)))
        assert line.startswith(f"autoevolve: config error: {config}: env: FncallEnv(): {broken}:2: not valid JSON")
    assert not (tmp_path / "s.duckdb").exists()  # nothing written
    ok = _cli("check", str(ROOT / "configs/fncall.yaml"))
    assert ok.returncode == 0 and "env fncall: 20 train, 6 dev, 6 test tasks" in ok.stdout


def test_an_unknown_hcp_placeholder_is_named(tmp_path: Path) -> None:
    hcp = tmp_path / "h.yaml"
    hcp.write_text((ROOT / "prompts/life.yaml").read_text().replace("{memory}", "{memroy}"))
    with pytest.raises(
        ConfigError, match=r"h\.yaml: system_prompt: .*unknown placeholder \{memroy\}; the harness fills"
    ):
        load_config(_config(tmp_path, hcp=str(hcp)))
    literal = (ROOT / "prompts/life.yaml").read_text().replace("{memory}", '{memory} Reply as {"a": 1}.')
    hcp.write_text(literal)
    assert load_config(_config(tmp_path, hcp=str(hcp))).original_hcp().system_prompt.endswith('{"a": 1}.')


def _live_adapter(tmp_path: Path) -> Path:
    """A store whose L1-life expert has a live v1 (a fake but valid folder); returns the folder."""
    folder = _adapter(tmp_path / "runs/a1")
    with Store(tmp_path / "s.duckdb") as store:
        record = _register(store, folder)
        cells = {"live_original": Cell(adapter="", hcp_id="h", mean=0.5, n=8)}
        report = EvalReport(run_id="run", round=0, split="dev", cells=cells, decision="promote", reason="test")
        decide(store, record, report)
    return folder


def test_a_missing_live_adapter_or_another_base_model_stops_the_run(tmp_path: Path) -> None:
    config_path = _config(tmp_path)
    folder = _live_adapter(tmp_path)
    shutil.rmtree(folder)
    line = _one_line(_cli("run", str(config_path)))
    assert line.startswith(f"autoevolve: live adapter L1-life@v1: adapter {folder}: adapter_config.json is missing;")
    assert line.endswith(f"`autoevolve registry --store {tmp_path / 's.duckdb'} rollback L1-life`")
    other = _config(tmp_path, "model:\n  name: some-org/other-model\n")
    line = _one_line(_cli("run", str(other)))
    assert "expert L1-life in" in line and f"is trained on {BASE}, but model.name is some-org/other-model" in line


def test_a_run_id_reused_with_other_settings_says_what_differs(tmp_path: Path) -> None:
    first = load_config(_config(tmp_path, "run_id: r\nselect:\n  margin: 0.1\n"))
    with Store(first.store) as store:
        store.put_run("r", first.model_dump(mode="json"))
    again = load_config(_config(tmp_path, "run_id: r\nrounds: 3\nselect:\n  margin: 0.1\n"))
    changed = load_config(_config(tmp_path, "run_id: r\nseed: 4\nselect:\n  margin: 0.2\n"))
    with Store(first.store) as store:
        check_run(store, again)  # more rounds (or another store path, run_dir, hooks) is the same run
        with pytest.raises(
            ConfigError,
            match=r"run r in .* was recorded with other settings: seed: 0 -> 4; select\.margin: 0\.1 -> 0\.2;",
        ):
            check_run(store, changed)
    path = _config(tmp_path, "run_id: r\nselect:\n  margin: 0.2\n")
    assert "select.margin: 0.1 -> 0.2" in _one_line(_cli("run", str(path)))


def test_changed_settings_skips_operational_and_new_fields() -> None:
    before = {"seed": 0, "rounds": 1, "model": {"name": "m", "batch_size": 8}, "store": "a"}
    after = {"seed": 0, "rounds": 5, "model": {"name": "n", "batch_size": 64, "new": 1}, "store": "b", "extra": 2}
    assert changed_settings(before, after) == ['model.name: "m" -> "n"']


@pytest.mark.parametrize(
    ("env", "hcp", "message"),
    [
        ("{loader: 'missing_env.py:Env'}", "", "env.loader: file missing_env.py not found"),
        ("{loader: 'shop_env.py:ShopEnv'}", "", "env: ShopEnv() returned ShopEnv, which has no 'name'"),
        (
            "{name: trl, args: {environment: shop_env.py:ShopEnv, data: tasks.jsonl, colour: red}}",
            "",
            "env.args.colour: TRLEnvironment() takes no argument 'colour' (it takes: environment, data, name,",
        ),
        (
            "{name: trl, args: {environment: shop_env.py:ShopEnv, data: tasks.jsonl}}",
            "tools: [{type: function, function: {name: refund, parameters: {type: object, properties: {}}}}]\n",
            "hcp.yaml: tools[0]: the environment has no tool 'refund' (it has: check_stock, order)",
        ),
        (
            "{name: trl, args: {environment: shop_env.py:ShopEnv, data: bad.jsonl}}",
            "",
            "bad.jsonl:2: column 'prompt': ",
        ),
    ],
)
def test_check_refuses_an_environment_that_does_not_fit_in_one_line(
    tmp_path: Path, env: str, hcp: str, message: str
) -> None:
    for name in ("shop_env.py", "tasks.jsonl"):
        shutil.copy(ROOT / "examples" / "shop" / name, tmp_path / name)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "Order 2 tea.", "item": "tea", "quantity": 2}\n{"prompt": 7}\n')
    (tmp_path / "hcp.yaml").write_text("system_prompt: 'Tools: {tools}'\n" + hcp)
    (tmp_path / "run.yaml").write_text(f"hcp: hcp.yaml\nstore: {tmp_path / 's.duckdb'}\nenv: {env}\n")
    line = _one_line(_cli("check", str(tmp_path / "run.yaml")))
    assert line.startswith("autoevolve: config error: ") and message in line, line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--adapter", "L1-life@v9"], "autoevolve: --adapter L1-life@v9: no such adapter in "),
        (
            ["--adapter", "no/such/folder"],
            "autoevolve: --adapter no/such/folder: adapter no/such/folder: adapter_config",
        ),
        (["--hcp", "0123abc"], "autoevolve: --hcp 0123abc: "),
        (["--env", "{name: nope}"], "autoevolve: env.name: unknown environment 'nope'"),
    ],
)
def test_eval_refuses_what_it_cannot_score_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    line = _one_line(
        _cli("eval", str(_config(tmp_path, "env: {tiers: [1], n_train: 8, n_dev: 4, n_test: 4}\n")), *args)
    )
    assert line.startswith(message), line
    assert not (tmp_path / "s.duckdb").exists()  # a refused eval leaves no store behind


def test_verbose_goes_before_or_after_the_command(tmp_path: Path) -> None:
    config = str(_config(tmp_path, "env: {tiers: [1], n_train: 8, n_dev: 4, n_test: 4}\n"))
    for args in (["-v", "check", config], ["check", "-v", config], ["check", config, "--verbose"]):
        done = _cli(*args)
        assert done.returncode == 0 and ": ok (run run, original HCP " in done.stdout, (args, done.stderr)


def test_a_refused_add_expert_creates_no_store(tmp_path: Path) -> None:
    store = str(tmp_path / "new.duckdb")
    line = _one_line(_cli("registry", "add-expert", "bad name!", "--base-model", BASE, "--store", store))
    assert line.startswith("autoevolve: expert name 'bad name!' is not allowed") and not Path(store).exists()
    tier = _cli("registry", "add-expert", "L1-x", "--tier", "-1", "--base-model", BASE, "--store", store)
    assert tier.returncode == 2 and "--tier: -1 is below 0" in tier.stderr and not Path(store).exists()
    assert _cli("registry", "add-expert", "L1-x", "--base-model", BASE, "--store", store).returncode == 0
    assert Path(store).exists()


BROKEN = """
from autoevolve.envs.life import LifeEnv, LifeEpisode


class Broken(LifeEpisode):
    def score(self, messages):
        return 1 / 0


class BrokenLife(LifeEnv):
    name = "broken"

    def start(self, task):
        return Broken(self.world, task)
"""


@pytest.mark.parametrize("command", [["check"], ["eval", "--tasks", "2"], ["run"]])
def test_an_environment_whose_score_raises_is_one_line_naming_the_method_and_task(
    tmp_path: Path, tiny_model_dir, command: list[str]
) -> None:
    (tmp_path / "broken_env.py").write_text(BROKEN)
    env = "{loader: broken_env.py:BrokenLife, tiers: [1], n_train: 8, n_dev: 4, n_test: 4}"
    config = _config(tmp_path, f"env: {env}\nmodel: {{name: {tiny_model_dir}}}\n")
    line = _one_line(_cli(command[0], str(config), *command[1:]))
    assert line.startswith("autoevolve: env broken: score on task broken/life-1-") and line.endswith(
        "ZeroDivisionError: division by zero"
    ), line


FAULTY = """
from autoevolve.envs.life import LifeEnv, LifeEpisode


class Faulty(LifeEnv):
    name = "faulty"

    def __init__(self, fault, **kwargs):
        super().__init__(**kwargs)
        self.fault = fault

    def tasks(self, split):
        if self.fault == "tasks":
            raise RuntimeError("the task list is gone")
        return super().tasks(split)

    def tools(self):
        if self.fault == "tools":
            raise RuntimeError("no tools today")
        return super().tools()

    def reference(self, task):
        if self.fault == "reference":
            raise RuntimeError("no answer key")
        self.solving = True  # life's reference plays the task through its own start
        try:
            return super().reference(task)
        finally:
            self.solving = False

    def start(self, task):
        if getattr(self, "solving", False):
            return super().start(task)
        if self.fault == "start":
            raise RuntimeError("cannot open the world")
        episode = super().start(task)
        if self.fault == "call":
            def call(name, arguments):
                raise RuntimeError("the backend is down")
            episode.call = call
        if self.fault == "unknown_call":
            known = episode.call
            def call(name, arguments):
                if name == "no_such_tool":
                    raise ValueError("what is that")
                return known(name, arguments)
            episode.call = call
        if self.fault == "score_range":
            episode.score = lambda messages: (2.0, "too much")
        return episode
"""


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("tasks", "env faulty: tasks: RuntimeError: the task list is gone"),
        ("tools", "env faulty: tools: RuntimeError: no tools today"),
        ("reference", "env faulty: reference on task faulty/life-1-"),
        ("start", "env faulty: start on task faulty/life-1-"),
        ("call", "on task faulty/life-1-"),
        ("unknown_call", "env faulty: call(no_such_tool) on task faulty/life-1-"),
        ("score_range", "env faulty: score on task faulty/life-1-"),
    ],
)
def test_check_names_the_method_of_an_environment_that_fails(tmp_path: Path, fault: str, message: str) -> None:
    """Every method of the protocol that raises (or a score out of range) is one line from check, exit 2."""
    (tmp_path / "faulty_env.py").write_text(FAULTY)
    env = f"{{loader: faulty_env.py:Faulty, args: {{fault: {fault}}}, tiers: [1], n_train: 8, n_dev: 4, n_test: 4}}"
    line = _one_line(_cli("check", str(_config(tmp_path, f"env: {env}\n"))))
    assert message in line, line
    what = {
        "call": "env faulty: call(",
        "unknown_call": "ValueError: what is that",
        "score_range": "returned (2.0, 'too much'), not (reward in [0, 1], text)",
    }
    assert what.get(fault, "RuntimeError: ") in line and not (tmp_path / "s.duckdb").exists()


def test_a_factory_that_raises_anything_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "boom_env.py").write_text("def make():\n    raise RuntimeError('the data server is down')\n")
    line = _one_line(_cli("check", str(_config(tmp_path, "env: {loader: boom_env.py:make}\n"))))
    assert line == "autoevolve: config error: " + str(tmp_path / "run.yaml") + (
        ": env: make() raised RuntimeError: the data server is down"
    ), line
