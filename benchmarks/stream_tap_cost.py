"""What router/sse.py's StreamTap costs per stream: the gateway's watch on every SSE answer.

Each stream is 16 token events, the usage chunk the gateway asked for and `[DONE]`, in chat
completions' shape, read two ways: all of it in one read (a fast worker, or a whole answer
sent at once, as the zero-delay echo worker of benchmarks/gateway_overhead.py does) and one
read per event (a real worker's pace). The tap strips the usage chunk (the client did not ask
for it). Microseconds per stream, best of --repeat runs, for this tree's sse.py; run it in two
trees to compare.

    python -m benchmarks.stream_tap_cost --streams 20000 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import time

from router.sse import StreamTap


def stream_events(tokens: int) -> list[bytes]:
    def event(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = [event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    out += [event({**head, "choices": [{"index": 0, "delta": {"content": f" tok{i}"},
                                        "finish_reason": None}]}) for i in range(tokens)]
    usage = {"prompt_tokens": 100, "completion_tokens": tokens, "total_tokens": 100 + tokens}
    out.append(event({**head, "choices": [], "usage": usage}))
    out.append(b"data: [DONE]\n\n")
    return out


def per_stream_us(reads: list[bytes], streams: int) -> float:
    start = time.perf_counter()
    for _ in range(streams):
        tap = StreamTap(strip_usage=True)
        for piece in reads:
            tap.feed(piece)
        tap.flush()
    return (time.perf_counter() - start) / streams * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=20000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    events = stream_events(args.tokens)
    shapes = {"one read per stream": [b"".join(events)], "one read per event": events}
    for name, reads in shapes.items():
        runs = [per_stream_us(reads, args.streams) for _ in range(max(args.repeat, 1))]
        print(f"{name:>22}: {min(runs):7.2f} us per stream (best of {len(runs)}; "
              f"runs {', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
