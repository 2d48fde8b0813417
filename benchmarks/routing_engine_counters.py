"""What each policy made the engines do: counters read from every worker's `/metrics` at the end.

Latency tables say how a run went; these say why. Read once per worker when the client is
done (the workers still run), summed over label sets:
- preemptions: requests the engine evicted for KV and recomputes (`vllm:num_preemptions_total`);
  a KV-blind router causes them, and each one is a prompt prefilled twice.
- prefix cache hit %: prompt tokens found cached of those looked up
  (`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`): where a router sends a
  follow-up turn decides whether its history is prefilled again.
- computed prompt tokens: prompt tokens the engines actually prefilled
  (`vllm:prompt_tokens_by_source_total{source="local_compute"}`), the prefill work the
  placement cost.
- sim stretch %: for sim workers, how much slower than modelled their "GPU" ran because the
  host's CPU was busy (`sim:stretch_seconds_total + sim:late_seconds_total` over
  `sim:modelled_seconds_total`, inference_worker/sim/metrics.py). Real GPUs do not slow down
  so; a router whose parts (or scrapes) take the workers' CPU shows here, not in routing.

And from our gateway (not the peers, which publish no such series), how long requests were held
before a worker was chosen (`router_queue_wait_seconds`): a policy that holds requests when every
worker is saturated moves waiting from the engines' queues into the gateway's, and this says how
much of each TTFT was spent there.
"""

from __future__ import annotations

import asyncio

import aiohttp

from benchmarks.routing_sampler import fetch_metrics
from scheduler.scrape.parse import parse_selected

# Counter series -> key in the result. prompt_tokens_by_source is narrowed to local_compute.
COUNTERS: dict[str, str] = {
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prefix_cache_queries_total": "prefix_queried_tokens",
    "vllm:prefix_cache_hits_total": "prefix_hit_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:prompt_tokens_by_source_total": "computed_prompt_tokens",
    "sim:modelled_seconds_total": "sim_modelled_s",
    "sim:stretch_seconds_total": "sim_stretch_s",
    "sim:late_seconds_total": "sim_late_s",
}


def parse_counters(text: str) -> dict[str, float]:
    """The counters above from one Prometheus text page, each summed over its label sets."""
    out: dict[str, float] = {}
    for key, samples in parse_selected(text, COUNTERS).items():
        if key == "computed_prompt_tokens":
            samples = [s for s in samples if s[0].get("source") == "local_compute"]
            if not samples:
                continue
        out[key] = sum(value for _, value in samples)
    return out


QUEUE_WAIT: dict[str, str] = {
    "router_queue_wait_seconds_bucket": "buckets",
    "router_queue_wait_seconds_sum": "sum_s",
    "router_queue_wait_seconds_count": "count",
}
# Columns of the gateway table: requests held longer than this (bucket bounds of the histogram).
HELD_OVER_S = (1.0, 5.0, 10.0)


def parse_queue_wait(text: str) -> dict:
    """{"count", "sum_s", "buckets": {le: cumulative count}} from a gateway's page; {} without one."""
    found = parse_selected(text, QUEUE_WAIT)
    if "count" not in found:
        return {}
    return {
        "count": sum(v for _, v in found["count"]),
        "sum_s": sum(v for _, v in found.get("sum_s", [])),
        "buckets": {labels["le"]: v for labels, v in found.get("buckets", []) if "le" in labels},
    }


async def read_gateway_queue(gateway_url: str | None) -> dict:
    if gateway_url is None:
        return {}
    async with aiohttp.ClientSession() as session:
        text = await fetch_metrics(session, gateway_url, timeout_s=5)
    return {} if text is None else parse_queue_wait(text)


async def read_session_outcomes(scheduler_url: str | None) -> dict[str, float]:
    """The scheduler's scheduler_session_affinity_total by outcome (kept, moved, new): empty
    without a scheduler, or from one that keeps no sessions."""
    if scheduler_url is None:
        return {}
    async with aiohttp.ClientSession() as session:
        text = await fetch_metrics(session, scheduler_url, timeout_s=5)
    prefix = 'scheduler_session_affinity_total{outcome="'
    return {line[len(prefix):].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in (text or "").splitlines() if line.startswith(prefix)}


def gateway_table(gateways: dict[str, dict]) -> str:
    """Markdown: one row per policy whose gateway published its queue waits."""
    head = " | ".join(f"held > {s:g} s" for s in HELD_OVER_S)
    lines = [f"| policy | requests | mean wait (ms) | {head} |", "|---" * (3 + len(HELD_OVER_S)) + "|"]
    for name, q in gateways.items():
        count = q.get("count")
        if not count:
            continue
        # Cumulative counts by bound; "+Inf" parses too and is never one of the columns.
        at_or_below = {float(le): v for le, v in q.get("buckets", {}).items()}
        held = ["-" if b not in at_or_below else f"{count - at_or_below[b]:.0f}" for b in HELD_OVER_S]
        lines.append(f"| {name} | {count:.0f} | {1000.0 * q.get('sum_s', 0.0) / count:.1f} | "
                     + " | ".join(held) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


async def read_engine_counters(worker_urls: list[str]) -> list[dict[str, float]]:
    """One dict per worker (empty where its page could not be read)."""
    async def one(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
        text = await fetch_metrics(session, url, timeout_s=5)
        return {} if text is None else parse_counters(text)

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, u) for u in worker_urls)))


def engine_table(engines: dict[str, list[dict[str, float]]]) -> str:
    """Markdown: one row per policy, the cluster's totals."""
    lines = ["| policy | preemptions | prefix cache hit % | computed prompt tokens | prompt tokens "
             "| sim stretch % |", "|---|---|---|---|---|---|"]
    for name, workers in engines.items():
        total: dict[str, float] = {}
        for w in workers:
            for k, v in w.items():
                total[k] = total.get(k, 0.0) + v
        queried = total.get("prefix_queried_tokens", 0.0)
        hit = f"{100.0 * total.get('prefix_hit_tokens', 0.0) / queried:.1f}" if queried else "-"
        computed = total.get("computed_prompt_tokens")
        computed_text = "-" if computed is None else f"{computed:.0f}"
        modelled = total.get("sim_modelled_s")
        slowed = total.get("sim_stretch_s", 0.0) + total.get("sim_late_s", 0.0)
        stretch = f"{100.0 * slowed / modelled:.2f}" if modelled else "-"  # not sim workers: -
        lines.append(f"| {name} | {total.get('preemptions', 0):.0f} | {hit} | {computed_text} | "
                     f"{total.get('prompt_tokens', 0):.0f} | {stretch} |")
    return "\n".join(lines)
