"""The benchmark client against a stand-in OpenAI-compatible streaming server (see openai_standin.py)."""

import asyncio
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from benchmarks import datasets
from benchmarks.serve import arrival_offsets, run_benchmark
from tests.bench.openai_standin import FIRST_TOKEN_DELAY, MODEL, TOKEN_DELAY, WORD, start_standin

REPO = Path(__file__).resolve().parents[2]
VLLM_KEYS = [
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls", "errors",
] + [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")]


def workload(n, prompt="p", base_out=3):
    return [datasets.SampleRequest(f"{prompt} {i}", 10 + i, base_out + i % 5, str(i)) for i in range(n)]


@pytest.fixture
async def standin():
    server, runner = await start_standin()
    yield server
    await runner.cleanup()


async def test_completions_run_counts_add_up(standin):
    reqs = workload(20)
    result = await run_benchmark(standin.url, MODEL, workload=reqs, max_concurrency=4, show_progress=False,
                                 print_summary=False, metric_percentiles=[50, 99])
    for key in [*VLLM_KEYS, "p50_ttft_ms", "tpots", "e2els", "start_times"]:
        assert key in result, key
    assert result["completed"] == 20 and result["failed"] == 0 and result["errors"] == [""] * 20
    assert result["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert result["output_lens"] == [r.expected_output_len for r in reqs]
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in reqs)
    assert result["request_throughput"] == pytest.approx(20 / result["duration"])
    for r, itl, ttft, e2el, tpot in zip(reqs, result["itls"], result["ttfts"], result["e2els"],
                                        result["tpots"], strict=True):
        assert len(itl) == r.expected_output_len - 1  # one chunk per token; the first is TTFT
        # lower bounds the server's sleeps guarantee (single gaps may shrink through buffering)
        assert ttft >= FIRST_TOKEN_DELAY and e2el >= FIRST_TOKEN_DELAY + TOKEN_DELAY * len(itl)
        assert ttft + sum(itl) == pytest.approx(e2el)
        assert tpot == pytest.approx(sum(itl) / (r.expected_output_len - 1))
    # what the server received: vLLM's benchmark payload
    assert len(standin.requests) == 20 and 2 <= standin.max_active <= 4
    for seen in standin.requests:
        assert seen.body["stream"] is True and seen.body["ignore_eos"] is True
        assert seen.body["stream_options"] == {"include_usage": True}
    sent_max_tokens = sorted(s.body["max_tokens"] for s in standin.requests)
    assert sent_max_tokens == sorted(r.expected_output_len for r in reqs)


async def test_chat_without_usage_counts_text_tokens_and_skips_role_chunk():
    server, runner = await start_standin(send_usage=False)
    try:
        reqs = workload(6, base_out=4)
        result = await run_benchmark(server.url, MODEL, endpoint="chat", workload=reqs, show_progress=False,
                                     print_summary=False)
    finally:
        await runner.cleanup()
    assert result["backend"] == "openai-chat" and result["completed"] == 6
    tok = datasets.load_tokenizer()
    for r, out_len, itl in zip(reqs, result["output_lens"], result["itls"], strict=True):
        assert out_len == len(tok(WORD * r.expected_output_len, add_special_tokens=False).input_ids)
        assert len(itl) == r.expected_output_len - 1  # the role-only chunk is not a token
    assert all(s.body["messages"][0]["role"] == "user" for s in server.requests)


async def test_start_times_are_seconds_since_the_run_began(standin):
    result = await run_benchmark(standin.url, MODEL, workload=workload(6), max_concurrency=1,
                                 show_progress=False, print_summary=False)
    starts, e2els = result["start_times"], result["e2els"]
    assert 0 <= starts[0] and starts[-1] + e2els[-1] <= result["duration"]
    for i in range(5):  # one at a time: each starts after the previous one ended
        assert starts[i + 1] >= starts[i] + e2els[i]


async def test_failed_requests_are_counted_with_their_errors(standin):
    reqs = workload(6) + workload(3, prompt="FAIL")
    result = await run_benchmark(standin.url, MODEL, workload=reqs, show_progress=False, print_summary=False)
    assert result["completed"] == 6 and result["failed"] == 3
    assert result["errors"][6:] == ["HTTP 400: prompt rejected by the stand-in"] * 3
    assert result["total_input_tokens"] == sum(r.prompt_len for r in reqs[:6])
    assert result["output_lens"][6:] == [0, 0, 0]
    # A request the server refused was still sent during the run: its start time is seconds
    # since the run began like any other (reports take min(start_times) as the run's start).
    assert all(0 <= s <= result["duration"] for s in result["start_times"])
    wrong_model = await run_benchmark(standin.url, "nope", workload=workload(2), show_progress=False,
                                      print_summary=False)
    assert wrong_model["failed"] == 2 and "does not exist" in wrong_model["errors"][0]
    refused = await run_benchmark("http://127.0.0.1:9", MODEL, workload=workload(2), show_progress=False,
                                  print_summary=False)
    assert refused["failed"] == 2 and refused["errors"][0].startswith("Client")


async def test_deadline_stops_cleanly_and_keeps_finished_requests(standin):
    reqs = workload(4) + workload(3, prompt="HANG") + workload(20)
    result = await run_benchmark(standin.url, MODEL, workload=reqs, max_concurrency=7, deadline=1.0,
                                 show_progress=False, print_summary=False)
    assert result["stopped"] == "deadline"
    assert result["completed"] >= 4 and result["failed"] == 3  # the three hanging ones were in flight
    assert sorted(e for e in result["errors"] if e) == ["deadline"] * 3
    assert result["num_requests_sent"] == result["completed"] + result["failed"] <= len(reqs)


async def test_request_timeout_fails_only_the_slow_request(standin):
    reqs = workload(2, prompt="HANG") + workload(3)
    result = await run_benchmark(standin.url, MODEL, workload=reqs, request_timeout=0.5, show_progress=False,
                                 print_summary=False)
    assert result["completed"] == 3 and result["failed"] == 2 and result["stopped"] is None
    assert all(e.startswith("timeout") for e in result["errors"][:2])


async def test_time_scale_divides_measured_durations(standin):
    reqs = workload(5)
    scale = 50.0
    t0 = time.perf_counter()
    result = await run_benchmark(standin.url, MODEL, workload=reqs, time_scale=scale, show_progress=False,
                                 print_summary=False)
    wall = time.perf_counter() - t0
    assert result["duration"] * scale <= wall
    for r, e2el, ttft in zip(reqs, result["e2els"], result["ttfts"], strict=True):
        # the server sleeps at least this long per request, in wall time
        assert e2el * scale >= FIRST_TOKEN_DELAY + TOKEN_DELAY * (r.expected_output_len - 1)
        assert ttft * scale >= FIRST_TOKEN_DELAY
        assert e2el * scale <= wall


def test_arrival_offsets_follow_vllm():
    assert arrival_offsets(5, float("inf"), 1.0, 0) == [0.0] * 5
    poisson = arrival_offsets(200, 4.0, 1.0, seed=3)
    assert poisson == arrival_offsets(200, 4.0, 1.0, seed=3)
    assert poisson[-1] == pytest.approx(200 / 4.0) and all(b >= a for a, b in itertools.pairwise(poisson))
    assert arrival_offsets(4, 2.0, float("inf"), 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    gaps = [b - a for a, b in itertools.pairwise([0.0, *poisson])]
    bursty = arrival_offsets(200, 4.0, 0.2, seed=3)
    bursty_gaps = [b - a for a, b in itertools.pairwise([0.0, *bursty])]
    # same mean gap, more variance when burstier
    assert sum(bursty_gaps) == pytest.approx(sum(gaps))
    assert max(bursty_gaps) > max(gaps)


async def test_request_rate_spaces_arrivals_in_scaled_time(standin):
    reqs = workload(6)
    offsets = arrival_offsets(6, 20.0, 1.0, seed=0)
    await run_benchmark(standin.url, MODEL, workload=reqs, request_rate=20.0, time_scale=2.0,
                        show_progress=False, print_summary=False)
    arrivals = sorted(s.arrived for s in standin.requests)
    assert arrivals[-1] - arrivals[0] >= (offsets[-1] - offsets[0]) * 2.0 * 0.95


async def test_several_base_urls_are_used_round_robin(standin):
    other, runner = await start_standin()
    try:
        result = await run_benchmark([standin.url, other.url], MODEL, workload=workload(10),
                                     show_progress=False, print_summary=False)
    finally:
        await runner.cleanup()
    assert result["completed"] == 10 and len(standin.requests) == 5 and len(other.requests) == 5


async def test_multiturn_replays_turns_in_order_with_growing_history(standin):
    convs = []
    for c in range(4):
        turns = [datasets.Turn(f"question {c}.{t}", f"answer {c}.{t}", 5 + 10 * t, 3 + t) for t in range(3)]
        convs.append(datasets.Conversation(str(c), turns))
    result = await run_benchmark(standin.url, MODEL, dataset="sharegpt-multiturn", workload=convs,
                                 max_concurrency=2, show_progress=False, print_summary=False)
    assert result["completed"] == 12 and standin.max_active <= 2
    assert result["turn_indices"] == [0, 1, 2] * 4
    assert result["conversation_ids"] == [0] * 3 + [3] * 3 + [6] * 3 + [9] * 3
    assert result["input_lens"] == [5, 15, 25] * 4
    by_conv: dict[str, list] = {}
    for seen in standin.requests:
        by_conv.setdefault(seen.body["prompt"].split("question ")[1][0], []).append(seen)
    for c, seen in by_conv.items():
        prompts = [s.body["prompt"] for s in seen]
        assert [p.count("User:") for p in prompts] == [1, 2, 3]
        assert prompts[1].startswith(prompts[0][: -len("Assistant:")])
        assert f"Assistant: answer {c}.0" in prompts[1]
        for earlier, later in itertools.pairwise(seen):
            assert later.arrived >= earlier.finished  # next turn only after the previous one finished

    chat = await run_benchmark(standin.url, MODEL, dataset="sharegpt-multiturn", endpoint="chat",
                               workload=convs[:1], show_progress=False, print_summary=False)
    assert chat["completed"] == 3
    assert [len(s.body["messages"]) for s in standin.requests[-3:]] == [1, 3, 5]


async def test_multiturn_conversations_can_name_themselves_in_a_session_header(standin):
    """For a gateway's --session-header: each conversation's turns carry one value of their own."""
    convs = [datasets.Conversation(str(c), [datasets.Turn(f"q {c}.{t}", f"a {c}.{t}", 5, 3)
                                            for t in range(3)]) for c in range(3)]
    result = await run_benchmark(standin.url, MODEL, dataset="sharegpt-multiturn", workload=convs,
                                 max_concurrency=3, show_progress=False, print_summary=False,
                                 session_header="x-session-id")
    assert result["completed"] == 9 and result["session_header"] == "x-session-id"
    by_conv: dict[str, set] = {}
    for seen in standin.requests:
        by_conv.setdefault(seen.body["prompt"].split("q ")[1][0], set()).add(seen.headers.get("x-session-id"))
    assert all(len(values) == 1 and None not in values for values in by_conv.values()), by_conv
    assert len(set.union(*by_conv.values())) == 3
    await run_benchmark(standin.url, MODEL, dataset="sharegpt-multiturn", workload=convs[:1],
                        show_progress=False, print_summary=False)
    assert all("x-session-id" not in s.headers for s in standin.requests[-3:])  # off by default


async def _cli(args, standin_url, interrupt_after_requests=None, server=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.serve", "--base-url", standin_url, "--model", MODEL, *args,
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    if interrupt_after_requests is not None:
        for _ in range(600):
            if len(server.requests) >= interrupt_after_requests:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    return proc.returncode, out.decode(), err.decode()


async def test_cli_samples_sharegpt_prints_summary_and_saves_json(standin, tmp_path):
    out_file = tmp_path / "out.json"
    rc, out, err = await _cli(["--num-prompts", "12", "--max-concurrency", "4", "--seed", "0",
                               "--metric-percentiles", "50,99", "--save-result", str(out_file)],
                              standin.url)
    assert rc == 0, err
    assert "============ Serving Benchmark Result ============" in out
    assert "Maximum request concurrency:" in out and "P50 TTFT (ms):" in out and "Mean E2EL (ms):" in out
    saved = json.loads(out_file.read_text())
    assert saved["completed"] == 12 and saved["num_prompts"] == 12 and saved["request_rate"] == "inf"
    assert all(4 <= n <= 1024 for n in saved["input_lens"])
    # max_tokens is the ShareGPT reference output length, and the server produced exactly that
    assert sorted(s.body["max_tokens"] for s in standin.requests) == sorted(saved["output_lens"])


async def test_cli_ctrl_c_stops_and_still_reports(standin, tmp_path):
    out_file = tmp_path / "out.json"
    # Every request hangs after its first token; Ctrl-C must still end the run with a report.
    rc, out, err = await _cli(["--num-prompts", "6", "--max-concurrency", "3", "--save-result", str(out_file),
                               "--disable-tqdm", "--extra-body", '{"prompt": "HANG"}'],
                              standin.url, interrupt_after_requests=3, server=standin)
    assert "Serving Benchmark Result" in out, err
    saved = json.loads(out_file.read_text())
    assert saved["stopped"] == "interrupted" and saved["failed"] == 3 and saved["completed"] == 0
    assert rc == 1  # nothing completed
