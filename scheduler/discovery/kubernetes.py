"""Kubernetes discovery: EndpointSlices matching a label selector in one namespace,
listed then watched with lightkube. Each ready endpoint address becomes a worker
(`{scheme}://{address}:{port}`); a worker stays while any slice lists it ready (one pod
can be in several slices), and moves when its pod comes back at another address.
A watch that ends is resumed from its last resourceVersion (lightkube does that), so the
API server replays what it missed. On any error (API server unreachable, 410 Gone after a
compaction, ...) we back off and list again: the list is the whole truth, so slices
deleted while we could not watch are dropped, and the next watch starts from the list's
resourceVersion. A watch with no event for a while (k8s_watch_timeout_s and a little
more) is dropped and the slices listed again, as client-go bounds its watches: a
connection that died without a close would otherwise wait for events forever.
"""

from __future__ import annotations

import asyncio
import logging

from scheduler.config import SchedulerConfig
from scheduler.registry import WorkerState
from scheduler.service import SchedulerService

log = logging.getLogger(__name__)
SOURCE = "kubernetes"
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 10.0


def parse_selector(selector: str) -> dict[str, str | None]:
    """'app=vllm,tier' -> {'app': 'vllm', 'tier': None} (equality and existence terms)."""
    labels: dict[str, str | None] = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term or " in " in term or " notin " in term:
            raise ValueError(f"unsupported selector term {term!r} (use key=value or key)")
        key, _, value = term.partition("=")
        labels[key.strip().rstrip("=")] = value.strip().lstrip("=") or None if "=" in term else None
    return labels


def slice_workers(obj, port_spec: str | None, scheme: str) -> dict[str, str]:
    """worker_id -> URL for the ready endpoints of one EndpointSlice."""
    ports = list(obj.ports or [])
    port = None
    for p in ports:
        if p.port is None:
            continue  # "all ports" (a Service without ports): only --k8s-port can name one
        if port_spec is None or p.name == port_spec or str(p.port) == port_spec:
            port = p.port
            break
    if port is None and port_spec and port_spec.isdigit():
        port = int(port_spec)
    if port is None:
        return {}
    out: dict[str, str] = {}
    for ep in obj.endpoints or []:
        cond = ep.conditions
        # ready unset means ready; a terminating pod is ready=true when its Service publishes
        # not-ready addresses (a StatefulSet's headless Service does), and is on its way out.
        if cond is not None and (cond.ready is False or cond.terminating is True):
            continue
        for address in ep.addresses[:1]:  # the addresses of one endpoint are fungible
            host = f"[{address}]" if ":" in address else address
            url = f"{scheme}://{host}:{port}"
            wid = f"{ep.targetRef.name}:{port}" if ep.targetRef is not None and ep.targetRef.name else None
            out[wid or f"{host}:{port}"] = url
    return out


class KubernetesDiscovery:
    def __init__(self, service: SchedulerService, cfg: SchedulerConfig) -> None:
        self.service = service
        self.cfg = cfg
        self.labels = parse_selector(cfg.k8s_label_selector or "")
        self.slices: dict[str, dict[str, str]] = {}  # slice name -> {worker_id: url}
        self.known: dict[str, str] = {}  # worker_id -> the URL it was added with
        self.backoff = BACKOFF_MIN_S  # before the next list after a failure
        service.startup.wait_for(SOURCE)  # its models are unknown until the first list

    def apply(self, op: str, obj) -> None:
        name = obj.metadata.name
        new = {} if op == "DELETED" else slice_workers(obj, self.cfg.k8s_port, self.cfg.k8s_scheme)
        if new:
            self.slices[name] = new
        else:
            self.slices.pop(name, None)
        self._sync()
        log.info("endpointslice %s %s: %d ready worker(s)", name, op.lower(), len(new))

    def resync(self, current: dict[str, object]) -> None:
        """Make the workers match a full list of slices (name -> object)."""
        for name in self.slices.keys() - current.keys():
            log.info("endpointslice %s gone while not watched", name)
        self.slices = {}
        for name, obj in current.items():
            new = slice_workers(obj, self.cfg.k8s_port, self.cfg.k8s_scheme)
            if new:
                self.slices[name] = new
        self._sync()

    def _sync(self) -> None:
        """Make the workers match the union of every slice's endpoints. One pod can be in
        several slices (two Services selecting it, IPv4 and IPv6 slices, an endpoint the
        controller moves between slices): it stays while any slice lists it ready. A worker
        whose pod came back at another address (a StatefulSet pod keeps its name) is
        replaced: the registry keeps a known worker's URL, and would scrape the old one."""
        offered: dict[str, set[str]] = {}
        for workers in self.slices.values():
            for wid, url in workers.items():
                offered.setdefault(wid, set()).add(url)
        for wid in self.known.keys() - offered.keys():
            del self.known[wid]
            self.service.remove_worker(wid, source=SOURCE)
        for wid, urls in offered.items():
            current = self.known.get(wid)
            if current in urls:
                continue  # keep the URL it has while any slice still offers it
            if current is not None:
                log.info("worker %s moved from %s", wid, current)
                self.service.remove_worker(wid, source=SOURCE)
            url = min(urls)  # the same choice whichever slice came first
            self.known[wid] = url
            self.service.add_worker(WorkerState(url, worker_id=wid, source=SOURCE))

    def _kubeconfig(self, kube_config_cls):
        if not self.cfg.k8s_api_server:
            return kube_config_cls.from_env()  # in-cluster service account, else ~/.kube/config
        # An explicit API server (tests, kubectl proxy): no credentials.
        return kube_config_cls.from_dict({
            "clusters": [{"name": "api", "cluster": {"server": self.cfg.k8s_api_server}}],
            "users": [{"name": "anonymous", "user": {}}],
            "contexts": [{"name": "api", "context": {"cluster": "api", "user": "anonymous",
                                                     "namespace": self.cfg.k8s_namespace}}],
            "current-context": "api",
        })

    @property
    def quiet_limit_s(self) -> float:
        """The longest wait for a watch event before listing again: the server ends each watch
        after k8s_watch_timeout_s (lightkube resumes it), so this long without one means a quiet
        cluster (the list costs one request) or a connection gone silent (the list saves us)."""
        timeout = self.cfg.k8s_watch_timeout_s
        return timeout + min(30.0, float(timeout))

    async def _list_and_watch(self, client, endpoint_slice) -> None:
        """One list, then its watch until an error (raised) or a quiet spell (returns)."""
        ns = self.cfg.k8s_namespace
        listing = client.list(endpoint_slice, namespace=ns, labels=self.labels)
        self.resync({obj.metadata.name: obj async for obj in listing})
        self.service.startup.ready(SOURCE)
        events = aiter(client.watch(endpoint_slice, namespace=ns, labels=self.labels,
                                    server_timeout=self.cfg.k8s_watch_timeout_s,
                                    resource_version=listing.resourceVersion))
        while True:
            try:
                op, obj = await asyncio.wait_for(anext(events), self.quiet_limit_s)
            except TimeoutError:
                log.info("no EndpointSlice event for %.0fs: listing again", self.quiet_limit_s)
                self.backoff = BACKOFF_MIN_S  # the watch stayed open that long: no failure
                return
            if op == "BOOKMARK":
                continue  # only a resourceVersion, which lightkube keeps
            self.apply(op, obj)
            self.backoff = BACKOFF_MIN_S

    async def run(self) -> None:
        from lightkube import AsyncClient, KubeConfig
        from lightkube.resources.discovery_v1 import EndpointSlice

        while True:
            client = None
            try:
                # trust_env=False: an HTTP(S)_PROXY in the environment must not capture API
                # traffic meant for a local or in-cluster API server.
                client = AsyncClient(config=self._kubeconfig(KubeConfig), namespace=self.cfg.k8s_namespace,
                                     trust_env=False)
                await self._list_and_watch(client, EndpointSlice)
                continue  # a quiet spell, not a failure: list again at once
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # API server unreachable, 4xx/5xx, malformed event
                log.warning("kubernetes watch failed (%r); retrying in %.1fs", exc, self.backoff)
            finally:
                if client is not None:
                    await client.close()
            await asyncio.sleep(self.backoff)
            self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)
