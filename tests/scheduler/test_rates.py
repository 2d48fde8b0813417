"""RateTracker over scrapes where counters come and go (an engine restarted, a model unloaded)."""

from __future__ import annotations

import pytest

from scheduler.scrape import dialects
from scheduler.scrape.parse import parse_selected
from scheduler.scrape.rates import RateTracker, build_snapshot
from scheduler.scrape.snapshot import RawSample


def feed(tracker: RateTracker, t: float, **counters: float) -> dict[str, float]:
    return tracker.update(RawSample(running=0.0, waiting=0.0, counters=counters), t)


def test_a_counter_gone_from_the_page_has_no_rate_left():
    """SGLang and TGI create their labelled counters on first use: restarted, an engine's page
    lacks them until it serves again. Its old rate was kept meanwhile, so an idle restarted worker
    went on reporting the prompt and generation rates it had before (policy load, prefill
    progress) for as long as it stayed idle."""
    tracker = RateTracker(tau_s=1e-9)
    feed(tracker, 0.0, prompt_tokens=1000.0, generation_tokens=500.0)
    rates = feed(tracker, 1.0, prompt_tokens=6000.0, generation_tokens=900.0)
    assert rates["prompt_tokens"] == pytest.approx(5000.0)
    rates = feed(tracker, 2.0, generation_tokens=900.0)  # restarted: no prompt counter yet
    assert "prompt_tokens" not in rates
    assert rates["generation_tokens"] == pytest.approx(0.0)
    snap = build_snapshot(RawSample(running=0.0, waiting=0.0), rates, 2.0, 2.0, "sglang")
    assert snap.prompt_tps is None and snap.prefill_tps is None
    # Back: a rate again from its second scrape.
    feed(tracker, 3.0, prompt_tokens=100.0, generation_tokens=900.0)
    rates = feed(tracker, 4.0, prompt_tokens=300.0, generation_tokens=900.0)
    assert rates["prompt_tokens"] == pytest.approx(200.0)


def _trtllm_tokens(outputs: dict[str, float]) -> RawSample:
    """A TensorRT-LLM Triton page's output-token counters, one per model."""
    lines = ["# TYPE nv_trt_llm_request_metrics gauge",
             'nv_trt_llm_request_metrics{model="a",request_type="active",version="1"} 1',
             "# TYPE nv_llm_output_token_len histogram"]
    for model, total in outputs.items():
        lines.append(f'nv_llm_output_token_len_sum{{model="{model}",response_metric_type="total_output_tokens",'
                     f'version="1"}} {total}')
    return dialects.TRTLLM.extract(parse_selected("\n".join(lines) + "\n", dialects.TRTLLM.wanted))


def test_one_series_of_a_summed_counter_reset_or_gone_is_not_a_restart_of_all():
    """Two models on one Triton, model b reloaded (its counters back to zero), then unloaded. On
    the sum, each drop read as a whole-server restart: the sum of model a's lifetime tokens became
    one second's increase. Series by series, a's own rate stands and b adds what it did."""
    tracker = RateTracker(tau_s=1e-9)
    tracker.update(_trtllm_tokens({"a": 900_000.0, "b": 400_000.0}), 0.0)
    rates = tracker.update(_trtllm_tokens({"a": 900_100.0, "b": 400_050.0}), 1.0)
    assert rates["generation_tokens"] == pytest.approx(150.0)
    rates = tracker.update(_trtllm_tokens({"a": 900_200.0, "b": 30.0}), 2.0)  # b reloaded
    assert rates["generation_tokens"] == pytest.approx(130.0)
    rates = tracker.update(_trtllm_tokens({"a": 900_300.0}), 3.0)  # b unloaded
    assert rates["generation_tokens"] == pytest.approx(100.0)
    rates = tracker.update(_trtllm_tokens({"a": 900_400.0, "c": 20.0}), 4.0)  # c loaded, served 20
    assert rates["generation_tokens"] == pytest.approx(120.0)


def test_a_series_back_on_the_page_restarts_its_baseline():
    """Model b's series missing from one scrape (a page rendered without it) and back with the
    same lifetime total: counted from zero, its 400,000 tokens were one second's increase, a
    rate spike that made the worker look the busiest of the pool. Back, it is a new baseline;
    a series never seen before still counts from zero (a model loaded since)."""
    tracker = RateTracker(tau_s=1e-9)
    tracker.update(_trtllm_tokens({"a": 900_000.0, "b": 400_000.0}), 0.0)
    rates = tracker.update(_trtllm_tokens({"a": 900_100.0}), 1.0)  # b missing from this page
    assert rates["generation_tokens"] == pytest.approx(100.0)
    rates = tracker.update(_trtllm_tokens({"a": 900_200.0, "b": 400_050.0}), 2.0)  # b back
    assert rates["generation_tokens"] == pytest.approx(100.0)
    rates = tracker.update(_trtllm_tokens({"a": 900_300.0, "b": 400_080.0}), 3.0)
    assert rates["generation_tokens"] == pytest.approx(130.0)  # b's rate counts again
    rates = tracker.update(_trtllm_tokens({"a": 900_400.0, "b": 400_080.0, "c": 20.0}), 4.0)
    assert rates["generation_tokens"] == pytest.approx(120.0)


def _bursty_prompt_rates(tracker: RateTracker, seconds: float) -> list[tuple[float, float | None]]:
    """A worker that finishes one 1000-token prompt a second (vLLM adds a prompt to its counter
    at the first token, all at once, 50 ms into each second), scraped every 100 ms: the published
    prompt rate after each scrape (None: none yet)."""
    out = []
    for i in range(round(seconds * 10) + 1):
        t = i / 10
        done = sum(1 for k in range(int(seconds) + 1) if k + 0.05 <= t)
        rates = tracker.update(RawSample(counters={"prompt_tokens": 1000.0 * done}), t)
        out.append((t, rates.get("prompt_tokens")))
    return out


def test_the_first_rate_is_not_one_short_interval_magnified():
    """The average was seeded from the first 100 ms interval alone: the burst in it read as
    10,000 prompt tokens a second for a worker doing 1,000, and at 1 s time constant it was
    still 4x over a second later (an empty first interval reads 0 instead). The first rate now
    waits for one time constant of data and is its average; from then on the smoothing holds
    every reading within twice the true rate."""
    published = [(t, r) for t, r in _bursty_prompt_rates(RateTracker(tau_s=1.0), 4.0) if r is not None]
    assert published, "a rate once the baseline is a time constant old"
    first_t, first = published[0]
    assert first_t == pytest.approx(1.0)
    assert first == pytest.approx(1000.0)
    assert all(500.0 <= r <= 2000.0 for _, r in published), published
