"""Static discovery: the --workers list (flag, SCHEDULER_WORKERS, or YAML `workers`)."""

from __future__ import annotations

from scheduler.registry import WorkerState
from scheduler.service import SchedulerService

SOURCE = "static"


def add_static_workers(service: SchedulerService, urls: list[str]) -> list[WorkerState]:
    return [service.add_worker(WorkerState(url, source=SOURCE)) for url in urls]
