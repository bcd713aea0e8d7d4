"""The Prefect flows: the loop, a round, one flow per stage, and the deployments (installed as ``autoevolve_flows``).

Importing the package sets what an offline run needs, for every entry point (``autoevolve``, ``python -m
autoevolve_flows.stage_flows``, the bench scripts), each only where the user has not set it: no telemetry from
Prefect's temporary server (offline it logs an error on every start), no Hugging Face hub lookups, no tokenizer fork
warnings. The library's
``autoevolve.*`` loggers, narration included, also reach the logs of the flow or task run they log in, so a deployed
run's logs hold what a terminal run prints.
"""

import logging
import os

for _name, _value in (
    ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
    ("HF_HUB_OFFLINE", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
):
    os.environ.setdefault(_name, _value)

from prefect.context import FlowRunContext, TaskRunContext  # noqa: E402 - after the settings above
from prefect.logging.handlers import APILogHandler  # noqa: E402

from autoevolve.views import narration  # noqa: E402


class RunLogHandler(APILogHandler):
    """Prefect's API log handler for the library's loggers, inside a flow or task run only (outside one, a
    library record has no run to belong to; the terminal shows it as any Python log record)."""

    def emit(self, record: logging.LogRecord) -> None:
        if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
            super().emit(record)


_library = logging.getLogger("autoevolve")
for _logger in (_library, narration.log):  # narration does not propagate: it prints once, on its own
    if not any(isinstance(h, RunLogHandler) for h in _logger.handlers):
        _logger.addHandler(RunLogHandler())
if _library.level == logging.NOTSET:
    _library.setLevel(logging.INFO)
