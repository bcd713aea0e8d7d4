"""The autoevolve command: self-evolution rounds for an LLM agent's LoRA expert, and the tools to read and serve them.

autoevolve run configs/quickstart.yaml    self-evolution rounds (Prefect flows, no server needed)
autoevolve check configs/quickstart.yaml  validate a run config and its HCP file, run the environment with no model
autoevolve eval configs/quickstart.yaml   score an adapter and HCP config on an environment's tasks (eval.json)
autoevolve candidates quickstart          the stage-1 ledger of a run: lineage, status, scores
autoevolve diff quickstart seed best      what changed between two of a run's HCP configs
autoevolve selections quickstart          the stage-2 selections of a run (--items: every kept rollout)
autoevolve inspect quickstart             a run at a glance: counts, one row per round, the last test 2x2
autoevolve export quickstart out/         a run's tables as Parquet folders partitioned by round
autoevolve registry list                  the LoRA experts and their live versions (also: show, promote, rollback,
                                          add-expert)
autoevolve deploy configs/quickstart.yaml the run's Prefect deployments: the loop on its cron, stages on work pools
                                          (a fleet file: every expert's, writing one store)
autoevolve serve                          the registry's experts behind an OpenAI-compatible server, with the router
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from autoevolve import cli_serve
from autoevolve.cli_common import DEFAULT_STORE, CommandError, positive, refusing, store_file, tier
from autoevolve.config import ConfigError, RunConfig, load_config
from autoevolve.envs import guard
from autoevolve.envs.guard import EnvironmentFault
from autoevolve.fleet.fleetfile import is_fleet_file, load_fleet
from autoevolve.store.postgres import is_url

LIBRARY_LOGGERS = ("py.warnings", "autoevolve", "transformers", "trl", "peft", "datasets", "accelerate", "httpx")


def _log_to(path: Path, verbose: bool) -> None:
    """Library warnings and log lines (each training step's row among them) go to the run's log file, and Prefect's
    own lines stay off the terminal: one screen shows the run's progress and results. With ``verbose`` they show on
    the terminal too (a deployed run logs all to Prefect)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.captureWarnings(True)
    for name in LIBRARY_LOGGERS:  # the narration logger prints on its own and is left alone
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:  # an earlier run's
            logger.removeHandler(old)
            old.close()
        logger.addHandler(handler)
        logger.propagate = False
        if verbose and not any(type(h) is logging.StreamHandler for h in logger.handlers):
            logger.addHandler(logging.StreamHandler(sys.stderr))
    logging.getLogger("autoevolve.training").setLevel(logging.INFO)
    from transformers.utils import logging as hf_logging  # its own stderr handler, added when it is first imported

    if not verbose:
        hf_logging.disable_default_handler()
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")  # read when the flows import Prefect


def _version() -> str:
    """The installed package's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autoevolve")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


@contextmanager
def _kept_only_if_done(path: str | Path) -> Iterator[None]:
    """A store this command creates is removed again if the command is refused (its input was wrong, exit 2):
    a refused command leaves nothing behind. What a failing endpoint or an interrupt leaves is work done: it stays."""
    new = not is_url(path) and not Path(path).exists()  # a database is never removed
    try:
        yield
    except CommandError as exc:
        if new and exc.code == 2:
            for leftover in (Path(path), Path(f"{path}.wal")):
                leftover.unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for a bad config, with one line on stderr)."""
    parser = argparse.ArgumentParser(prog="autoevolve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"autoevolve {_version()}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="also show library warnings and Prefect's own log lines"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    verbose = argparse.ArgumentParser(add_help=False)  # -v after the command too ('autoevolve run -v x.yaml')
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    run = sub.add_parser(
        "run", help="run a config's self-evolution rounds (or resume them)", description=_RUN_HELP, parents=[verbose]
    )
    run.add_argument("config", help="run config YAML, e.g. configs/quickstart.yaml")
    run.add_argument(
        "--auto-approve", action="store_true", help="promote without pausing for approval (registry.approval)"
    )
    check = sub.add_parser(
        "check", help="validate a run config and its HCP file, and run the environment with no model",
        description=_CHECK_HELP, parents=[verbose],
    )  # fmt: skip
    check.add_argument("config", help="run config YAML")
    ev = sub.add_parser(
        "eval", help="score an adapter/config pair on an environment's tasks", description=_EVAL_HELP, parents=[verbose]
    )
    ev.add_argument("config", help="run config YAML: its store, model, expert, environment and original HCP")
    ev.add_argument("--adapter", help="NAME@V, an adapter folder, or 'base' (default: the expert's live version)")
    ev.add_argument("--hcp", default="seed", help="'seed' (default), 'best', a stored HCP id (prefix) or a YAML file")
    ev.add_argument("--split", default="test", choices=["train", "dev", "test"], help="task split (default test)")
    ev.add_argument("--tasks", type=positive, help="the split's first N tasks (default: gate.test_tasks)")
    ev.add_argument("--env", help="another environment: a name, 'module:factory', or '{name: life, tiers: [2]}'")
    ev.add_argument("--run-id", help="run id the rollouts are stored under (default: RUN-eval)")
    ev.add_argument("--out", help="where eval.json goes (default: RUN_DIR/RUN/eval.json)")
    ev.add_argument("--show", type=positive, metavar="K", help="print K failed tasks: feedback and last messages")
    cands = sub.add_parser("candidates", help="list a run's stage-1 candidates with lineage and scores")
    cands.add_argument("run", help="run id (a run config's run_id, or its file stem)")
    cands.add_argument("--round", type=int, default=None, help="only this round")
    cands.add_argument("--store", default=DEFAULT_STORE, help=f"DuckDB store (default {DEFAULT_STORE})")
    dif = sub.add_parser("diff", help="diff two HCP configs of a run, component by component")
    dif.add_argument("run", help="run id")
    dif.add_argument("a", help="'seed', 'best', or an HCP id (a unique prefix is enough)")
    dif.add_argument("b", help="'seed', 'best', or an HCP id")
    dif.add_argument("--store", default=DEFAULT_STORE, help=f"DuckDB store (default {DEFAULT_STORE})")
    sels = sub.add_parser("selections", help="list a run's stage-2 selections: items, tasks, preference pairs")
    sels.add_argument("run", help="run id")
    sels.add_argument("--items", action="store_true", help="one line per kept rollout and the baseline it beat")
    sels.add_argument("--store", default=DEFAULT_STORE, help=f"DuckDB store (default {DEFAULT_STORE})")
    ins = sub.add_parser("inspect", help="a run at a glance: counts, rounds, the last round's test 2x2")
    ins.add_argument("run", help="run id")
    ins.add_argument(
        "--failures", type=positive, metavar="K", help="print K failed test tasks of the last round's served expert"
    )
    ins.add_argument("--store", default=DEFAULT_STORE, help=f"DuckDB store (default {DEFAULT_STORE})")
    exp = sub.add_parser("export", help="write a run's tables as Parquet, one folder per table, partitioned by round")
    exp.add_argument("run", help="run id")
    exp.add_argument("dir", help="output folder (one per run: trajectories/, candidates/, ... go inside)")
    exp.add_argument("--store", default=DEFAULT_STORE, help=f"DuckDB store (default {DEFAULT_STORE})")
    _registry_parser(sub)
    dep = sub.add_parser("deploy", help="create or update the run's Prefect deployments", description=_DEPLOY_HELP)
    dep.add_argument(
        "config",
        help="run config YAML (its deploy: section has the cron, work pools and GPU job), or a fleet file "
        "(experts: a list of run configs and schedules, training_limit: distillations at once)",
    )
    dep.add_argument("--dry-run", action="store_true", help="print the deployments; contact no Prefect server")
    cli_serve.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return _command(args)
    except CommandError as exc:
        print(f"autoevolve: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _command(args: argparse.Namespace) -> int:
    """Run the parsed command; a CommandError says what was refused."""
    if args.command == "registry":
        return _registry(args)
    if args.command == "serve":
        return cli_serve.serve(args)
    if args.command in ("candidates", "diff", "selections", "inspect", "export"):
        return _read(args)
    if args.command == "deploy" and is_fleet_file(args.config):
        return _deploy_fleet(args.config, args.dry_run)
    with refusing(ConfigError, prefix="config error: "):
        config = load_config(args.config)
    with refusing(ValueError, prefix="env error: "):  # a broken task file stops here, before any model loads
        tasks, notes = _load_tasks(config)
    if args.command == "check":
        with refusing(EnvironmentFault):  # the environment run with no model: references, an unknown call
            probed = guard.probe(config.env.make())
        print(f"{args.config}: ok (run {config.run_id}, original HCP {config.original_hcp().id}, {tasks}; {probed})")
        for note in notes:  # what the environment skipped, and why
            print(f"  {note}")
        return 0
    if args.command == "deploy":
        return _deploy(config, args.config, args.dry_run)
    if args.command == "eval":
        _log_to(Path(config.run_dir) / str(config.run_id) / "run.log", args.verbose)
        return _eval(config, args)
    if args.auto_approve:
        config.registry.approval = False
    _log_to(Path(config.run_dir) / str(config.run_id) / "run.log", args.verbose)
    return _run(config)


_RUN_HELP = (
    "Run the config's rounds (1 unless it sets rounds: N), each: prompt evolution on train tasks, selection of "
    "the rollouts the best config unlocked, LoRA distillation under the original config, the dev gate, and the "
    "2x2 report on test tasks. Writes report.json (the last round) and rounds.json under run_dir/run_id."
)


_CHECK_HELP = (
    "Validate the run config and the HCP file it names, list the environment's tasks, and run it with no model: "
    "for the first tasks of each split, each reference through a real episode (it must score 1.0) and a reply with "
    "no call (its score must be a number in [0, 1]). Nothing is stored and no model loads. An environment whose own "
    "code raises is one line naming the method and the task."
)


_EVAL_HELP = (
    "Roll out an adapter under an HCP config on an environment's tasks, store the rollouts (run RUN-eval), print "
    "the mean reward with its 95% bootstrap interval and per tier, and write eval.json. With the defaults (the "
    "live adapter, the original config, the first gate.test_tasks test tasks) it scores what the round reported "
    "as new_original (the new adapter A_r+1 under the original config)."
)


_DEPLOY_HELP = (
    "Create or update, on the Prefect server PREFECT_API_URL names, the loop on the config's cron "
    "(autoevolve-evolution/RUN, CPU pool), the rollout stages (autoevolve-STAGE/cpu) and distillation "
    "(autoevolve-distill/gpu, GPU pool). Flow runs start in $AUTOEVOLVE_HOME (default: this folder), which must be "
    "the same path on every worker. The work pools must exist."
)


def _read(args: argparse.Namespace) -> int:
    """Print what a run left (ledger, diff, selections, overview) or export it, from a snapshot of the store.

    Exit 2 with one line when the store, the run or a config is unknown, or the store cannot be read.
    """
    from autoevolve.store import Store, StoreError
    from autoevolve.views.inspection import format_inspect, served_rollouts
    from autoevolve.views.lineage import (
        LineageError,
        config_diff,
        format_candidates,
        format_selections,
        run_candidates,
        run_selections,
    )
    from autoevolve.views.scorecard import format_failures

    store_file(args.store)
    with refusing(KeyError, LineageError, StoreError), Store.snapshot(args.store) as store:
        if args.command == "candidates":
            print(format_candidates(run_candidates(store, args.run, args.round)))
        elif args.command == "selections":
            print(format_selections(run_selections(store, args.run), items=args.items))
        elif args.command == "diff":
            print(config_diff(store, args.run, args.a, args.b))
        elif args.command == "inspect":
            print(format_inspect(store, args.run))
            if args.failures:
                print("\n" + format_failures(served_rollouts(store, args.run), args.failures))
        else:
            for table, rows in store.export_run(args.run, args.dir).items():
                print(f"{table}: {rows} rows -> {Path(args.dir) / table}")
    return 0


def _registry_parser(sub: argparse._SubParsersAction) -> None:
    """The ``registry`` command and its actions."""
    reg = sub.add_parser("registry", help="the adapter registry: experts, versions, the live one")
    reg.add_argument("--store", default=DEFAULT_STORE, help=f"DuckDB store (default {DEFAULT_STORE})")
    act = reg.add_subparsers(dest="action", required=True)
    lst = act.add_parser("list", help="every expert with its live version")
    show = act.add_parser("show", help="an expert's versions and history")
    show.add_argument("name")
    pro = act.add_parser("promote", help="make a version the expert's live one")
    pro.add_argument("name")
    pro.add_argument("version", type=int)
    pro.add_argument("--reason", default="promoted by hand")
    back = act.add_parser("rollback", help="put back the version live before the current one")
    back.add_argument("name")
    back.add_argument("--reason", default="rolled back by hand")
    for p in (pro, back):
        p.add_argument("--config", help="run config whose registry.hooks to fire (default: fire none)")
    add = act.add_parser("add-expert", help="register an expert (metadata only) or update its tier and rule")
    add.add_argument("name", help="e.g. L2-code (letters, digits, '.', '_', '-')")
    add.add_argument("--base-model", required=True, help="base model id every version must be trained on")
    add.add_argument("--tier", type=tier, default=1, help="0: the entry expert; 1+: experts it routes to")
    add.add_argument("--rule", default="", help="routing rule: one sentence saying when to hand a turn here")
    for p in (lst, show, pro, back, add):  # --store before or after the action: both read the same
        p.add_argument("--store", default=argparse.SUPPRESS, help=f"DuckDB store (default {DEFAULT_STORE})")


def _registry(args: argparse.Namespace) -> int:
    """Run a registry action; exit 2 with one line for an unknown expert or version, a refused adapter, a busy store."""
    from autoevolve.fleet import registry
    from autoevolve.store import StoreError

    if args.action != "add-expert":  # only registering an expert may create a store
        store_file(args.store)
    with _kept_only_if_done(args.store), refusing(registry.PromotionRolledBack, code=1):
        with refusing(KeyError, ValueError, StoreError), _open_for(args.action, args.store) as store:
            if args.action == "list":
                print(registry.format_experts(store))
            elif args.action == "show":
                print(registry.format_expert(store, args.name))
            elif args.action == "promote":
                adapter = registry.promote(store, args.name, args.version, args.reason, _publisher(args.config))
                print(f"{adapter.ref} is live")
            elif args.action == "rollback":
                adapter = registry.rollback(store, args.name, args.reason, _publisher(args.config))
                print(f"{adapter.ref if adapter else 'the bare base model'} is live for {args.name}")
            else:
                e = registry.add_expert(store, args.name, args.base_model, args.tier, args.rule)
                print(f"expert {e.name} registered (tier {e.tier}, base {e.base_model})")
    return 0


def _open_for(action: str, path: str):  # noqa: ANN202 - the store module is imported lazily
    """The store a registry action reads (a snapshot) or writes."""
    from autoevolve.store import Store

    return Store.snapshot(path) if action in ("list", "show") else Store(path)


def _load_tasks(config: RunConfig) -> tuple[str, list[str]]:
    """The run's environment and its splits' sizes in one line, and what it skipped and why (an environment's
    optional ``notes()``) (ValueError naming the file and line of bad data)."""
    env = config.env.make()
    sizes = {split: len(env.tasks(split)) for split in ("train", "dev", "test")}
    line = f"env {env.name}: " + ", ".join(f"{n} {split}" for split, n in sizes.items()) + " tasks"
    return line, env.notes() if callable(getattr(env, "notes", None)) else []


def _publisher(config_path: str | None):  # noqa: ANN202 - registry is imported lazily
    """The hooks of a run config's registry section (none without a config)."""
    from autoevolve.fleet.registry import Publisher

    return Publisher.from_settings(load_config(config_path).registry) if config_path else None


def _run(config: RunConfig) -> int:
    """Run the round flow (imported here: the library itself never imports Prefect; importing flows sets the
    offline environment)."""
    from autoevolve.harness.workbench import EndpointDown
    from autoevolve.loop import check_run
    from autoevolve.store import Store, StoreError
    from autoevolve_flows.loop_flow import loop_flow

    # A store this code cannot write, or a run recorded otherwise, stops here before any model loads.
    with refusing(StoreError, ConfigError), Store(config.store) as store:
        check_run(store, config)
    with refusing(EnvironmentFault), refusing(EndpointDown, code=1):  # 1: the endpoint's fault, not the input's
        loop_flow(config)
    return 0


def _eval(config: RunConfig, args: argparse.Namespace) -> int:
    """Score one adapter/config pair (imported here: the model loads only for this command)."""
    from autoevolve.envs.loading import EnvLoadError
    from autoevolve.harness.workbench import EndpointDown, Workbench
    from autoevolve.loop import make_policy
    from autoevolve.store import Store, StoreError
    from autoevolve.views.scorecard import (
        env_settings,
        evaluate_pair,
        format_eval,
        format_failures,
        pick_adapter,
        pick_hcp,
        write_eval,
    )

    run_id = args.run_id or f"{config.run_id}-eval"
    with _kept_only_if_done(config.store), refusing(EndpointDown, code=1):
        with refusing(ConfigError, EnvLoadError, StoreError, EnvironmentFault), Store(config.store) as store:
            settings = env_settings(config, args.env)
            env = settings.make()
            hcp = pick_hcp(store, config, env.tools(), args.hcp)
            adapter, folder = pick_adapter(store, config, args.adapter)
            policy = make_policy(config)
            if folder is not None:
                policy.add_adapter(adapter, folder)
            store.put_run(run_id, {"eval_of": config.run_id, "env": settings.model_dump(mode="json")})
            bench = Workbench(policy, env, store, run_id, seed=config.seed, endpoint_stop=config.model.endpoint_stop)
            result = evaluate_pair(bench, hcp, adapter, args.split, args.tasks or config.gate.test_tasks)
    out = Path(args.out) if args.out else Path(config.run_dir) / str(config.run_id) / "eval.json"
    print(format_eval(result))
    if args.show:
        print("\n" + format_failures(result["trajectories"], args.show))
    print(f"wrote {write_eval(result, out)}")
    return 0


def _deploy(config: RunConfig, path: str, dry_run: bool) -> int:
    """Create or update the run's deployments (imported here: the library itself never imports Prefect)."""
    from autoevolve_flows.deploy import DeployError, apply_deployments

    with refusing(DeployError):
        print("\n".join(apply_deployments(config, path, dry_run)))
    return 0


def _deploy_fleet(path: str, dry_run: bool) -> int:
    """Create or update every expert's deployments of a fleet file, and the training limit."""
    from autoevolve_flows.deploy import DeployError, apply_fleet

    with refusing(ConfigError, prefix="config error: "):
        fleet, configs = load_fleet(path)
    with refusing(DeployError):
        print("\n".join(apply_fleet(fleet, configs, dry_run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
