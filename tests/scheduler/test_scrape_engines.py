"""Engine pages the hand-written fixtures do not cover: deployments whose ranks, models or
start-up order change what one /metrics page holds (checked against the engines' sources,
metrics-reference.md sections 3-7)."""

from __future__ import annotations

from pathlib import Path

from scheduler.config import SchedulerConfig
from scheduler.discovery.static import add_static_workers
from scheduler.registry import WorkerState
from scheduler.scrape import dialects
from scheduler.scrape.parse import parse_selected
from scheduler.scrape.scraper import Scraper
from scheduler.scrape.snapshot import RawSample
from scheduler.service import SchedulerService

FIXTURES = Path(__file__).parent / "fixtures"


def read(dialect: dialects.Dialect, text: str) -> RawSample:
    return dialect.extract(parse_selected(text, dialect.wanted))


def _sglang_page(rows: list[tuple[int, int, int, float, float, float]]) -> str:
    """SGLang gauges, one row per reporting scheduler: (tp_rank, pp_rank, dp_rank, running,
    queued, token_usage)."""
    lines = []
    for name, col in (("num_running_reqs", 3), ("num_queue_reqs", 4), ("token_usage", 5)):
        lines.append(f"# TYPE sglang:{name} gauge")
        for row in rows:
            tp, pp, dp = row[:3]
            labels = f'model_name="ds",engine_type="unified",tp_rank="{tp}",pp_rank="{pp}",dp_rank="{dp}"'
            lines.append(f"sglang:{name}{{{labels}}} {row[col]}")
    return "\n".join(lines) + "\n"


def test_sglang_dp_attention_groups_are_summed_whatever_their_tp_rank():
    """Groups told apart by dp_rank are summed whichever TP rank reports for each (by default
    only a group's attn_tp_rank 0 writes scheduler metrics). Reading tp_rank 0 alone saw half the
    requests and half the pool. (SGLang writes dp_rank for plain data parallelism; dp-attention
    pages have none: test_sglang_dp_attention_groups_without_a_dp_rank_label_are_summed.)"""
    raw = read(dialects.SGLANG_COLON, _sglang_page([(0, 0, 0, 7, 2, 0.5), (2, 0, 1, 5, 1, 0.3)]))
    assert (raw.running, raw.waiting) == (12.0, 3.0)
    assert raw.kv_usage == 0.4


def test_sglang_ranks_that_repeat_their_group_are_counted_once():
    """--enable-metrics-for-all-schedulers: every TP rank (and, with pipeline parallelism, every
    stage) reports its group's numbers again; one report per data-parallel group counts."""
    rows = [(0, 0, 0, 7, 2, 0.5), (1, 0, 0, 7, 2, 0.5), (0, 1, 0, 7, 2, 0.5), (1, 1, 0, 7, 2, 0.5),
            (2, 0, 1, 5, 1, 0.3), (3, 0, 1, 5, 1, 0.3)]
    raw = read(dialects.SGLANG_COLON, _sglang_page(rows))
    assert (raw.running, raw.waiting) == (12.0, 3.0)
    assert raw.kv_usage == 0.4


def _sglang_page_without_dp_rank(rows: list[tuple[int, int, float, float, float]]) -> str:
    """SGLang gauges as --enable-dp-attention writes them: (tp_rank, pp_rank, running, queued,
    token_usage) per reporting scheduler, no dp_rank label (the data-parallel controller launches
    dp-attention ranks as one TP group, dp_rank None)."""
    lines = []
    for name, col in (("num_running_reqs", 2), ("num_queue_reqs", 3), ("token_usage", 4)):
        lines.append(f"# TYPE sglang:{name} gauge")
        for tp, pp, *values in rows:
            labels = (f'model_name="ds",engine_type="unified",tp_rank="{tp}",pp_rank="{pp}",'
                      f'moe_ep_rank="{tp}"')
            lines.append(f"sglang:{name}{{{labels}}} {values[col - 2]}")
    return "\n".join(lines) + "\n"


def test_sglang_dp_attention_groups_without_a_dp_rank_label_are_summed():
    """--tp 4 --dp 2 --enable-dp-attention: each attention group's first rank reports, tp_rank 0
    for the first group and tp_rank 2 for the second, with no dp_rank label. The groups differed
    only in rank labels, so the lowest rank alone was read: half the requests and half the pool.
    (--tp 2 --dp 2: every rank is a group of its own.)"""
    raw = read(dialects.SGLANG_COLON, _sglang_page_without_dp_rank([(0, 0, 7, 2, 0.5), (2, 0, 5, 1, 0.3)]))
    assert (raw.running, raw.waiting) == (12.0, 3.0)
    assert raw.kv_usage == 0.4
    raw = read(dialects.SGLANG_COLON, _sglang_page_without_dp_rank([(0, 0, 7, 2, 0.5), (1, 0, 5, 1, 0.3)]))
    assert (raw.running, raw.waiting) == (12.0, 3.0)
    # Pipeline stages still repeat their group's numbers, counted once.
    rows = [(0, 0, 7, 2, 0.5), (0, 1, 7, 2, 0.5), (2, 0, 5, 1, 0.3), (2, 1, 5, 1, 0.3)]
    raw = read(dialects.SGLANG_COLON, _sglang_page_without_dp_rank(rows))
    assert (raw.running, raw.waiting) == (12.0, 3.0)


def _trtllm_page(pools: dict[str, tuple[int, int, int, float]]) -> str:
    """A Triton page with one TensorRT-LLM pool per model: (max, used, tokens_per, fraction)."""
    lines = ["# TYPE nv_trt_llm_request_metrics gauge"]
    for model in pools:
        lines.append(f'nv_trt_llm_request_metrics{{model="{model}",request_type="active",version="1"}} 2')
    lines.append("# TYPE nv_trt_llm_kv_cache_block_metrics gauge")
    for model, (max_blocks, used, tokens_per, fraction) in pools.items():
        for kind, value in (("max", max_blocks), ("free", max_blocks - used), ("used", used),
                            ("tokens_per", tokens_per), ("fraction", fraction)):
            lines.append(f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="{kind}",'
                         f'model="{model}",version="1"}} {value}')
    return "\n".join(lines) + "\n"


def test_trtllm_pools_of_several_models_are_pooled_not_their_fractions_summed():
    """A target and a draft model on one Triton (the backend's speculative-decoding setup): each
    reports its own pool. Summed, 0.4 + 0.3 read as 0.7 used and 64-token blocks as 128."""
    page = _trtllm_page({"tensorrt_llm": (4000, 1600, 64, 0.4), "tensorrt_llm_draft": (2000, 600, 64, 0.3)})
    raw = read(dialects.TRTLLM, page)
    assert raw.kv_usage == (1600 + 600) / 6000
    assert (raw.block_size, raw.num_blocks) == (64, 6000)


def _trtllm_models_page(models: dict[str, tuple[int, int, int, int]]) -> str:
    """Request gauges and token histograms per model: (active, waiting, input tokens, output
    tokens), as the TensorRT-LLM backend reports each of its models."""
    lines = ["# TYPE nv_trt_llm_request_metrics gauge"]
    for model, (active, waiting, _, _) in models.items():
        for kind, value in (("active", active), ("waiting", waiting)):
            labels = f'model="{model}",request_type="{kind}",version="1"'
            lines.append(f"nv_trt_llm_request_metrics{{{labels}}} {value}")
    for family, col, kind in (("input", 2, "total_input_tokens"), ("output", 3, "total_output_tokens")):
        lines.append(f"# TYPE nv_llm_{family}_token_len histogram")
        for model, row in models.items():
            lines.append(f'nv_llm_{family}_token_len_sum{{model="{model}",response_metric_type="{kind}",'
                         f'version="1"}} {row[col]}')
    return "\n".join(lines) + "\n"


def test_trtllm_draft_model_requests_are_the_targets_counted_once():
    """Draft-target speculative decoding on Triton: tensorrt_llm_bls sends each request to the
    draft model (tensorrt_llm_draft) and to the target, so both report it active; summed, the
    worker showed twice its running requests and queue, and every draft round's prompt as prompt
    tokens. The target's counts are the requests."""
    page = _trtllm_models_page({"tensorrt_llm": (3, 1, 6000, 900),
                                "tensorrt_llm_draft": (3, 1, 25000, 2400)})
    raw = read(dialects.TRTLLM, page)
    assert (raw.running, raw.waiting) == (3.0, 1.0)
    assert (raw.counters["prompt_tokens"], raw.counters["generation_tokens"]) == (6000.0, 900.0)
    # Two LLMs served side by side are two sets of requests: those still add up.
    raw = read(dialects.TRTLLM, _trtllm_models_page({"llama": (3, 1, 6000, 900), "qwen": (2, 0, 100, 50)}))
    assert (raw.running, raw.waiting, raw.counters["prompt_tokens"]) == (5.0, 1.0, 6100.0)


def test_trtllm_pools_of_different_block_sizes_are_counted_in_tokens():
    page = _trtllm_page({"a": (1000, 500, 64, 0.5), "b": (1000, 0, 32, 0.0)})
    raw = read(dialects.TRTLLM, page)
    assert (raw.block_size, raw.num_blocks) == (1, 1000 * 64 + 1000 * 32)
    assert raw.kv_usage == 500 * 64 / (1000 * 64 + 1000 * 32)


def _ingested(pages: list[str]) -> WorkerState:
    """A worker that served these /metrics pages, one per scrape, as the scraper read them."""
    svc = SchedulerService(SchedulerConfig())
    (w,) = add_static_workers(svc, ["http://127.0.0.1:9"])
    scraper = Scraper(svc)
    for i, page in enumerate(pages):
        scraper._ingest(w, page, float(i))
    return w


def test_triton_whose_llm_backend_loads_after_the_first_scrape_is_read_as_that_backend():
    """Triton serves /metrics from start-up, and an ensemble's small Python models load in
    seconds while the TensorRT-LLM engine takes minutes: the first pages show only Triton core's
    pending counts. Detected then as plain Triton (no running gauge, no KV), the worker stayed so
    for good, as Triton's reading never lacks its queue; the backend's series must win."""
    head = "# TYPE nv_inference_pending_request_count gauge\n"
    small = ('nv_inference_pending_request_count{model="preprocessing",version="1"} 0\n'
             'nv_inference_pending_request_count{model="postprocessing",version="1"} 0\n')
    early = head + small

    def loaded(fixture: str) -> str:
        text = (FIXTURES / fixture).read_text()
        assert head in text
        return text.replace(head, early)

    w = _ingested([early, loaded("trtllm.txt")])
    assert w.dialect == "trtllm"
    assert (w.snapshot.running, w.snapshot.kv_usage, w.snapshot.block_size) == (9.0, 0.25, 64)
    # Triton's vLLM backend likewise (its series carry `model` and `version`).
    w = _ingested([early, loaded("triton_vllm.txt")])
    assert w.dialect == "triton_vllm"
    assert (w.snapshot.running, w.snapshot.kv_usage) == (3.0, 0.4)
