"""Differential fuzz: the gateway in front of a real vLLM must answer as vLLM does.

Starts one vLLM (CPU build, SmolLM2), a scheduler and a gateway on 127.0.0.1, sends seeded
request variants (benchmarks/vllm_diff_cases.py) each twice, directly to vLLM and through the
gateway, and compares what a client sees (benchmarks/vllm_diff_compare.py): the status, JSON or
SSE, an error's shape, type and param, a success's structure, a stream's kinds of event, and
the text where sampling is greedy. The differences the gateway is meant to make are listed in
vllm_diff_compare.ALLOWED with their reasons; any other is reported with its reproducer.

    .venv/bin/python -m benchmarks.vllm_diff_fuzz --vllm-python /tmp/vvenv/bin/python \\
        --seed 1 --cases 300

Opt-in (vLLM is not installable in CI): tests/router/test_vllm_diff.py runs a small slice.
Exit status 1 when a difference is not allowed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx

from benchmarks.fuzz_procs import Proc
from benchmarks.vllm_diff_cases import MODEL, Case, cases
from benchmarks.vllm_diff_compare import ALLOWED, KNOWN, Seen, allowed_by, differences, known_by, seen

MAX_ANSWER_BYTES = 4 << 20  # more than any answer of a few tokens; past it, not read on


@contextlib.contextmanager
def stack(vllm_python: str | None, vllm_url: str | None, model_dir: str | None) -> Iterator[dict[str, str]]:
    """vLLM (or the one at vllm_url), a scheduler over it and a gateway; all stopped at the end."""
    procs: list[Proc] = []
    try:
        if vllm_url is None:
            if model_dir is None:
                from inference_worker.model.loader import resolve_model_dir
                model_dir = str(resolve_model_dir(MODEL))
            vllm = Proc.launch("vllm", [vllm_python or "", "-m", "vllm.entrypoints.openai.api_server"], [
                "--model", model_dir, "--served-model-name", MODEL, "--dtype", "float32",
                "--max-model-len", "2048", "--enforce-eager", "--host", "127.0.0.1"],
                env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_RESPONSES_API_STORE": "1"})
            procs.append(vllm)
            vllm.wait_ready(time.monotonic() + 300)
            vllm_url = vllm.url
        sched = Proc.start("scheduler", "scheduler", "--workers", vllm_url, "--scrape-interval-ms", "200")
        procs.append(sched)
        sched.wait_ready(time.monotonic() + 60)
        gateway = Proc.start("gateway", "router", "--scheduler", sched.url)
        procs.append(gateway)
        gateway.wait_ready(time.monotonic() + 60)
        _wait_models(gateway.url)
        yield {"vllm": vllm_url, "gateway": gateway.url}
    finally:
        for p in reversed(procs):
            p.stop()


def _wait_models(gateway: str, timeout_s: float = 30) -> None:
    """Until the scheduler has read the worker's models (the gateway's default model)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if httpx.get(gateway + "/v1/models", timeout=2).json().get("data"):
                return
        time.sleep(0.2)
    raise TimeoutError("the gateway never listed the model")


def send(client: httpx.Client, base: str, case: Case, timeout_s: float) -> Seen:
    try:
        with client.stream(case.method, base + case.path, content=case.body or None,
                           headers=case.headers, timeout=timeout_s) as r:
            body = b""
            for chunk in r.iter_bytes():  # decoded where the answer is compressed
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    break
            return seen(r.status_code, r.headers.get("content-type", ""), body)
    except httpx.HTTPError as exc:
        return Seen(0, f"transport:{type(exc).__name__}")


def _class_of(case: Case, diffs: list[str]) -> str:
    """Differences grouped: the endpoint and the kind of each difference with its values."""
    return f"{case.kind}: " + "; ".join(d if len(d) < 120 else d[:117] + "..." for d in diffs)


def run(urls: dict[str, str], seeds: list[int], n: int, timeout_s: float, total_s: float) -> dict:
    started = time.monotonic()
    per_endpoint: Counter[str] = Counter()
    allowed: Counter[str] = Counter()
    known_open: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    found: dict[str, list[dict]] = defaultdict(list)
    sent = 0
    # Redirects followed, as the OpenAI SDKs do: vLLM answers a trailing slash with a 307.
    with httpx.Client(follow_redirects=True) as client:
        for seed in seeds:
            for i, case in enumerate(cases(seed, n)):
                if time.monotonic() - started > total_s:
                    break
                direct = send(client, urls["vllm"], case, timeout_s)
                through = send(client, urls["gateway"], case, timeout_s)
                sent += 1
                per_endpoint[case.kind] += 1
                # What vLLM answered: a stream, a whole 2xx, a 4xx.
                answers[direct.form if direct.form == "sse" else f"{direct.status // 100}xx"] += 1
                diffs = differences(case, direct, through)
                if not diffs:
                    continue
                why = allowed_by(case, direct, through)
                if why:
                    allowed[why] += 1
                    continue
                why = known_by(case, direct, through)
                if why:
                    known_open[why] += 1
                    continue
                found[_class_of(case, diffs)].append({
                    "seed": seed, "case": i, "mutation": case.mutation, "request": case.reproducer(),
                    "direct": direct.raw.decode(errors="replace"),
                    "through": through.raw.decode(errors="replace")})
    return {"cases": sent, "seconds": round(time.monotonic() - started, 1),
            "per_endpoint": dict(per_endpoint), "vllm_answers": dict(answers), "allowed": dict(allowed),
            "known_open": dict(known_open),
            "differences": {k: {"count": len(v), "examples": v[:3]} for k, v in found.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", help="a Python with vLLM installed (starts a vLLM)")
    ap.add_argument("--vllm-url", help="use this running vLLM instead (served name smollm2)")
    ap.add_argument("--model-dir", help="the weights (default: our SmolLM2 copy)")
    ap.add_argument("--seed", type=int, action="append", help="seeds (repeatable; default 1)")
    ap.add_argument("--cases", type=int, default=100, help="cases per seed")
    ap.add_argument("--timeout-s", type=float, default=60, help="per request")
    ap.add_argument("--total-s", type=float, default=1800, help="stop sending after this")
    ap.add_argument("--out", help="write the report (JSON) here")
    args = ap.parse_args(argv)
    if not args.vllm_python and not args.vllm_url:
        ap.error("give --vllm-python (or --vllm-url)")
    with stack(args.vllm_python, args.vllm_url, args.model_dir) as urls:
        report = run(urls, args.seed or [1], args.cases, args.timeout_s, args.total_s)
    report["allowed_reasons"] = {name: reason for name, _t, reason in ALLOWED}
    report["known_open_reasons"] = {name: reason for name, _t, reason in KNOWN}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(json.dumps({k: report[k] for k in ("cases", "seconds", "per_endpoint", "vllm_answers", "allowed",
                                           "known_open")}))
    for name, d in report["differences"].items():
        print(f"\n[{d['count']}] {name}")
        for ex in d["examples"][:2]:
            print(f"   seed {ex['seed']} case {ex['case']}: {ex['mutation']}\n   {ex['request']}\n"
                  f"   direct:  {ex['direct'][:200]}\n   through: {ex['through'][:200]}")
    return 1 if report["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
