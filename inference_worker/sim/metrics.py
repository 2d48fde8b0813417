"""The sim runner's timing as Prometheus counters, read at scrape time.

The sim stands in for a GPU by sleeping each step's modelled time. When the worker's process
(its engine thread, HTTP handlers, metrics scrapes, all under one GIL) or the host's other
processes take the CPU the engine needs between steps, the "GPU" runs slower than modelled,
which a real GPU would not do. These counters say by how much, so a benchmark can tell a
router's effect from its testbed's CPU contention (benchmarks/routing_engine_counters.py):
- `sim:modelled_seconds_total`: the steps' modelled time (wall seconds, x --time-scale);
- `sim:stretch_seconds_total`: time between steps of a busy engine beyond the modelled
  per-step overhead;
- `sim:late_seconds_total`: time by which steps ended after their modelled end;
- `sim:steps_total`.
Not vLLM families: a router reads none of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from inference_worker.sim.runner import RunnerStats


class SimTimelineCollector(Collector):
    def __init__(self, stats: RunnerStats, labels: dict[str, str]) -> None:
        self.stats = stats
        self.labels = labels

    def collect(self) -> Iterable[CounterMetricFamily]:
        s = self.stats
        names, values = list(self.labels), list(self.labels.values())
        for name, doc, value in (
            ("sim:modelled_seconds", "Modelled time of the sim's steps, wall seconds.", s.modelled_s),
            ("sim:stretch_seconds", "Time between steps of a busy engine beyond the modelled "
             "per-step overhead (the engine's CPU time or GIL waits), wall seconds.", s.gap_s),
            ("sim:late_seconds", "Time by which steps ended after their modelled end.", s.late_s),
            ("sim:steps", "Engine steps the sim ran.", float(s.steps)),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
