"""``autoevolve serve``: the Mixture of LoRA behind an OpenAI-compatible server: the served names, the worker and the
router (``fleet``), the routes (``app``), the wire models (``wire``), harnessed calls (``calls``) and starting from a
registry (``startup``)."""

from autoevolve.fleet.serving.fleet import ROUTER, Fleet, Slot

__all__ = ["ROUTER", "Fleet", "Slot"]
