"""Environments: tasks, tools and a fixed scorer. The scorer never evolves with the harness.

The protocol an environment follows is in ``environment``; finding, building and namespacing one in ``loading``.
"""

from autoevolve.envs.environment import Environment, Episode
from autoevolve.envs.loading import SPLITS, Namespaced, build_env, make_env, namespaced

__all__ = ["SPLITS", "Environment", "Episode", "Namespaced", "build_env", "make_env", "namespaced"]
