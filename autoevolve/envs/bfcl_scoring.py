"""BFCL's rules for single-turn questions, apart from the episode that applies them: categories, accepted values,
and the order-insensitive matching of calls to expected calls.

The rules follow BFCL's checker (``bfcl_eval/eval_checker/ast_eval/ast_checker.py`` and ``bfcl_eval/utils.py`` in
ShishirPatil/gorilla): a question's category is its id up to the last ``_``; a category naming ``parallel`` is
scored order-insensitively and needs exactly as many calls as the ground truth (else "wrong count"), each expected
call matched by a distinct call whose name and every argument are accepted.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

OPTIONAL = ""  # BFCL's accepted value for "this parameter may be omitted"
NO_TRUTH = "no ground truth in the line or the answers file"
NO_TRUTH_RELEVANCE = "no ground truth (BFCL's irrelevance and relevance categories: the right reply is no call)"
MULTI_TURN = "multi-turn question (BFCL scores it by executing each turn's calls, which this environment does not)"
AGENTIC = "agentic question (BFCL's memory and web-search categories score the final answer, not calls)"

Check = tuple[bool, str]  # one condition of a call: met, and the sentence that says why not


def category_of(bfcl_id: str) -> str:
    """BFCL's category of a question id ('parallel_multiple_12' -> 'parallel_multiple', 'live_simple_0-0-0' ->
    'live_simple'); '' for an id with no '_'. As BFCL does, a format-sensitivity id is read up to its first ':'."""
    head, sep, _ = bfcl_id.split(":")[0].rpartition("_")
    return head if sep else ""


def is_parallel(category: str) -> bool:
    """Whether BFCL scores a category's replies as parallel calls (its checker tests ``'parallel' in category``)."""
    return "parallel" in category


def skip_reason(category: str, line: dict[str, Any]) -> str | None:
    """Why a question of this category cannot be scored by matching calls (None: it can), before any checking."""
    if "multi_turn" in category or "initial_config" in line:
        return MULTI_TURN
    if "memory" in category or "web_search" in category:
        return AGENTIC
    return None


def no_truth_reason(category: str) -> str:
    """Why a question without ground truth is skipped: the relevance categories have none by design."""
    return NO_TRUTH_RELEVANCE if "relevance" in category else NO_TRUTH  # 'irrelevance' contains 'relevance'


def matches(got: Any, want: Any) -> bool:
    """BFCL equality: numbers numerically, strings case-insensitively and stripped, lists and dicts element-wise.

    A dict in an answer holds accepted values per key, as BFCL writes them ({'min': [300, 300.0], 'note': ['']}).
    """
    if isinstance(got, bool) or isinstance(want, bool):
        return isinstance(got, bool) and isinstance(want, bool) and got == want  # True is not 1
    if isinstance(got, int | float) and isinstance(want, int | float):
        return float(got) == float(want)
    if isinstance(got, str) and isinstance(want, str):
        return got.strip().casefold() == want.strip().casefold()
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(matches(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(got, dict) and isinstance(want, dict):
        if set(got) - set(want):
            return False
        return all(accepts(got, key, _options(options)) for key, options in want.items())
    return got == want


def accepts(arguments: dict[str, Any], key: str, options: list[Any]) -> bool:
    """Whether an argument (or its absence) is one of the accepted values."""
    if key not in arguments:
        return OPTIONAL in options or not options  # a few BFCL answers accept [] (nothing): only omission can pass
    return any(matches(arguments[key], option) for option in options)


def _options(value: Any) -> list[Any]:
    """Accepted values of a dict-answer key: BFCL lists them; a bare value is the only one."""
    return value if isinstance(value, list) else [value]


def concrete(value: Any) -> Any:
    """A plain value from an accepted one: in nested dicts, each key's first non-optional option."""
    if isinstance(value, dict):
        picked = {k: _first(_options(v)) for k, v in value.items()}
        return {k: concrete(v) for k, v in picked.items() if v is not _OMIT}
    if isinstance(value, list):
        return [concrete(v) for v in value]
    return value


_OMIT = object()


def _first(options: list[Any]) -> Any:
    """The first accepted value that is not the omit mark, or _OMIT when omitting is the only option."""
    return next((o for o in options if not (isinstance(o, str) and o == OPTIONAL)), _OMIT)


def reference_arguments(params: dict[str, list[Any]]) -> dict[str, Any]:
    """The canonical arguments of an expected call: the first accepted non-empty value per parameter."""
    picked = {p: _first(options) for p, options in params.items()}
    return {p: concrete(v) for p, v in picked.items() if v is not _OMIT}


def signature(tool: str, params: dict[str, list[Any]]) -> str:
    """'calculate_triangle_area(base=10, height=5)': an expected call written out, for feedback."""
    args = ", ".join(f"{k}={json.dumps(v)}" for k, v in reference_arguments(params).items())
    return f"{tool}({args})"


def shown(options: list[Any]) -> str:
    """'one of [10, 10.0]', 'one of [5] or omitted', 'nothing (omit it)'."""
    values = [o for o in options if not (isinstance(o, str) and o == OPTIONAL)]
    if not values:
        return "nothing (omit it)"
    return f"one of {json.dumps(values)}" + (" or omitted" if len(values) < len(options) else "")


def assign(table: list[list[list[Check]]], missing: list[list[Check]]) -> list[int | None]:
    """For each expected call, the recorded call to score it against (None: none), in the best-scoring assignment.

    BFCL accepts parallel calls in any order, so the matching maximises checks met minus checks failed. It is a
    full search, not BFCL's first-fit: where one call fits two expected calls, it still finds the pairing that
    matches every expected call when there is one.
    """

    def value(checks: list[Check]) -> int:
        """Checks met minus checks failed."""
        return sum(1 if ok else -1 for ok, _ in checks)

    # Matching a call also spares it the failed check of an unexpected call, hence the +1.
    gains = [[value(checks) + 1 for checks in row] for row in table]

    n_calls = len(table[0]) if table else 0

    @cache
    def best(i: int, used: int) -> tuple[int, tuple[int | None, ...]]:
        """Best value and picks for expected calls i.. when the calls in the bit mask `used` are taken."""
        if i == len(table):
            return 0, ()
        rest, picks = best(i + 1, used)
        top = (value(missing[i]) + rest, (None, *picks))
        for j in range(n_calls):
            if not used & (1 << j):
                rest, picks = best(i + 1, used | (1 << j))
                top = max(top, (gains[i][j] + rest, (j, *picks)), key=lambda t: t[0])
        return top

    return list(best(0, 0)[1])
