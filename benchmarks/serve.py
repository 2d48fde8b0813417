"""Serving benchmark client, measured the way `vllm bench serve` measures.

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --model llama2 \
        --dataset sharegpt --num-prompts 1000 --max-concurrency 160 --seed 0 --save-result out.json

Works against any OpenAI-compatible streaming endpoint (a worker, the
gateway, a real vLLM). Several comma-separated --base-url values are used
round robin per request (the "no router" baseline). Library use:
`await run_benchmark(base_url=..., model=..., ...)` returns the same dict that
--save-result writes.

Time: `--time-scale S` divides every measured duration by S (the sim workers
stretch simulated time by S), and arrival gaps from --request-rate are
multiplied by S, so the results and the rate are in simulated seconds.
--timeout and --deadline are wall-clock limits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks import datasets
from benchmarks.bench_metrics import (
    METRIC_NAMES,
    RequestResult,
    calculate_metrics,
    format_summary,
    per_request_lists,
)
from benchmarks.request_funcs import RequestInput, is_chat_url, stream_request

DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from start) for n arrivals, as vLLM draws them.

    inf rate: everything at 0. Otherwise gamma-distributed gaps with shape
    `burstiness` (1 = Poisson) and mean 1/rate, rescaled so the last arrival
    lands exactly at n / rate.
    """
    if n == 0 or math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    offsets *= (n / request_rate) / offsets[-1]
    return offsets.tolist()


class _Run:
    """State of one benchmark run: sessions, limits, results, in-flight bookkeeping."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        api_urls: list[str],
        model: str,
        max_concurrency: int | None,
        time_scale: float,
        request_timeout: float | None,
        ignore_eos: bool,
        extra_body: dict[str, Any],
        want_text: bool,
        progress,
        session_header: str | None = None,
    ) -> None:
        self.session = session
        self.api_urls = api_urls
        self.model = model
        self.semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.time_scale = time_scale
        self.request_timeout = request_timeout
        self.ignore_eos = ignore_eos
        self.extra_body = extra_body
        self.want_text = want_text
        self.progress = progress
        # Multi-turn: each conversation's requests name it in this header (session affinity).
        self.session_header = session_header
        self.results: dict[int, RequestResult] = {}
        self.stop_reason = ""
        self.t0 = time.perf_counter()
        self._rr = 0
        # unique per run, so ids never collide with a previous run's stragglers
        self.id_prefix = f"bench-{uuid.uuid4().hex[:8]}-"

    def _next_url(self) -> str:
        url = self.api_urls[self._rr % len(self.api_urls)]
        self._rr += 1
        return url

    def _scaled(self, res: RequestResult) -> RequestResult:
        s = self.time_scale
        res.start_time = (res.start_time - self.t0) / s
        if s != 1.0:
            res.ttft /= s
            res.latency /= s
            res.itl = [gap / s for gap in res.itl]
        return res

    async def request(self, index: int, prompt_len: int, max_tokens: int, prompt: str = "",
                      messages: list[dict[str, str]] | None = None,
                      headers: dict[str, str] | None = None) -> RequestResult:
        """Send one request (the caller holds any concurrency slot) and record its result."""
        inp = RequestInput(
            api_url=self._next_url(), model=self.model, prompt_len=prompt_len, max_tokens=max_tokens,
            prompt=prompt, messages=messages, ignore_eos=self.ignore_eos, extra_body=self.extra_body,
            request_id=f"{self.id_prefix}{index}", headers=headers,
        )
        sent = time.perf_counter()
        try:
            res = await stream_request(self.session, inp, self.request_timeout, self.want_text)
        except asyncio.CancelledError:
            # Stopped mid-stream (deadline or Ctrl-C): it was sent, so it counts as failed.
            self.results[index] = self._scaled(RequestResult(
                prompt_len=prompt_len, error=self.stop_reason or "cancelled", start_time=sent))
            raise
        self.results[index] = self._scaled(res)
        if self.progress is not None:
            self.progress.update(1)
        return res

    async def single(self, index: int, req: datasets.SampleRequest, chat: bool) -> None:
        messages = [{"role": "user", "content": req.prompt}] if chat else None
        if self.semaphore is None:
            await self.request(index, req.prompt_len, req.expected_output_len, req.prompt, messages)
            return
        async with self.semaphore:
            await self.request(index, req.prompt_len, req.expected_output_len, req.prompt, messages)

    async def conversation(self, first_index: int, conv: datasets.Conversation, chat: bool) -> None:
        """Replay turns in order; the next turn starts only after the previous one returned."""
        if self.semaphore is not None:
            await self.semaphore.acquire()
        headers = {self.session_header: f"{self.id_prefix}conv{first_index}"} if self.session_header else None
        try:
            for t, turn in enumerate(conv.turns):
                if chat:
                    await self.request(first_index + t, turn.prompt_len, turn.expected_output_len,
                                       messages=conv.messages(t), headers=headers)
                else:
                    await self.request(first_index + t, turn.prompt_len, turn.expected_output_len,
                                       prompt=conv.prompt_text(t), headers=headers)
        finally:
            if self.semaphore is not None:
                self.semaphore.release()


async def _dispatch(start_jobs: Sequence[Callable[[], Any]], offsets: Sequence[float], time_scale: float,
                    tasks: set[asyncio.Task]) -> None:
    t0 = time.perf_counter()
    for job, offset in zip(start_jobs, offsets, strict=True):
        wait = t0 + offset * time_scale - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.add(asyncio.create_task(job()))
    await asyncio.gather(*tasks)


def _tokenizer_cache_key(tokenizer: str | None) -> dict:
    """What a cached sample depends on: the dataset file and the tokenizer's identity."""
    dataset = datasets.sharegpt_path()
    key: dict[str, Any] = {"dataset": str(dataset), "size": dataset.stat().st_size}
    if tokenizer:
        folder = Path(tokenizer).resolve()
        stamps = [f.stat().st_mtime for f in folder.glob("tokenizer*")] if folder.is_dir() else []
        key["tokenizer"] = [str(folder), max(stamps, default=0.0)]
    else:
        key["tokenizer"] = str(datasets.smollm2_gguf())
    return key


def prepare_workload(
    dataset: str, num_prompts: int, seed: int, tokenizer: str | None = None, max_turns: int = 8,
    max_prompt_len: int = datasets.MAX_PROMPT_LEN, max_total_len: int = datasets.MAX_TOTAL_LEN,
) -> tuple[list[datasets.SampleRequest] | list[datasets.Conversation], Any]:
    """Load ShareGPT and sample it (blocking: seconds). Returns (requests or conversations, tokenizer)."""
    tok = datasets.load_tokenizer(tokenizer)
    lengths = datasets.tokenizer_length_fn(tok)
    entries = datasets.load_sharegpt()
    key = _tokenizer_cache_key(tokenizer)
    if dataset == "sharegpt":
        reqs = datasets.sample_sharegpt(entries, lengths, num_prompts, seed, max_prompt_len, max_total_len,
                                        cache_key=key)
        return reqs, tok
    if dataset == "sharegpt-multiturn":
        convs = datasets.sample_sharegpt_multiturn(
            entries, lengths, num_prompts, seed, max_turns=max_turns, max_prompt_len=max_prompt_len,
            max_total_len=max_total_len, cache_key=key)
        return convs, tok
    raise ValueError(f"unknown dataset {dataset!r}: use sharegpt or sharegpt-multiturn")


def write_modes_json(path: str, args: Any, results: dict[str, dict[str, dict]]) -> None:
    """A comparison of modes as JSON: the settings and command line, then each mode's and
    client's result without its per-request lists (megabytes, and no summary reads them)."""
    doc = {"scenario": {**vars(args), "command": " ".join(sys.argv)},
           "modes": {mode: {client: {k: v for k, v in r.items() if not isinstance(v, list)}
                            for client, r in by_client.items()} for mode, by_client in results.items()}}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


async def run_benchmark(
    base_url: str | Sequence[str] | None = None,
    model: str = "",
    *,
    base_urls: Sequence[str] | None = None,
    endpoint: str = "/v1/completions",
    dataset: str = "sharegpt",
    num_prompts: int = 1000,
    max_concurrency: int | None = None,
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    seed: int = 0,
    tokenizer: str | None = None,
    time_scale: float = 1.0,
    percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
    metric_percentiles: Sequence[float] = (99.0,),
    goodput: dict[str, float] | None = None,
    request_timeout: float | None = 1800.0,
    deadline: float | None = None,
    max_turns: int = 8,
    max_prompt_len: int = datasets.MAX_PROMPT_LEN,
    max_total_len: int = datasets.MAX_TOTAL_LEN,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
    workload: list | None = None,
    save_detailed: bool = False,
    show_progress: bool = True,
    print_summary: bool = True,
    stop_event: asyncio.Event | None = None,
    label: str | None = None,
    headers: dict[str, str] | None = None,
    session_header: str | None = None,
) -> dict:
    """Run one benchmark and return the result dict (the --save-result JSON).

    `base_url` (or `base_urls`): one URL or several, used round robin per request.
    `workload`: pre-sampled SampleRequests (or Conversations for the multi-turn
    dataset) to skip sampling; otherwise ShareGPT is sampled with `seed`.
    `deadline` (wall s) and `stop_event` end the run early: requests in flight
    are counted failed with error "deadline" / "interrupted", unsent ones are
    left out, and `stopped` in the result says why.
    `session_header` (multi-turn): each conversation's requests carry this header with a value
    of their own (a gateway's --session-header: session affinity).
    """
    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    if dataset not in ("sharegpt", "sharegpt-multiturn"):
        raise ValueError(f"unknown dataset {dataset!r}: use sharegpt or sharegpt-multiturn")
    for name in percentile_metrics:
        if name not in METRIC_NAMES:
            raise ValueError(f"unknown percentile metric {name!r}; choose from {METRIC_NAMES}")
    for name in goodput or {}:
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"unknown goodput metric {name!r}; choose from ttft, tpot, e2el")
    if base_urls is not None:
        urls = list(base_urls)
    elif base_url is not None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
    else:
        urls = []
    if not urls or not model:
        raise ValueError("run_benchmark needs base_url(s) and model")
    endpoint = "/v1/chat/completions" if endpoint == "chat" else endpoint
    api_urls = [u.rstrip("/") + endpoint for u in urls]
    chat = is_chat_url(api_urls[0])
    multiturn = dataset == "sharegpt-multiturn"

    tok = None
    if workload is None:
        workload, tok = await asyncio.to_thread(
            prepare_workload, dataset, num_prompts, seed, tokenizer, max_turns, max_prompt_len, max_total_len)
    expected = datasets.Conversation if multiturn else datasets.SampleRequest
    if not all(isinstance(item, expected) for item in workload):
        raise ValueError(f"dataset {dataset!r} needs a workload of {expected.__name__} items")
    if multiturn:
        n_requests = sum(len(c.turns) for c in workload)
    else:
        n_requests = len(workload)

    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(total=n_requests, file=sys.stderr, mininterval=0.5, desc="requests")
    stop_event = stop_event or asyncio.Event()
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, limit_per_host=max_concurrency or 0,
                                     keepalive_timeout=60)
    no_limit = aiohttp.ClientTimeout(total=None)  # per-request limits are set on each POST
    async with aiohttp.ClientSession(connector=connector, timeout=no_limit, headers=headers) as session:
        run = _Run(session, api_urls, model, max_concurrency, time_scale, request_timeout, ignore_eos,
                   extra_body or {}, save_detailed, progress, session_header)
        jobs: list[Callable[[], Any]] = []
        first_index: list[int] = []
        if multiturn:
            index = 0
            for conv in workload:
                jobs.append(lambda i=index, c=conv: run.conversation(i, c, chat))
                first_index += [index] * len(conv.turns)
                index += len(conv.turns)
        else:
            jobs = [lambda i=i, r=r: run.single(i, r, chat) for i, r in enumerate(workload)]
        offsets = arrival_offsets(len(jobs), request_rate, burstiness, seed)

        tasks: set[asyncio.Task] = set()
        cpu0 = time.process_time()
        run.t0 = time.perf_counter()
        driver = asyncio.create_task(_dispatch(jobs, offsets, time_scale, tasks))
        stopper = asyncio.create_task(stop_event.wait())
        await asyncio.wait({driver, stopper}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
        if not driver.done():
            run.stop_reason = "interrupted" if stop_event.is_set() else "deadline"
            driver.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(driver, *tasks, return_exceptions=True)
        else:
            driver.result()  # surface a bug in our own code rather than hide it
        stopper.cancel()
        duration = (time.perf_counter() - run.t0) / time_scale
        client_cpu_s = time.process_time() - cpu0
    if progress is not None:
        progress.close()

    order = sorted(run.results)
    outputs = [run.results[i] for i in order]
    if tok is None and any(o.success and not o.output_tokens for o in outputs):
        tok = await asyncio.to_thread(datasets.load_tokenizer, tokenizer)
    count_tokens = (lambda text: len(tok(text, add_special_tokens=False).input_ids)) if tok else None
    metrics = calculate_metrics(outputs, duration, metric_percentiles, goodput, count_tokens)

    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if chat else "openai",
        "label": label,
        "model_id": model,
        "tokenizer_id": tokenizer or "SmolLM2-135M-Instruct (bundled GGUF)",
        "dataset": dataset,
        "num_prompts": num_prompts,
        "request_rate": request_rate if not math.isinf(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "time_scale": time_scale,
        "base_urls": urls,
        "stopped": run.stop_reason or None,
        "num_requests_sent": len(outputs),
        "num_requests_planned": n_requests,
        "session_header": session_header,
        # CPU seconds this process spent while the requests ran (wall clock, not scaled)
        "client_cpu_s": client_cpu_s,
    }
    result.update(metrics)
    result.update(per_request_lists(outputs, metrics["output_lens"]))
    if multiturn:
        result["turn_indices"] = [i - first_index[i] for i in order]
        result["conversation_ids"] = [first_index[i] for i in order]
    if save_detailed:
        result["generated_texts"] = [o.generated_text for o in outputs]
    if print_summary:
        print(format_summary(result, percentile_metrics, metric_percentiles, max_concurrency,
                             request_rate, bool(goodput)), flush=True)
        errors = Counter(e for e in result["errors"] if e)
        if errors:
            print(f"Errors ({result['failed']} failed requests), most frequent first:", file=sys.stderr)
            for text, count in errors.most_common(5):
                print(f"  {count} x {text}", file=sys.stderr)
        if run.stop_reason:
            print(f"Stopped early ({run.stop_reason}): {len(outputs)} of {n_requests} requests sent.",
                  file=sys.stderr)
    return result


# ---------------------------------------------------------------- CLI


def _parse_goodput(pairs: list[str] | None) -> dict[str, float] | None:
    if not pairs:
        return None
    out = {}
    for pair in pairs:
        name, _, value = pair.partition(":")
        try:
            out[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--goodput wants NAME:MS pairs, got {pair!r}") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True,
                   help="server URL; several comma-separated URLs are used round robin per request")
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default), /v1/chat/completions, or 'chat'")
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "sharegpt-multiturn"])
    p.add_argument("--num-prompts", type=int, default=1000,
                   help="requests to send (multi-turn: total turns over all conversations)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="concurrent requests (multi-turn: concurrent conversations)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="arrivals per simulated second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: bundled SmolLM2)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="divide measured durations by this (match the sim workers' --time-scale)")
    p.add_argument("--percentile-metrics", default=",".join(DEFAULT_PERCENTILE_METRICS))
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request limit, wall seconds")
    p.add_argument("--deadline", type=float, default=7200.0, help="whole-run limit, wall seconds")
    p.add_argument("--max-turns", type=int, default=8, help="multi-turn: turns kept per conversation")
    p.add_argument("--max-prompt-len", type=int, default=datasets.MAX_PROMPT_LEN)
    p.add_argument("--max-total-len", type=int, default=datasets.MAX_TOTAL_LEN)
    p.add_argument("--extra-body", type=json.loads, default=None,
                   help="JSON object merged into every request body (e.g. sampling parameters)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS")
    p.add_argument("--session-header", default=None, metavar="NAME",
                   help="multi-turn: send each conversation's requests with this header naming the "
                   "conversation (for a gateway's --session-header)")
    p.add_argument("--save-result", default=None, metavar="PATH", help="write the result JSON here")
    p.add_argument("--save-detailed", action="store_true", help="also keep generated texts in the JSON")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--label", default=None)
    return p


async def _main_async(args: argparse.Namespace) -> dict:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        # First Ctrl-C: stop cleanly and report; a second one kills as usual.
        print("\nInterrupted: stopping, in-flight requests count as failed...", file=sys.stderr)
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    return await run_benchmark(
        [u.strip() for u in args.base_url.split(",") if u.strip()],
        args.model,
        endpoint=args.endpoint,
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        seed=args.seed,
        tokenizer=args.tokenizer,
        time_scale=args.time_scale,
        percentile_metrics=[m.strip() for m in args.percentile_metrics.split(",") if m.strip()],
        metric_percentiles=[float(x) for x in args.metric_percentiles.split(",") if x.strip()],
        goodput=_parse_goodput(args.goodput),
        request_timeout=args.timeout,
        deadline=args.deadline,
        max_turns=args.max_turns,
        max_prompt_len=args.max_prompt_len,
        max_total_len=args.max_total_len,
        ignore_eos=not args.no_ignore_eos,
        extra_body=args.extra_body,
        session_header=args.session_header,
        save_detailed=args.save_detailed,
        show_progress=not args.disable_tqdm,
        stop_event=stop,
        label=args.label,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        print("--num-prompts and --max-concurrency must be >= 1", file=sys.stderr)
        return 2
    try:
        import uvloop

        result = uvloop.run(_main_async(args))
    except ImportError:
        result = asyncio.run(_main_async(args))
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"Result written to {args.save_result}", file=sys.stderr)
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
