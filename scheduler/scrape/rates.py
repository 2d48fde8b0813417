"""Counter deltas -> smoothed rates and histogram means, with counter resets handled.

A scrape every 100 ms makes single-interval rates noisy (vLLM adds a whole prompt at
its first token), so each per-interval rate feeds an exponentially weighted average
with a time constant of `tau_s`. A counter that went down was reset (worker restart):
its delta is its new value, as Prometheus' rate() assumes.

A counter's first rate waits until its baseline is `warmup_s` old (tau_s by default) and is
the average over that span: seeded from one 100 ms interval, the average started at whatever
that interval held, a whole prompt's burst read as ten times the worker's prompt rate (or a
quiet interval as none), and took seconds to decay.
"""

from __future__ import annotations

import math

from scheduler.scrape.snapshot import LoadSnapshot, RawSample


def counter_delta(prev: float, cur: float) -> float:
    return cur - prev if cur >= prev else cur


Series = frozenset[tuple[str, str]]


def series_delta(prev: dict[Series, float], cur: dict[Series, float],
                 known: set[Series] | None = None) -> float:
    """The increase of a sum of counters, series by series: a series that reset counts its new
    value, a new one its value (it started from zero), one that is gone nothing. On the sum alone,
    one model reloaded on a Triton serving several looked like all of them restarting, and the
    whole sum became one interval's increase (a rate of every token ever served, in 0.1 s).

    A series in `known` (seen before) that was missing from `prev` came back: its value is its
    new baseline, not an increase. Counted from zero, a series that merely dropped out of one
    page (a model's series missing for a scrape) brought its whole lifetime back as one
    interval's increase. (One unloaded and reloaded loses what it did before its first scrape.)"""
    total = 0.0
    for series, value in cur.items():
        before = prev.get(series)
        if before is not None:
            total += counter_delta(before, value)
        elif known is None or series not in known:
            total += value
    return total


def went_back(prev: dict[Series, float], cur: dict[Series, float]) -> bool:
    """Whether a series on both pages went down: its counter restarted (its engine did)."""
    return any(value < prev[series] for series, value in cur.items() if series in prev)


class RateTracker:
    def __init__(self, tau_s: float = 1.0, warmup_s: float | None = None) -> None:
        self.tau_s = tau_s
        self.warmup_s = tau_s if warmup_s is None else warmup_s
        self._prev: dict[str, float] | None = None
        self._prev_series: dict[str, dict[Series, float]] = {}
        self._prev_t = 0.0
        # Every series each key has shown since the last reset (to tell one back from a new one).
        self._known: dict[str, set[Series]] = {}
        # EWMA of per-second deltas, by counter key.
        self._ewma: dict[str, float] = {}
        # Keys not rated yet: (increase since the baseline, the baseline's time).
        self._warming: dict[str, tuple[float, float]] = {}
        # The last update saw a counter go down: the engine restarted since the scrape before
        # (the scraper then reads again what it cached about the engine).
        self.went_back = False

    def reset(self) -> None:
        self._prev = None
        self._prev_series = {}
        self._known.clear()
        self._ewma.clear()
        self._warming.clear()

    def update(self, raw: RawSample, t: float) -> dict[str, float]:
        """Feed one scrape taken at monotonic time t; returns smoothed per-second rates."""
        cur = raw.counters
        prev, dt = self._prev, t - self._prev_t
        prev_series = self._prev_series
        self._prev, self._prev_t = dict(cur), t
        self._prev_series = dict(raw.counter_series)
        # A counter the page no longer shows (a restarted SGLang or TGI creates its labelled
        # counters on first use) has no rate: its last one would stand for as long as it is gone.
        for key in [k for k in self._ewma if k not in cur]:
            del self._ewma[key]
        for key in [k for k in self._warming if k not in cur]:
            del self._warming[key]
        self.went_back = False
        if prev is None or dt <= 0:
            self._remember(raw)
            return dict(self._ewma)
        alpha = 1.0 - math.exp(-dt / self.tau_s)
        for key, value in cur.items():
            before = prev.get(key)
            if before is None:
                continue  # new or back: this scrape is its baseline
            before_series, series = prev_series.get(key), raw.counter_series.get(key)
            if before_series is not None and series is not None:
                increase = series_delta(before_series, series, self._known.get(key))
                self.went_back |= went_back(before_series, series)
            else:
                increase = counter_delta(before, value)
                self.went_back |= value < before
            old = self._ewma.get(key)
            if old is not None:
                self._ewma[key] = old + alpha * (increase / dt - old)
                continue
            gained, since = self._warming.get(key, (0.0, t - dt))
            gained += increase
            if t - since < self.warmup_s:
                self._warming[key] = (gained, since)
            else:
                self._warming.pop(key, None)
                self._ewma[key] = gained / (t - since)
        self._remember(raw)
        return dict(self._ewma)

    def _remember(self, raw: RawSample) -> None:
        for key, series in raw.counter_series.items():
            self._known.setdefault(key, set()).update(series)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den or den <= 1e-12:
        return None
    return num / den


def build_snapshot(
    raw: RawSample, rates: dict[str, float], taken_at: float, wall_time: float, dialect: str
) -> LoadSnapshot:
    prompt_tps = raw.prompt_tps if raw.prompt_tps is not None else rates.get("prompt_tokens")
    gen_tps = raw.gen_tps if raw.gen_tps is not None else rates.get("generation_tokens")
    hit_rate = _ratio(rates.get("prefix_hits"), rates.get("prefix_queries"))
    if hit_rate is None:
        hit_rate = raw.prefix_hit_rate
    kv = raw.kv_usage
    if kv is not None:
        kv = min(max(kv, 0.0), 1.0)
    return LoadSnapshot(
        running=max(raw.running or 0.0, 0.0),
        waiting=max(raw.waiting or 0.0, 0.0),
        kv_usage=kv,
        prompt_tps=prompt_tps,
        gen_tps=gen_tps,
        prefix_hit_rate=hit_rate,
        block_size=raw.block_size,
        num_blocks=raw.num_blocks,
        ttft_mean_s=_ratio(rates.get("ttft_sum"), rates.get("ttft_count")),
        itl_mean_s=_ratio(rates.get("itl_sum"), rates.get("itl_count")),
        prefilled_tokens_total=_first_present(raw.counters, "prompt_tokens_computed", "prompt_tokens"),
        prefill_tps=_first_present(rates, "prompt_tokens_computed", "prompt_tokens"),
        waiting_deferred=max(raw.waiting_deferred or 0.0, 0.0),
        taken_at=taken_at,
        wall_time=wall_time,
        dialect=dialect,
    )


def _first_present(counters: dict[str, float], *keys: str) -> float | None:
    for key in keys:
        value = counters.get(key)
        if value is not None:
            return value
    return None
