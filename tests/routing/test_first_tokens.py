"""When a router delivers the first token (benchmarks.routing_first_tokens, --keep-itls)."""

from __future__ import annotations

import json

import pytest

from benchmarks.routing_client import slim_result
from benchmarks.routing_first_tokens import first_token_stats, main, table, windows_of
from benchmarks.routing_report import policy_table, summary_table

STEP = 0.05  # one decode step


def stream(start: float, ttft: float, gaps: list[float]) -> dict:
    return {"start": start, "ttft": ttft, "gaps": gaps}


def result_of(streams: list[dict], errors: list[str] | None = None) -> dict:
    return {"start_times": [s["start"] for s in streams], "ttfts": [s["ttft"] for s in streams],
            "itls": [s["gaps"] for s in streams], "errors": errors or [""] * len(streams)}


def test_a_held_first_chunk_moves_a_step_from_tpot_to_ttft_and_the_second_token_sees_through_it():
    # The same three-gap answer, delivered on time and with its first chunk held for the second.
    on_time = result_of([stream(0.0, 0.2, [STEP, STEP, STEP])])
    held = result_of([stream(0.0, 0.2 + STEP, [0.0005, STEP, STEP])])
    a, b = first_token_stats(on_time), first_token_stats(held)
    assert (a.first_together, b.first_together) == (0, 1)
    assert b.mean_ttft_ms == pytest.approx(a.mean_ttft_ms + 1000 * STEP)
    assert b.mean_tpot_ms < 0.7 * a.mean_tpot_ms  # what the client reports: "faster decoding"
    assert b.mean_second_token_ms == pytest.approx(a.mean_second_token_ms, abs=1.0)
    assert b.mean_tpot_from_second_ms == pytest.approx(a.mean_tpot_from_second_ms)


def test_windows_split_the_run_by_start_time_and_skip_failures_and_one_gap_answers():
    r = result_of([stream(100.0, 0.1, [STEP, STEP]), stream(105.0, 0.3, [2 * STEP, 2 * STEP]),
                   stream(120.0, 0.1, [STEP, STEP, STEP]), stream(121.0, 0.1, [STEP]),
                   stream(122.0, 9.9, [STEP, STEP])],
                  errors=["", "", "", "", "cut"])
    wave, rest = first_token_stats(r, 0, 10), first_token_stats(r, 10)
    assert wave.requests == 2 and rest.requests == 1
    assert wave.mean_ttft_ms == pytest.approx(200.0)
    assert wave.mean_tpot_ms == pytest.approx(1000 * 1.5 * STEP)
    assert rest.mean_ttft_ms == pytest.approx(100.0)
    assert first_token_stats(r, 30) is None
    assert first_token_stats({"ttfts": [0.1], "start_times": [0.0]}) is None


def test_windows_of_reads_edges_and_refuses_what_is_no_edge():
    assert windows_of("10,0") == [(0.0, 10.0), (10.0, float("inf"))]
    for bad in ("", "x", "nan", "-1"):
        with pytest.raises(ValueError, match="--windows"):
            windows_of(bad)


def test_cli_prints_a_row_per_window_and_policy_and_refuses_a_json_without_gaps(tmp_path, capsys):
    doc = {"policies": {"baseline": result_of([stream(0.0, 0.2, [STEP, STEP])]),
                        "peer:x": result_of([stream(0.0, 0.25, [0.0, STEP])])}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    assert main([str(path), "--windows", "0,10"]) == 0
    out = capsys.readouterr().out
    assert out == table(doc, windows_of("0,10")) + "\n"
    assert "| 0-10 | peer:x | 1 | 100% | 250 |" in out
    for row in doc["policies"].values():
        del row["itls"]
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit):
        main([str(path)])
    assert "--keep-itls" in capsys.readouterr().err


def test_slim_result_drops_the_gaps_unless_asked_but_keeps_what_the_tables_need():
    result = {"itls": [[0.0412345678, 0.05, 0.07], [0.03]], "output_lens": [4, 2], "ttfts": [0.1, 0.2],
              "tpots": [0.054, 0.03], "start_times": [0.0, 1.0], "errors": ["", ""],
              "generated_texts": ["hi", "yo"]}
    slim = slim_result(result)
    assert "itls" not in slim and "generated_texts" not in slim
    assert slim["first_gaps"] == [0.0412, 0.03]
    assert slim["tpots_from_second"] == [pytest.approx(0.06), None]
    # The slim JSON answers the same as the full one.
    assert first_token_stats(slim) == first_token_stats(result)
    kept = slim_result(result, keep_itls=True)
    assert kept["itls"] == [[0.0412, 0.05, 0.07], [0.03]]


def test_routing_tables_show_the_tpot_from_the_second_token_and_the_held_first_chunks():
    held = result_of([stream(0.0, 0.25, [0.0, STEP, STEP]), stream(1.0, 0.2, [STEP, STEP, STEP])])
    on_time = result_of([stream(0.0, 0.2, [STEP, STEP, STEP]), stream(1.0, 0.2, [STEP, STEP, STEP])])
    table_md = summary_table({"baseline": on_time, "peer:x": held})
    assert "| mean TPOT from the 2nd token (ms) | 50.0 | 50.0 (+0%) |" in table_md
    assert "| first two tokens delivered together (%) | 0.0 | 50.0 |" in table_md
    assert "| mean TPOT from the 2nd token | n/a |" in policy_table("x", {}, held)
