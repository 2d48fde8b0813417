"""The multi-turn breakdown by turn (benchmarks/routing_by_turn.py) on hand-made results."""

import pytest

from benchmarks.routing_by_turn import contributions, report, ttft_by_turn

# Two policies, same requests: turns 0, 1, 2, 5 (5 joins the "3+" group) and a failed one.
MINE = {"ttfts": [0.1, 0.3, 0.5, 0.9, 0.0], "turn_indices": [0, 1, 2, 5, 0]}
OTHER = {"ttfts": [0.2, 0.3, 0.4, 0.5, 0.0], "turn_indices": [0, 1, 2, 5, 0]}


def test_groups_by_turn_with_the_later_turns_together_and_failures_left_out():
    assert ttft_by_turn(MINE) == {0: [100.0], 1: [300.0], 2: [500.0], 3: [900.0]}
    assert ttft_by_turn(MINE, last_group=1) == {0: [100.0], 1: [300.0, 500.0, 900.0]}


def test_the_groups_parts_add_up_to_the_difference_of_the_means():
    parts = contributions(ttft_by_turn(MINE), ttft_by_turn(OTHER))
    assert parts == pytest.approx({0: -25.0, 1: 0.0, 2: 25.0, 3: 100.0})
    # mean 450 ms against 350 ms
    assert sum(parts.values()) == pytest.approx(100.0)


def test_report_names_every_policy_and_the_parts_against_the_reference():
    text = report({"policies": {"mine": MINE, "other": OTHER}}, against="other")
    assert "turn 3+" in text and "against other" in text
    assert text.splitlines()[-1].split()[:2] == ["mine", "+100"]
