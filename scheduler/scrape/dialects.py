"""Engine metric dialects, each normalised to a RawSample (metrics-reference.md section 11).

A dialect is detected per worker from the series names its /metrics exposes, then
only the series that dialect needs are parsed on every scrape. Gauges and counters are
summed over data-parallel series (vLLM `engine`, SGLang `dp_rank`); KV usage is averaged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import urlencode

from scheduler.scrape.parse import Sample, label_present, series_names
from scheduler.scrape.sglang_info import RankLayout
from scheduler.scrape.snapshot import RawSample

Families = dict[str, list[Sample]]


def _samples(fams: Families, key: str, **match: str) -> list[Sample]:
    samples = fams.get(key) or []
    if match:
        samples = [s for s in samples if all(s[0].get(k) == v for k, v in match.items())]
    return samples


def _total(fams: Families, key: str, **match: str) -> float | None:
    samples = _samples(fams, key, **match)
    return sum(v for _, v in samples) if samples else None


def _mean(fams: Families, key: str, **match: str) -> float | None:
    samples = fams.get(key)
    if not samples:
        return None
    if match:
        samples = [s for s in samples if all(s[0].get(k) == v for k, v in match.items())]
        if not samples:
            return None
    return sum(v for _, v in samples) / len(samples)


class _Counters:
    """Cumulative counters by canonical key, each the sum of its series, and those series
    (RawSample.counter_series): a rate is the sum of the series' rates, so that one series reset
    or gone (a model reloaded or unloaded on a Triton serving several) is not the whole sum's."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.series: dict[str, dict[frozenset[tuple[str, str]], float]] = {}

    def put(self, key: str, samples: list[Sample], scale: float = 1.0) -> None:
        if samples:
            self.totals[key] = sum(v for _, v in samples) * scale
            self.series[key] = {frozenset(labels.items()): v * scale for labels, v in samples}

def _wire(names: dict[str, str], counters: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """Series-name -> key map; counters are matched with and without `_total`."""
    out = dict(names)
    for wire, key in counters:
        out[wire + "_total"] = key
        out[wire] = key
    return out


def _hist(prefix: str, key: str) -> dict[str, str]:
    return {f"{prefix}_sum": f"{key}_sum", f"{prefix}_count": f"{key}_count"}


@dataclass(frozen=True)
class Dialect:
    name: str
    wanted: dict[str, str]
    extract: Callable[[Families], RawSample]
    # Engines whose /metrics is prometheus_client's ASGI app (vLLM, SGLang) honour `?name[]=`:
    # only those series are collected and rendered. Others (TGI, Triton) would ignore it.
    names_filter: bool = False
    # Series of a more specific dialect that can appear on this one's page later (wanted under the
    # key OUTRANKED): once one does, the scraper detects the page's dialect again.
    outranked_by: tuple[str, ...] = ()
    # The extractor also takes the engine's rank layout (SGLang's server info), when known.
    ranked: bool = False

    def read(self, fams: Families, layout: RankLayout | None = None) -> RawSample:
        """The RawSample of a page's parsed families, in the worker's rank layout if known."""
        return self.extract(fams, layout) if self.ranked else self.extract(fams)

    @cached_property
    def filtered_metrics_path(self) -> str:
        """`/metrics/?name[]=...` for every series this dialect reads ("" where not honoured).

        The trailing slash matters: vLLM (0.32, run here) also registers
        prometheus-fastapi-instrumentator's handler on the exact path `/metrics`, which renders
        the whole page whatever the query says (49.5 KB either way); its prometheus_client app
        is mounted under `/metrics` too, and `/metrics/` reaches that one (3.5 KB). SGLang
        mounts only the app, so either path reaches it there.
        """
        if not self.names_filter:
            return ""
        return "/metrics/?" + urlencode([("name[]", name) for name in self.wanted])


# ---- vLLM (v1 current names, v0 names, Triton's vLLM backend) ----------------------------

_VLLM = _wire(
    {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_waiting_by_reason": "waiting_by_reason",
        "vllm:kv_cache_usage_perc": "kv",
        "vllm:gpu_cache_usage_perc": "kv_v0",
        "vllm:gpu_prefix_cache_hit_rate": "prefix_rate_v0",
        "vllm:cache_config_info": "cache_info",
        **_hist("vllm:time_to_first_token_seconds", "ttft"),
        **_hist("vllm:inter_token_latency_seconds", "itl"),
        **_hist("vllm:time_per_output_token_seconds", "tpot_v0"),
    },
    (
        ("vllm:prompt_tokens", "prompt_tokens"),
        ("vllm:prompt_tokens_by_source", "prompt_tokens_by_source"),
        ("vllm:generation_tokens", "generation_tokens"),
        ("vllm:prefix_cache_hits", "prefix_hits"),
        ("vllm:prefix_cache_queries", "prefix_queries"),
        ("vllm:gpu_prefix_cache_hits", "prefix_hits_08"),
        ("vllm:gpu_prefix_cache_queries", "prefix_queries_08"),
    ),
)


def _vllm(fams: Families) -> RawSample:
    kv = _mean(fams, "kv")
    if kv is None:
        kv = _mean(fams, "kv_v0")
    block_size = num_blocks = None
    for labels, _ in fams.get("cache_info", ()):
        try:
            block_size = int(labels["block_size"])
            num_blocks = (num_blocks or 0) + int(labels["num_gpu_blocks"])
        except (KeyError, ValueError):
            continue
    c = _Counters()
    c.put("prompt_tokens", _samples(fams, "prompt_tokens"))
    # Newer vLLM splits prompts by source: the computed part is the prefill work done.
    c.put("prompt_tokens_computed", _samples(fams, "prompt_tokens_by_source", source="local_compute"))
    c.put("generation_tokens", _samples(fams, "generation_tokens"))
    hits, queries = _samples(fams, "prefix_hits"), _samples(fams, "prefix_queries")
    if not hits:
        hits, queries = _samples(fams, "prefix_hits_08"), _samples(fams, "prefix_queries_08")
    c.put("prefix_hits", hits)
    c.put("prefix_queries", queries)
    c.put("ttft_sum", _samples(fams, "ttft_sum"))
    c.put("ttft_count", _samples(fams, "ttft_count"))
    itl = "itl" if "itl_count" in fams else "tpot_v0"
    c.put("itl_sum", _samples(fams, f"{itl}_sum"))
    c.put("itl_count", _samples(fams, f"{itl}_count"))
    return RawSample(
        counters=c.totals,
        counter_series=c.series,
        running=_total(fams, "running"),
        waiting=_total(fams, "waiting"),
        kv_usage=kv,
        block_size=block_size,
        num_blocks=num_blocks,
        prefix_hit_rate=_mean(fams, "prefix_rate_v0"),
        waiting_deferred=_total(fams, "waiting_by_reason", reason="deferred"),
    )


# ---- SGLang (`sglang:` and `sglang_`) -----------------------------------------------------


def _sglang_wanted(p: str) -> dict[str, str]:
    return _wire(
        {
            f"{p}num_running_reqs": "running",
            f"{p}num_queue_reqs": "waiting",
            f"{p}token_usage": "kv",
            f"{p}num_used_tokens": "used_tokens",
            f"{p}max_total_num_tokens": "max_tokens",
            f"{p}gen_throughput": "gen_tps",
            f"{p}cache_hit_rate": "prefix_rate",
            **_hist(f"{p}time_to_first_token_seconds", "ttft"),
            **_hist(f"{p}inter_token_latency_seconds", "itl"),
        },
        (
            (f"{p}prompt_tokens", "prompt_tokens"),
            (f"{p}generation_tokens", "generation_tokens"),
            (f"{p}cached_tokens", "cached_tokens"),
            (f"{p}realtime_tokens", "realtime_tokens"),
        ),
    )


# Labels that tell apart the ranks of one data-parallel group (SGLang's scheduler labels).
_RANK_LABELS = frozenset(("tp_rank", "pp_rank", "moe_ep_rank"))
# Without a dp_rank label the TP rank is what tells the groups apart (see _one_report_per_group).
_RANK_LABELS_NO_DP = frozenset(("pp_rank", "moe_ep_rank"))


def _rank_order(labels: dict[str, str]) -> tuple[int, int]:
    try:
        return int(labels.get("pp_rank", "0")), int(labels.get("tp_rank", "0"))
    except ValueError:
        return 0, 0


def _one_report_per_group(fams: Families, layout: RankLayout | None = None) -> Families:
    """One report per data-parallel group: the lowest (pp_rank, tp_rank) of the series that
    differ only in the labels of ranks within a group. By default only a group's first attention
    rank (attn_tp_rank 0) writes scheduler metrics; with --enable-metrics-for-all-schedulers every
    rank (and pipeline stage) writes its group's numbers again, counted once here.

    Which labels tell the groups apart depends on how SGLang launched them (checked against its
    scheduler and data_parallel_controller): plain data parallelism hands each group's schedulers
    their `dp_rank`, a label (since SGLang added rank labels, mid-2025), and within it the TP
    ranks repeat one group. --enable-dp-attention launches every rank as one TP group with no
    dp_rank (None, so no label): group k reports from tp_rank k * tp/dp, so there the TP rank is
    the group. Keeping tp_rank 0 alone read one attention group of dp (1/8 of a --tp 8 --dp 8
    DeepSeek's requests and pool). Pages from before the rank labels have one series per family
    (every group writes it, the last write shows): nothing to tell apart there.

    Without a dp_rank label the page alone is ambiguous: plain TP with
    --enable-metrics-for-all-schedulers writes the labels dp-attention groups write, and was
    counted tp_size times. The worker's `layout` (its server info, sglang_info.py) says which
    TP ranks share a group; without it, every TP rank is taken as a group of its own."""
    out: Families = {}
    for key, samples in fams.items():
        first: dict[tuple[frozenset[tuple[str, str]], str], tuple[tuple[int, int], Sample]] = {}
        for sample in samples:
            labels = sample[0]
            # The layout's group of a TP rank agrees with dp_rank where both exist (plain data
            # parallelism: one group per dp_rank, whatever the TP rank).
            ranks = _RANK_LABELS if layout is not None or "dp_rank" in labels else _RANK_LABELS_NO_DP
            in_group = layout.group_of(labels.get("tp_rank")) if layout is not None else ""
            group = (frozenset(kv for kv in labels.items() if kv[0] not in ranks), in_group)
            order = _rank_order(labels)
            held = first.get(group)
            if held is None or order < held[0]:
                first[group] = (order, sample)
        out[key] = [sample for _, sample in first.values()]
    return out


def _sglang(fams: Families, layout: RankLayout | None = None) -> RawSample:
    fams = _one_report_per_group(fams, layout)
    kv = _mean(fams, "kv")
    used, cap = _total(fams, "used_tokens"), _total(fams, "max_tokens")
    if kv is None and used is not None and cap:
        kv = used / cap
    c = _Counters()
    realtime = fams.get("realtime_tokens")
    if realtime:
        # Updated every log interval, unlike the request-end counters: the better rate source.
        c.put("prompt_tokens", [s for s in realtime if s[0].get("mode", "").startswith("prefill")])
        c.put("prompt_tokens_computed", _samples(fams, "realtime_tokens", mode="prefill_compute"))
        c.put("generation_tokens", _samples(fams, "realtime_tokens", mode="decode"))
    else:
        c.put("prompt_tokens", _samples(fams, "prompt_tokens"))
        c.put("generation_tokens", _samples(fams, "generation_tokens"))
    # Prefix hits as cached/prompt, both counted at request end.
    c.put("prefix_hits", _samples(fams, "cached_tokens"))
    c.put("prefix_queries", _samples(fams, "prompt_tokens"))
    for key in ("ttft_sum", "ttft_count", "itl_sum", "itl_count"):
        c.put(key, _samples(fams, key))
    return RawSample(
        counters=c.totals,
        counter_series=c.series,
        running=_total(fams, "running"),
        waiting=_total(fams, "waiting"),
        kv_usage=kv,
        # SGLang's pool is counted in tokens: a "block" of one token.
        block_size=1 if cap else None,
        num_blocks=int(cap) if cap else None,
        gen_tps=None if realtime else _total(fams, "gen_tps"),
        prefix_hit_rate=_mean(fams, "prefix_rate"),
    )


# ---- HuggingFace TGI ----------------------------------------------------------------------

_TGI = _wire(
    {
        "tgi_batch_current_size": "running",
        "tgi_queue_size": "waiting",
        "tgi_batch_current_max_tokens": "used_tokens",
        "tgi_request_input_length_sum": "prompt_tokens",
        "tgi_request_generated_tokens_sum": "generation_tokens",
        **_hist("tgi_request_mean_time_per_token_duration", "itl"),
    }
)


def _tgi(fams: Families) -> RawSample:
    c = _Counters()
    for key in ("prompt_tokens", "generation_tokens", "itl_sum", "itl_count"):
        c.put(key, _samples(fams, key))
    # TGI has no KV-usage gauge and no TTFT histogram. The tokens its running batch reserves
    # become a usage once the scraper has read the pool size from TGI's /info.
    return RawSample(running=_total(fams, "running"), waiting=_total(fams, "waiting"),
                     used_tokens=_total(fams, "used_tokens"), counters=c.totals, counter_series=c.series)


# ---- Triton core, and TensorRT-LLM on Triton ----------------------------------------------

# The key of a series that says a more specific dialect applies (Dialect.outranked_by).
OUTRANKED = "outranked"

_TRITON = {
    "nv_inference_pending_request_count": "pending",
    "nv_inference_first_response_histogram_ms_sum": "ttft_ms_sum",
    "nv_inference_first_response_histogram_ms_count": "ttft_count",
}


def _triton(fams: Families) -> RawSample:
    c = _Counters()
    c.put("ttft_sum", _samples(fams, "ttft_ms_sum"), scale=1e-3)  # ms -> s
    c.put("ttft_count", _samples(fams, "ttft_count"))
    # Triton core has no running gauge: only the queue is known.
    return RawSample(running=0.0, waiting=_total(fams, "pending"), counters=c.totals, counter_series=c.series)


_TRTLLM = {
    **_TRITON,
    "nv_trt_llm_request_metrics": "requests",
    "nv_trt_llm_kv_cache_block_metrics": "kv_blocks",
    "nv_llm_input_token_len_sum": "prompt_tokens",
    "nv_llm_output_token_len_sum": "generation_tokens",
}


def _trtllm_pool(fams: Families) -> tuple[float | None, int | None, int | None]:
    """(KV usage, tokens per block, blocks) over every TensorRT-LLM model on the server.

    Each model (`model`, `version` labels) has its own pool: a draft model next to the target
    (speculative decoding), or two LLMs on one Triton. Their usage fractions and block sizes do
    not add up (summed, two half-full pools read as full, and 64-token blocks as 128); the pools
    do, so usage is the blocks used over the blocks there are, and pools of different block sizes
    are counted in tokens (a block of one token)."""
    models: dict[tuple[str, str], dict[str, float]] = {}
    for labels, value in fams.get("kv_blocks", ()):
        kind = labels.get("kv_cache_block_type")
        if kind is not None:
            models.setdefault((labels.get("model", ""), labels.get("version", "")), {})[kind] = value
    pools: list[tuple[float, float, float | None]] = []  # (fraction used, blocks, tokens per block)
    for pool in models.values():
        blocks = pool.get("max")
        if not blocks:
            continue
        fraction = pool.get("fraction")
        if fraction is None and pool.get("used") is not None:
            fraction = pool["used"] / blocks  # older builds lack `fraction`
        if fraction is not None:
            pools.append((fraction, blocks, pool.get("tokens_per") or None))
    if not pools:
        return None, None, None
    sizes = {size for _, _, size in pools}
    blocks = sum(b for _, b, _ in pools)
    if None in sizes:  # a pool's size in tokens unknown: usage weighted by blocks, no block size
        return sum(f * b for f, b, _ in pools) / blocks, None, int(blocks)
    if len(sizes) == 1:
        return sum(f * b for f, b, _ in pools) / blocks, int(sizes.pop()), int(blocks)
    tokens = sum(b * s for _, b, s in pools)
    return sum(f * b * s for f, b, s in pools) / tokens, 1, int(tokens)


def _is_draft(labels: dict[str, str]) -> bool:
    """A draft model of TensorRT-LLM's draft-target speculative decoding on Triton. The BLS model
    (tensorrt_llm_bls, `tensorrt_llm_draft_model_name`) sends every request to the draft model and
    then to the target, round after round; NVIDIA's model repository, scripts and docs name the
    draft `tensorrt_llm_draft`. The page says nothing else about which model drafts, so the name
    is the one sign there is."""
    return "draft" in labels.get("model", "").lower()


def _served(samples: list[Sample]) -> list[Sample]:
    """The samples of the models that serve requests: a draft model's are the target's requests
    again (summed, each request ran twice and its prompt was counted at every draft round). A page
    of draft-named models only is taken whole: better a draft's count than none."""
    served = [s for s in samples if not _is_draft(s[0])]
    return served or samples


def _trtllm(fams: Families) -> RawSample:
    # Each request once: the draft model's request counts and token histograms repeat the
    # target's (its KV pool is still memory in use, and _trtllm_pool keeps it).
    fams = {**fams, **{key: _served(fams[key]) for key in
                       ("requests", "pending", "prompt_tokens", "generation_tokens") if key in fams}}
    waiting = _total(fams, "requests", request_type="waiting")
    if waiting is None:
        waiting = _total(fams, "pending")
    kv, block_size, num_blocks = _trtllm_pool(fams)
    c = _Counters()
    c.put("prompt_tokens", _samples(fams, "prompt_tokens"))
    c.put("generation_tokens", _samples(fams, "generation_tokens"))
    return RawSample(
        counters=c.totals,
        counter_series=c.series,
        running=_total(fams, "requests", request_type="active"),
        waiting=waiting,
        kv_usage=kv,
        block_size=block_size,
        num_blocks=num_blocks,
    )


# ---- BladeLLM (names unverified, metrics-reference.md section 8) ---------------------------

_BLADE = {
    "decode_batch_size_mean": "running",
    "wait_queue_size_mean": "waiting",
    "block_usage_gpu_mean": "kv",
    "tps_total": "tps_total",
    "tps_out": "tps_out",
}


def _blade(fams: Families) -> RawSample:
    total, out = _total(fams, "tps_total"), _total(fams, "tps_out")
    kv = _mean(fams, "kv")
    if kv is not None and kv > 1.0:  # tolerate a percent
        kv /= 100.0
    return RawSample(
        running=_total(fams, "running"),
        waiting=_total(fams, "waiting"),
        kv_usage=kv,
        prompt_tps=max(0.0, total - out) if total is not None and out is not None else None,
        gen_tps=out,
    )


VLLM_V1 = Dialect("vllm_v1", _VLLM, _vllm, names_filter=True)
VLLM_V0 = Dialect("vllm_v0", _VLLM, _vllm, names_filter=True)
TRITON_VLLM = Dialect("triton_vllm", _VLLM, _vllm)  # Triton's own metrics server
SGLANG_COLON = Dialect("sglang", _sglang_wanted("sglang:"), _sglang, names_filter=True, ranked=True)
SGLANG_UNDERSCORE = Dialect("sglang_", _sglang_wanted("sglang_"), _sglang, names_filter=True, ranked=True)
TGI = Dialect("tgi", _TGI, _tgi)
TRTLLM = Dialect("trtllm", _TRTLLM, _trtllm)
# Triton's core metrics are there from start-up, its LLM backend's only once that model has loaded
# (minutes for a TensorRT-LLM engine, after the ensemble's small models): a page read as plain
# Triton before then must be read as the backend's when its series come.
_TRITON_BACKENDS = ("nv_trt_llm_request_metrics", "vllm:num_requests_running", "vllm:num_requests_waiting")
TRITON = Dialect("triton", {**_TRITON, **dict.fromkeys(_TRITON_BACKENDS, OUTRANKED)}, _triton,
                 outranked_by=_TRITON_BACKENDS)
BLADELLM = Dialect("bladellm", _BLADE, _blade)

DIALECTS = {
    d.name: d
    for d in (VLLM_V1, VLLM_V0, TRITON_VLLM, SGLANG_COLON, SGLANG_UNDERSCORE, TGI, TRTLLM, TRITON, BLADELLM)
}


def detect(text: str) -> Dialect | None:
    """The dialect of one /metrics text, from the series it exposes (None: unknown)."""
    names = series_names(text)
    if "vllm:num_requests_running" in names or "vllm:num_requests_waiting" in names:
        if "vllm:kv_cache_usage_perc" in names:
            return VLLM_V1
        if label_present(text, "vllm:num_requests_running", "version"):
            return TRITON_VLLM
        return VLLM_V0
    if "sglang:num_running_reqs" in names or "sglang:num_queue_reqs" in names:
        return SGLANG_COLON
    if "sglang_num_running_reqs" in names or "sglang_num_queue_reqs" in names:
        return SGLANG_UNDERSCORE
    if "tgi_queue_size" in names or "tgi_batch_current_size" in names:
        return TGI
    if "nv_trt_llm_request_metrics" in names:
        return TRTLLM
    if "nv_inference_pending_request_count" in names:
        return TRITON
    if "wait_queue_size_mean" in names or "decode_batch_size_mean" in names:
        return BLADELLM
    return None
