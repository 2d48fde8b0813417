"""PNG figures for the routing experiment: latency CDFs per policy and worker load over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import numpy as np


def per_request_ms(result: dict, metric: str) -> list[float]:
    """Per-request TTFT or TPOT in ms from a benchmark client result (vLLM --save-result layout).

    TTFT comes from `ttfts` (seconds). TPOT comes from `tpots` when the client saves it, else it is
    rebuilt the way vLLM defines it: (latency - ttft) / (output_len - 1), where latency - ttft is
    the sum of that request's inter-chunk gaps; requests with output_len <= 1 have no TPOT.
    """
    if metric == "ttft":
        return [t * 1000.0 for t in result.get("ttfts", []) if t is not None and t > 0]
    if metric != "tpot":
        raise ValueError(f"unknown metric {metric!r}")
    if result.get("tpots"):
        return [t * 1000.0 for t in result["tpots"] if t is not None and t > 0]
    out = []
    for itl, n_out in zip(result.get("itls", []), result.get("output_lens", []), strict=False):
        if n_out and n_out > 1 and itl:
            out.append(sum(itl) * 1000.0 / (n_out - 1))
    return out


def plot_cdfs(results: dict[str, dict], metric: str, path: Path, title: str) -> Path:
    """One CDF line per policy, log x axis (latency tails span orders of magnitude)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, result in results.items():
        values = np.sort(np.asarray(per_request_ms(result, metric)))
        if values.size == 0:
            continue
        y = np.arange(1, values.size + 1) / values.size
        ax.plot(values, y, label=name, linewidth=2.2 if name == "llm_aware" else 1.3)
    ax.set_xscale("log")
    ax.set_xlabel(f"{metric.upper()} per request (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(samples: list[dict], key: str, n_workers: int) -> tuple[np.ndarray, list[np.ndarray]]:
    t = np.asarray([s["t"] for s in samples])
    per_worker = []
    for i in range(n_workers):
        per_worker.append(np.asarray([
            (s["workers"][i].get(key, np.nan) if i < len(s["workers"]) else np.nan) for s in samples
        ], dtype=float))
    return t, per_worker


def plot_timelines(timelines: dict[str, list[dict]], path: Path, title: str,
                   worker_labels: list[str] | None = None) -> Path:
    """Rows: waiting requests, KV usage, running requests; one column per policy; one line per worker.

    This is the picture that explains a routing win: under round robin one worker's queue and KV
    cache fill while another idles; a good policy keeps the lines together.
    """
    names = [n for n, s in timelines.items() if s]
    rows = (("waiting", "waiting requests"), ("kv", "KV cache usage (0-1)"), ("running", "running requests"))
    fig, axes = plt.subplots(len(rows), max(1, len(names)), figsize=(6.0 * max(1, len(names)), 8.5),
                             sharex="col", sharey="row", squeeze=False)
    for col, name in enumerate(names):
        samples = timelines[name]
        n_workers = max(len(s["workers"]) for s in samples)
        for row, (key, label) in enumerate(rows):
            ax = axes[row][col]
            t, series = _series(samples, key, n_workers)
            for i, values in enumerate(series):
                wl = worker_labels[i] if worker_labels and i < len(worker_labels) else f"worker {i}"
                ax.plot(t, values, linewidth=1.0, label=wl)
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel(label)
            if row == 0:
                ax.set_title(name)
            if row == len(rows) - 1:
                ax.set_xlabel("time (simulated s)")
        axes[0][col].legend(fontsize=7, loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
