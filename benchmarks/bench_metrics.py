"""Pure arithmetic: per-request outcomes -> the benchmark's aggregate metrics.

Definitions follow `vllm bench serve`'s calculate_metrics (see
../shared/metrics-reference.md section 10.2):
- TTFT, TPOT and E2EL are statistics over successful requests; ITL pools every
  chunk gap of every successful request, so long outputs weigh more.
- TPOT = (latency - ttft) / (output_len - 1), only for output_len > 1 (for
  goodput a request with output_len <= 1 counts TPOT 0).
- mean / median / std (population) / percentiles (numpy, linear); an empty
  list gives 0 everywhere.
- throughputs divide by the benchmark duration; failed requests count for
  nothing except `failed`.
All times here are seconds (already divided by any --time-scale); the
`*_ms` outputs are milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestResult:
    """What one request produced, as measured by the client.

    `start_time` is seconds since the benchmark started; `ttft`, `itl` and
    `latency` are seconds relative to the request's own start.
    `output_tokens` is the server-reported completion token count (0 when the
    server sent no usage; the metrics then count the generated text).
    """

    success: bool = False
    prompt_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0


def percentile_key(p: float) -> str:
    """'99' for 99.0, '99.9' for 99.9: the suffix vLLM writes in p<p>_ttft_ms."""
    return str(int(p)) if int(p) == p else str(p)


def _stats_ms(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    # vLLM passes `values or 0`, so an empty list yields 0 for every statistic.
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64)
    out = {
        "mean": float(np.mean(arr)) * 1000,
        "median": float(np.median(arr)) * 1000,
        "std": float(np.std(arr)) * 1000,
    }
    for p in percentiles:
        out[f"p{percentile_key(p)}"] = float(np.percentile(arr, p)) * 1000
    return out


def output_lengths(
    outputs: Sequence[RequestResult], count_tokens: Callable[[str], int] | None
) -> list[int]:
    """Per-request output token counts: usage when reported, else re-tokenized text; 0 for failures."""
    lens: list[int] = []
    for out in outputs:
        if not out.success:
            lens.append(0)
        elif out.output_tokens:
            lens.append(out.output_tokens)
        elif count_tokens is not None:
            lens.append(count_tokens(out.generated_text))
        else:
            # No usage and no tokenizer: every chunk carried at least one token.
            lens.append(len(out.itl) + 1)
    return lens


def tpot_of(out: RequestResult, output_len: int) -> float | None:
    """Time per output token excluding the first; None when undefined (output_len <= 1 or failed)."""
    if not out.success or output_len <= 1:
        return None
    return (out.latency - out.ttft) / (output_len - 1)


def _peak_output_and_concurrency(outputs: Sequence[RequestResult]) -> tuple[float, int]:
    """Max tokens emitted in any one-second bin, and max requests active in any second.

    Token times are rebuilt as start + ttft + cumulative ITL, one token per
    chunk, as vLLM does.
    """
    ok = [o for o in outputs if o.success]
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    t_end = max(o.start_time + o.latency for o in ok)
    n_bins = int(np.ceil(t_end - t0)) + 1
    tokens = np.zeros(n_bins)
    active = np.zeros(n_bins)
    for o in ok:
        times = o.start_time + o.ttft + np.concatenate(([0.0], np.cumsum(o.itl)))
        bins = (times - t0).astype(np.int64)
        bins = bins[(bins >= 0) & (bins < n_bins)]
        np.add.at(tokens, bins, 1)
        first = int(o.start_time - t0)
        last = min(int(o.start_time + o.latency - t0), n_bins - 1)
        active[first : last + 1] += 1
    return float(tokens.max()), int(active.max())


def calculate_metrics(
    outputs: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (99.0,),
    goodput_slo_ms: dict[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> dict:
    """Aggregate metrics in the key names `vllm bench serve --save-result` writes.

    Statistics for all four of ttft/tpot/itl/e2el are always included
    (`mean_/median_/std_/p<p>_<name>_ms`); which ones get printed is the
    summary's choice.
    """
    out_lens = output_lengths(outputs, count_tokens)
    ttfts: list[float] = []
    tpots: list[float] = []
    goodput_tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    total_input = 0
    completed = 0
    for out, out_len in zip(outputs, out_lens, strict=True):
        if not out.success:
            continue
        completed += 1
        total_input += out.prompt_len
        tpot = tpot_of(out, out_len)
        if tpot is not None:
            tpots.append(tpot)
        goodput_tpots.append(tpot or 0.0)
        itls.extend(out.itl)
        ttfts.append(out.ttft)
        e2els.append(out.latency)

    good = 0
    if goodput_slo_ms:
        per_metric = {"ttft": ttfts, "tpot": goodput_tpots, "e2el": e2els}
        checks = [(per_metric[name], slo / 1000.0) for name, slo in goodput_slo_ms.items()]
        for i in range(completed):
            if all(values[i] <= slo for values, slo in checks):
                good += 1

    total_output = sum(out_lens)
    peak_tokens, peak_concurrency = _peak_output_and_concurrency(outputs)
    metrics: dict = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration if duration > 0 else 0.0,
        "request_goodput": (good / duration if duration > 0 else 0.0) if goodput_slo_ms else None,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_concurrency,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, value in _stats_ms(values, percentiles).items():
            metrics[f"{stat}_{name}_ms"] = value
    metrics["output_lens"] = out_lens
    return metrics


def per_request_lists(outputs: Sequence[RequestResult], out_lens: Sequence[int]) -> dict[str, list]:
    """The per-request arrays of the result JSON, aligned with dispatch order.

    `ttfts`, `itls`, `input_lens`, `errors` as vLLM writes them (failed
    requests keep ttft 0.0 and an error text; "" means success), plus
    `e2els`, `tpots` (None where undefined) and `start_times` for CDFs and
    timelines.
    """
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "errors": [o.error for o in outputs],
        "e2els": [o.latency if o.success else None for o in outputs],
        "tpots": [tpot_of(o, n) for o, n in zip(outputs, out_lens, strict=True)],
        "start_times": [o.start_time for o in outputs],
    }


def format_summary(
    result: dict,
    selected_metrics: Sequence[str],
    percentiles: Sequence[float],
    max_concurrency: int | None,
    request_rate: float,
    show_goodput: bool,
) -> str:
    """The `============ Serving Benchmark Result ============` block, in vLLM's layout."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: object, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if show_goodput:
        row("Request goodput (req/s):", result["request_goodput"] or 0.0, ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", float(result["max_concurrent_requests"]), ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for name in METRIC_NAMES:
        if name not in selected_metrics:
            continue
        short, header = METRIC_TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            key = percentile_key(p)
            row(f"P{key} {short} (ms):", result[f"p{key}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
