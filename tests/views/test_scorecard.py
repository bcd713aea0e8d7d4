"""Failures you can read: the failed rollouts with their feedback and last messages, and what to say when none."""

from __future__ import annotations

from autoevolve.records import Message, Trajectory
from autoevolve.views.scorecard import format_failures


def _rollout(task: str, reward: float, feedback: str = "", error: str = "") -> Trajectory:
    messages = [Message(role="user", content=f"do {task}"), Message(role="assistant", content=f"did {task}")]
    return Trajectory(run_id="r", task_id=task, split="test", hcp_id="h", messages=messages, reward=reward,
                      feedback=feedback, error=error)  # fmt: skip


def test_failed_rollouts_show_why_and_the_last_messages_and_how_many_more() -> None:
    trajs = [_rollout("a", 1.0), _rollout("b", 0.5, feedback="booked the wrong day"), _rollout("c", 0.0, error="x")]
    shown = format_failures(trajs, 1)
    assert shown.startswith("b (reward 0.50, 1 model turns)\n  why: booked the wrong day\n  last messages:")
    assert "    assistant: did b" in shown and shown.endswith("(1 more failed)")


def test_no_rollouts_is_not_said_to_be_all_solved() -> None:
    assert format_failures([], 3) == "no rollouts to show: nothing was scored on test yet"
    assert format_failures([_rollout("a", 1.0)], 3) == "no failed rollout to show: every task reached a full reward"
