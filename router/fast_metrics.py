"""Counters, gauges and histograms without locks, exported through prometheus_client.

The gateway updates its metrics from one event-loop thread only, so the locks that
prometheus_client takes on every inc/observe (and its per-bucket Python loop) are pure
cost: ~2-3 µs per call, a dozen calls per request. These keep plain floats and lists,
find a histogram bucket with bisect, and build the standard metric families only when
/metrics is scraped. Same `.labels(...)`, `.inc()`, `.dec()`, `.set()`, `.observe()`
calls as prometheus_client, so the rest of the gateway does not care.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class _CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _GaugeChild(_CounterChild):
    __slots__ = ()

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family(Collector):
    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        self._default = None if self.labelnames else self._new_child()
        if registry is not None:
            registry.register(self)

    def _new_child(self):
        raise NotImplementedError

    def labels(self, *values: str):
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {key}")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def _items(self) -> Iterator[tuple[list[str], object]]:
        if self._default is not None:
            yield [], self._default
        for key, child in self._children.items():
            yield list(key), child


class FastCounter(_Family):
    def _new_child(self) -> _CounterChild:
        return _CounterChild()

    def inc(self, amount: float = 1.0) -> None:
        self._default.inc(amount)

    def collect(self):
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for labels, child in self._items():
            fam.add_metric(labels, child.value)
        yield fam


class FastGauge(_Family):
    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = (), registry=None) -> None:
        self._function: Callable[[], float] | None = None
        super().__init__(name, doc, labelnames, registry)

    def _new_child(self) -> _GaugeChild:
        return _GaugeChild()

    def inc(self, amount: float = 1.0) -> None:
        self._default.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self._default.value -= amount

    def set(self, value: float) -> None:
        self._default.value = value

    def set_function(self, fn: Callable[[], float]) -> None:
        """Read the value from `fn` at scrape time (no per-request update at all)."""
        self._function = fn

    @property
    def value(self) -> float:
        return self._function() if self._function is not None else self._default.value

    def collect(self):
        fam = GaugeMetricFamily(self.name, self.doc, labels=self.labelnames)
        if self._function is not None:
            fam.add_metric([], float(self._function()))
        else:
            for labels, child in self._items():
                fam.add_metric(labels, child.value)
        yield fam


class FastHistogram(_Family):
    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = (), *, buckets: Sequence[float],
                 registry=None) -> None:
        self.bounds = sorted(float(b) for b in buckets if b != float("inf"))
        super().__init__(name, doc, labelnames, registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self.bounds)

    def observe(self, value: float) -> None:
        self._default.observe(value)

    def collect(self):
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for labels, child in self._items():
            acc, buckets = 0, []
            for le, n in zip(les, child.counts, strict=True):
                acc += n
                buckets.append((le, acc))
            fam.add_metric(labels, buckets, child.sum)
        yield fam
