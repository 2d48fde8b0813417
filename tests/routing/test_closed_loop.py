"""Little's law on closed-loop runs (benchmarks.routing_closed_loop)."""

from __future__ import annotations

import pytest

from benchmarks.routing_closed_loop import (
    REFERENCE,
    TableRow,
    closed_loop,
    implied_by_table,
    main,
    throughput_for_ttft,
)


def result(e2els: list[float], ttfts: list[float], outs: list[int], duration: float,
           errors: list[str] | None = None) -> dict:
    tpots = [(e - t) / (o - 1) for e, t, o in zip(e2els, ttfts, outs, strict=True)]
    return {"e2els": e2els, "ttfts": ttfts, "output_lens": outs, "duration": duration,
            "errors": errors or [""] * len(e2els), "mean_tpot_ms": 1000.0 * sum(tpots) / len(tpots)}


def test_a_stalled_short_answer_moves_the_per_request_mean_not_the_token_weighted_one():
    # Two answers decode at 50 ms per token; a third, 5 tokens long, stalls 2 s mid-answer.
    r = result(e2els=[0.1 + 99 * 0.05, 0.1 + 99 * 0.05, 0.1 + 4 * 0.05 + 2.0],
               ttfts=[0.1, 0.1, 0.1], outs=[100, 100, 5], duration=10.0)
    c = closed_loop(r)
    assert c.mean_tpot_ms == pytest.approx((50 + 50 + 550) / 3)
    assert c.token_tpot_ms == pytest.approx(1000.0 * (99 * 0.05 * 2 + 4 * 0.05 + 2.0) / 202)
    assert c.token_tpot_ms < 65 < 200 < c.mean_tpot_ms
    assert c.req_per_s == pytest.approx(0.3)
    assert c.in_system == pytest.approx(0.3 * c.mean_e2e_s)


def test_failed_requests_are_left_out():
    r = result(e2els=[5.0, 0.01], ttfts=[0.1, 0.01], outs=[50, 2], duration=10.0, errors=["", "boom"])
    c = closed_loop(r)
    assert c.req_per_s == pytest.approx(0.1)
    assert c.mean_e2e_s == pytest.approx(5.0)
    assert c.token_tpot_ms == pytest.approx(1000.0 * 4.9 / 49)


def test_a_lower_mean_ttft_at_the_same_decode_speed_needs_more_throughput():
    r = result(e2els=[10.5] * 4, ttfts=[0.5] * 4, outs=[201] * 4, duration=4.0)
    c = closed_loop(r)  # 1 req/s, 10.5 s each, 50 ms per token
    assert throughput_for_ttft(c, 500.0) == pytest.approx(c.req_per_s)
    # 0.4 s less TTFT out of 10.5 s: 4 % more requests per second.
    assert throughput_for_ttft(c, 100.0) == pytest.approx(c.in_system / 10.1)


def test_the_reference_table_implies_the_same_decode_speed_with_and_without_its_router():
    without = implied_by_table(REFERENCE["reference: without router"], concurrency=160)
    with_router = implied_by_table(REFERENCE["reference: with router"], concurrency=160)
    assert without.mean_output == pytest.approx(281, abs=1)
    assert without.mean_e2e_s == pytest.approx(160 / (10000 / 1138.4))
    # Per-request mean TPOT falls 42 %, decode time per token does not.
    assert with_router.mean_tpot_ms < 0.6 * without.mean_tpot_ms
    assert with_router.token_tpot_ms == pytest.approx(without.token_tpot_ms, rel=0.05)


def test_implied_token_tpot_is_what_the_e2e_leaves_after_the_ttft():
    row = TableRow(duration_s=100.0, num_requests=1000, output_tok_per_s=1010.0,
                   mean_ttft_ms=1000.0, mean_tpot_ms=80.0)
    c = implied_by_table(row, concurrency=10)  # 10 req/s -> 1 s each, all of it TTFT
    assert c.mean_e2e_s == pytest.approx(1.0)
    assert c.token_tpot_ms == pytest.approx(0.0)


def test_cli_prints_the_reference_rows_without_a_results_file(capsys):
    main([])
    out = capsys.readouterr().out
    assert "reference: without router" in out and "reference: with router" in out
    assert "| 58.0 |" in out
