"""Runs the benchmark client (benchmarks.serve) for one policy and trims its result for storage."""

from __future__ import annotations

# Per-request lists that are too big to commit for thousands of requests; TPOT per request is
# kept (derived from the ITLs) so the CDFs can be redrawn from the JSON, and so are the first
# gap and the TPOT from the second token (when each router delivers the first token).
DROP_KEYS = ("itls", "generated_texts")


def slim_result(result: dict, keep_itls: bool = False) -> dict:
    """The result without its bulkiest lists; `keep_itls` keeps each request's gaps between chunks
    (rounded to 0.1 ms), for questions the summary cannot answer, such as when a proxy delivers
    the first token."""
    from benchmarks.routing_first_tokens import compact_lists
    from benchmarks.routing_plots import per_request_ms

    dropped = tuple(k for k in DROP_KEYS if not (keep_itls and k == "itls"))
    slim = {k: v for k, v in result.items() if k not in dropped}
    if keep_itls and isinstance(slim.get("itls"), list):
        slim["itls"] = [[round(g, 4) for g in gaps] for gaps in slim["itls"]]
    if isinstance(result.get("itls"), list):
        slim["first_gaps"], slim["tpots_from_second"] = compact_lists(result["itls"])
    if "tpots" not in slim and "itls" in result:
        tpots_ms = per_request_ms(result, "tpot")
        slim["tpots"] = [round(t / 1000.0, 6) for t in tpots_ms]
    for key in ("ttfts", "tpots", "e2els", "start_times"):  # microseconds are plenty
        if isinstance(slim.get(key), list):
            slim[key] = [round(t, 6) if isinstance(t, float) else t for t in slim[key]]
    return slim


def prepare(dataset: str, num_prompts: int, seed: int, extra: dict) -> list:
    """Sample the workload once per scenario, so every policy replays exactly the same requests."""
    from benchmarks.serve import prepare_workload

    keys = ("tokenizer", "max_turns", "max_prompt_len", "max_total_len")
    workload, _tok = prepare_workload(dataset, num_prompts, seed, **{k: extra[k] for k in keys if k in extra})
    return workload


async def run_client(base_urls: list[str], model: str, dataset: str, num_prompts: int, concurrency: int,
                     seed: int, time_scale: float, workload: list, extra: dict) -> dict:
    """One benchmark run; several base URLs are used round robin per request by the client (baseline)."""
    from benchmarks.serve import run_benchmark

    return await run_benchmark(
        base_urls=base_urls, model=model, dataset=dataset, num_prompts=num_prompts,
        max_concurrency=concurrency, seed=seed, time_scale=time_scale, workload=workload,
        show_progress=False, print_summary=False, **extra,
    )
