"""Stage 1, prompt evolution: a Pareto search over HCP configs around the frozen weights (``search``), the mutator
protocol (``proposal``), the mutators (``mutators``, ``reflect``), the frontier (``pareto``), budgets (``budget``)."""

from autoevolve.stages.evolve.search import MUTATORS, EvolveResult, evolve, make_mutators

__all__ = ["MUTATORS", "EvolveResult", "evolve", "make_mutators"]
