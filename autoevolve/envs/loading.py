"""Finding and building environments: registered names, ``module:factory`` loaders, arguments checked by signature.

A name is looked up in the ``autoevolve.environments`` entry-point group (the built-ins register there too, in
``pyproject.toml``), so an installed package adds ``env: {name: my-env}`` by declaring one entry point. A loader
is ``package.module:factory`` (an importable module) or ``path/to/file.py:factory`` (a local file). A factory is
any callable that returns an Environment: a class, or a function. Its own signature says which arguments it takes.
A built environment whose task ids do not start with its name is served under 'name/id' ids (``namespaced``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from autoevolve.envs.environment import Environment, Episode
from autoevolve.records import Message, Split, Task

GROUP = "autoevolve.environments"


class EnvLoadError(ValueError):
    """An environment that cannot be found or built from its settings; the message is one line with the fix."""


def registered() -> dict[str, Any]:
    """The environment names installed packages declare, with their entry points."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def factory_of(name: str | None = None, loader: str | None = None) -> Callable[..., Any]:
    """The factory a loader path or a registered name points to (EnvLoadError saying what is wrong)."""
    if loader is not None:
        try:
            return load_object(loader)
        except EnvLoadError as exc:
            raise EnvLoadError(f"env.loader: {exc}") from None
    known = registered()
    if name not in known:
        names = ", ".join(sorted(known)) or "none: is autoevolve installed (pip install -e .)?"
        raise EnvLoadError(
            f"env.name: unknown environment {name!r} (registered: {names}); give env.loader: 'module:factory' "
            "for your own"
        )
    try:
        return known[name].load()
    except (ImportError, AttributeError) as exc:
        raise EnvLoadError(
            f"env.name: environment {name!r}: its entry point {known[name].value} does not load: {exc}"
        ) from None


def load_object(spec: str) -> Any:
    """The object ``module:attr`` or ``file.py:attr`` names (attr may be dotted)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise EnvLoadError(f"loader {spec!r}: expected 'package.module:factory' or 'path/to/file.py:factory'")
    if where.endswith(".py"):
        module = _module_from_file(Path(where), spec)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise EnvLoadError(f"loader {spec!r}: cannot import {where}: {exc}") from None
    found: Any = module
    for part in attr.split("."):
        if not hasattr(found, part):
            raise EnvLoadError(f"loader {spec!r}: {where} has no {attr!r}")
        found = getattr(found, part)
    if not callable(found):
        raise EnvLoadError(f"loader {spec!r}: {attr} is not callable")
    return found


def _module_from_file(path: Path, spec: str) -> Any:
    """Import a local Python file once, under a name derived from its resolved path."""
    if not path.is_file():
        raise EnvLoadError(f"loader {spec!r}: file {path} not found")
    resolved = path.resolve()
    name = f"autoevolve_local_{hashlib.sha256(str(resolved).encode()).hexdigest()[:12]}_{resolved.stem}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    if str(resolved.parent) not in sys.path:  # the file may import the modules beside it, as a script would
        sys.path.append(str(resolved.parent))
    sys.modules[name] = module  # before running it: dataclasses and pickling look modules up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise EnvLoadError(f"loader {spec!r}: {path} raised on import: {type(exc).__name__}: {exc}") from None
    return module


def arguments(factory: Callable[..., Any], args: dict[str, Any], common: dict[str, Any], explicit: set[str]) -> dict:
    """The keyword arguments to call ``factory`` with: every one of ``args`` (a name it does not take is an error),
    and those ``common`` settings it takes (one of ``explicit`` that it does not take is an error too)."""
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    label = getattr(factory, "__qualname__", repr(factory))
    out = {}
    for key, value in common.items():
        if takes_any or key in named:
            out[key] = value
        elif key in explicit:
            raise EnvLoadError(f"env.{key}: {label}() takes no {key!r} (it takes: {', '.join(named) or 'nothing'})")
    for key, value in args.items():
        if not takes_any and key not in named:
            raise EnvLoadError(
                f"env.args.{key}: {label}() takes no argument {key!r} (it takes: {', '.join(named) or 'nothing'})"
            )
        out[key] = value
    missing = [
        n
        for n, p in params.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in out
    ]
    if missing:
        raise EnvLoadError(f"env.args.{missing[0]}: {label}() needs it; add it under env.args")
    return out


def path_arguments(factory: Callable[..., Any]) -> set[str]:
    """The factory's parameters annotated as paths (resolved against the run config's folder like its hcp file)."""
    try:
        hints = inspect.signature(factory, eval_str=True).parameters
    except (NameError, TypeError):
        hints = inspect.signature(factory).parameters
    return {n for n, p in hints.items() if "Path" in str(p.annotation)}


def build(factory: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Call the factory; whatever it raises becomes an EnvLoadError naming it and the exception."""
    label = getattr(factory, "__qualname__", repr(factory))
    try:
        env = factory(**kwargs)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise EnvLoadError(f"env: {label}(): {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the factory's own bug, said in one line like any refusal
        raise EnvLoadError(f"env: {label}() raised {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    for attr in ("name", "tasks", "tools", "start", "reference"):
        if not hasattr(env, attr):
            raise EnvLoadError(
                f"env: {label}() returned {type(env).__name__}, which has no {attr!r} (see docs/environments.md)"
            )
    return env


def make_env(name: str = "life", *, loader: str | None = None, **args: Any) -> Environment:
    """Build an environment by registered name (or ``loader``: 'module:factory', 'file.py:factory'), passing
    ``args`` to its factory (a name the factory does not take raises EnvLoadError)."""
    return build_env(name, loader, args)


def build_env(
    name: str,
    loader: str | None,
    args: dict[str, Any],
    common: dict[str, Any] | None = None,
    explicit: frozenset[str] | set[str] = frozenset(),
) -> Environment:
    """Build an environment: ``args`` all go to its factory, ``common`` settings only where its signature takes them
    (one of ``explicit`` it does not take is an error); task ids are namespaced by the environment's name."""
    factory = factory_of(name, loader)
    env = build(factory, arguments(factory, args, common or {}, explicit))
    try:
        return namespaced(env)
    except EnvLoadError:
        raise
    except ValueError as exc:  # its tasks could not be listed (bad data, a malformed Task)
        raise EnvLoadError(f"env: {env.name}: listing its tasks failed: {' '.join(str(exc).split())}") from None
    except Exception as exc:  # noqa: BLE001 - the environment's own bug in tasks(), said in one line
        what = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise EnvLoadError(f"env {env.name}: tasks: {what}") from None


def namespaced(env: Environment) -> Environment:
    """The environment itself when its task ids start with its name ('life-1-00001'), else it under ids that do
    ('shop/17'): the store keys rollouts by task id, so two environments' ids must never collide."""
    ids = [t.id for split in SPLITS for t in env.tasks(split)]
    if len(set(ids)) < len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise EnvLoadError(f"env {env.name}: task id {twice!r} appears twice; ids must be unique across splits")
    if all(i.startswith((f"{env.name}-", f"{env.name}/")) for i in ids):
        return env
    return Namespaced(env)


class Namespaced:
    """An environment seen through task ids prefixed with its name; everything else is the environment's own."""

    def __init__(self, env: Environment) -> None:
        self.env, self.name = env, env.name

    def tasks(self, split: Split) -> list[Task]:
        """The environment's tasks under 'name/id' ids."""
        return [t.model_copy(update={"id": f"{self.name}/{t.id}", "env": self.name}) for t in self.env.tasks(split)]

    def tools(self) -> list[dict[str, Any]]:
        """The environment's tools."""
        return self.env.tools()

    def start(self, task: Task) -> Episode:
        """The environment's episode for the task under its own id."""
        return self.env.start(self._own(task))

    def reference(self, task: Task) -> list[Message] | None:
        """The environment's reference for the task under its own id."""
        return self.env.reference(self._own(task))

    def _own(self, task: Task) -> Task:
        """The task as the environment made it."""
        return task.model_copy(update={"id": task.id.removeprefix(f"{self.name}/")})

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.env, attr)  # optional extras (notes(), skipped, ...) stay reachable


SPLITS: tuple[Split, ...] = ("train", "dev", "test")
