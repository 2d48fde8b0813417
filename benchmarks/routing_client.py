"""Runs the benchmark client (benchmarks.serve) for one policy and trims its result for storage."""

from __future__ import annotations

import inspect

# Per-request lists that are too big to commit for thousands of requests; TPOT per request is
# kept (derived from the ITLs) so the CDFs can be redrawn from the JSON.
DROP_KEYS = ("itls", "generated_texts")


def slim_result(result: dict) -> dict:
    from benchmarks.routing_plots import per_request_ms

    slim = {k: v for k, v in result.items() if k not in DROP_KEYS}
    if "tpots" not in slim and "itls" in result:
        tpots_ms = per_request_ms(result, "tpot")
        slim["tpots"] = [round(t / 1000.0, 6) for t in tpots_ms]
    if "ttfts" in slim:
        slim["ttfts"] = [None if t is None else round(t, 6) for t in slim["ttfts"]]
    return slim


async def run_client(base_urls: list[str], model: str, dataset: str, num_prompts: int, concurrency: int,
                     seed: int, time_scale: float, extra: dict) -> dict:
    """One benchmark run; several base URLs are served round robin by the client (the baseline)."""
    from benchmarks.serve import run_benchmark

    kwargs = dict(base_urls=base_urls, model=model, dataset=dataset, num_prompts=num_prompts,
                  max_concurrency=concurrency, seed=seed, time_scale=time_scale, **extra)
    result = run_benchmark(**kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result
