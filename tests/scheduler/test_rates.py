"""RateTracker over scrapes where counters come and go (an engine restarted, a model unloaded)."""

from __future__ import annotations

import pytest

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
