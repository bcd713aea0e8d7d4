"""A round's report as Markdown and table rows, for dashboards (the round flow publishes them as Prefect artifacts).

Plain text from report.json's dict: the test 2x2 with intervals (its rows, labels and numbers from
``autoevolve.views.twobytwo``), retention, the dev gate's decision and reason, and how the best config differs from the
original. No Prefect here; ``flows/round.py`` does the publishing.
"""

from __future__ import annotations

import re
from typing import Any

from autoevolve.records import GRAMMAR, renamed_cells
from autoevolve.views.twobytwo import interval, rows, score


def round_markdown(report: dict[str, Any], diff: str) -> str:
    """The round at a glance: decision, test 2x2 with 95% intervals, retention, stage 1, the best config's diff.
    A report written with the older cell names (base_*, adapter_*) reads under today's."""
    report = renamed_cells(report)
    head = f"# autoevolve run `{report['run_id']}`, round {report['round']}"
    parts = [head, _decision(report)]
    if "eval" in report:
        parts += [_table(report), _gains(report)]
    parts += [_search(report), _diff(diff)]
    return "\n\n".join(parts) + "\n"


def candidate_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per stage-1 candidate with scalar cells (lists joined), as a table artifact wants them."""
    rows = []
    for c in report["candidates"]:
        rows.append(
            {
                "hcp_id": c["hcp_id"],
                "parents": ",".join(c["parents"]) or "-",
                "mutator": c["mutator"],
                "components": ",".join(c["components"]) or "-",
                "status": c["status"],
                "dev_mean": None if c["dev_mean"] is None else round(c["dev_mean"], 4),
                "best": c["hcp_id"] == report["hcp"]["evolved"],
                "note": c["note"],
            }
        )
    return rows


def _decision(report: dict[str, Any]) -> str:
    """The gate's decision and reason, or why there was nothing to gate."""
    if "gate" not in report:
        return (
            f"**Nothing selected**: no rollout of an evolved config beat the original on a train task "
            f"({report['selected']} kept), so nothing was distilled and the live adapter is unchanged."
        )
    g = report["gate"]
    live = "now live" if report["promoted"] else "not live"
    lines = [f"**Gate (dev, {g['n_tasks']} tasks): {g['decision']}** — {g['reason']}"]
    lines.append(f"Adapter `{report['adapter']}` is {live}.")
    if g.get("guard"):
        x = g["guard"]
        lines.append(
            f"Guard ({x['env']}, {x['n']} tasks): {x['base']:.3f} -> {x['candidate']:.3f}, "
            f"drop {x['drop']:+.3f}, tolerance {x['tolerance']:.3f}."
        )
    return "\n\n".join(lines)


def _table(report: dict[str, Any]) -> str:
    """The held-out 2x2: mean reward and bootstrap 95% interval per (adapter, config) cell."""
    means = report["eval"]
    head, *body = rows(means, report["eval_ci"], {"live": report.get("live_adapter"), "new": report["adapter"]})
    lines = [f"## Held-out test ({means['n_tasks']} tasks): mean reward [95% CI]", ""]
    lines += [f"| {' | '.join(row)} |" for row in (head, ["---"] * len(head), *body)]
    return "\n".join(lines)


def _gains(report: dict[str, Any]) -> str:
    """Gain of the new adapter under the original config, retention, and what the evolved prompt costs."""
    gain, kept, tokens = report["gain"], report["retention"], report["prompt_tokens"]
    lines = [
        f"- gain of A_r+1 over A_r, original config: test {gain['test']:+.3f} {interval(gain['test_ci'], True)}, "
        f"dev {gain['dev']:+.3f} {interval(gain['dev_ci'], True)}",
        f"- retention (share of the evolved config's gain kept with the original config): "
        f"test {_share(kept['test'])}, dev {_share(kept['dev'])}",
        f"- prompt tokens of the first call: original {tokens['original']:.0f}, evolved {tokens['evolved']:.0f}",
    ]
    if report.get("grammar"):
        g = report["grammar"]
        lines.append(
            f"- the tool-call grammar alone (A_r, original config): test {score(g[GRAMMAR])} {interval(g['ci'])}; "
            f"grammar retention (share of its gain the new adapter keeps without it): {_share(g['retention'])}"
        )
    return "\n".join(lines)


def _search(report: dict[str, Any]) -> str:
    """Stage 1 and 2 in numbers."""
    e = report["evolve"]
    failed = f" ({report['failed_rollouts']} failed at the endpoint)" if report.get("failed_rollouts") else ""
    return "\n".join(
        [
            "## Search",
            "",
            f"- dev mean: original {e['dev_original']:.3f} -> best {e['dev_best']:.3f} "
            f"(`{report['hcp']['evolved']}`, {len(report['candidates'])} candidates)",
            f"- kept for distillation: {report['selected']} rollouts; "
            f"rollouts this round: {report['rollouts']}{failed}",
        ]
    )


def _diff(diff: str) -> str:
    """The best config's per-component diff against the original, fenced so its own backticks cannot end it."""
    if not diff.strip():
        return "## Best config vs the original\n\nThe best config is the original: no evolved config beat it on dev."
    longest = max((len(run) for run in re.findall(r"`+", diff)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"## Best config vs the original\n\n{fence}diff\n{diff}\n{fence}"


def _share(value: float | None) -> str:
    """A retention share, or '-' when the evolved config gained nothing."""
    return "-" if value is None else f"{value:.2f}"
