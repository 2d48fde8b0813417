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


async def read_engine_counters(worker_urls: list[str]) -> list[dict[str, float]]:
    """One dict per worker (empty where its page could not be read)."""
    async def one(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
        text = await fetch_metrics(session, url, timeout_s=5)
        return {} if text is None else parse_counters(text)

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, u) for u in worker_urls)))


def engine_table(engines: dict[str, list[dict[str, float]]]) -> str:
    """Markdown: one row per policy, the cluster's totals."""
    lines = ["| policy | preemptions | prefix cache hit % | computed prompt tokens | prompt tokens |",
             "|---|---|---|---|---|"]
    for name, workers in engines.items():
        total: dict[str, float] = {}
        for w in workers:
            for k, v in w.items():
                total[k] = total.get(k, 0.0) + v
        queried = total.get("prefix_queried_tokens", 0.0)
        hit = f"{100.0 * total.get('prefix_hit_tokens', 0.0) / queried:.1f}" if queried else "-"
        computed = total.get("computed_prompt_tokens")
        computed_text = "-" if computed is None else f"{computed:.0f}"
        lines.append(f"| {name} | {total.get('preemptions', 0):.0f} | {hit} | {computed_text} | "
                     f"{total.get('prompt_tokens', 0):.0f} |")
    return "\n".join(lines)
