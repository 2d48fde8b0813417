"""SGLang's rank layout, read once per worker from its server info.

SGLang writes scheduler metrics from each data-parallel group's first attention rank, or from
every rank with --enable-metrics-for-all-schedulers. A page without a `dp_rank` label cannot tell
which TP ranks repeat one group: plain `--tp 2` with that flag and `--tp 2 --dp 2
--enable-dp-attention` write the same labels (tp_rank 0 and 1), the first one group reported
twice, the second two groups. The server's arguments settle it: `GET /server_info` (SGLang since
late 2025; `/get_server_info`, kept as a deprecated alias there, before) returns every server
argument at the top level (`tp_size`, `dp_size`, `enable_dp_attention`,
`enable_metrics_for_all_schedulers`, ...) beside the scheduler info and per-DP internal states.

A TP rank's group is SGLang's attention-DP rank (compute_dp_attention_world_info):
tp_rank // (tp_size // dp_size) with dp attention, else 0 (within one dp_rank, when plain data
parallelism labels the groups). Attention context parallelism splits a group's TP ranks further,
but its ranks stay in their group, so the formula holds there too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.running_cap import is_positive_int

# Newest first: a server that has both answers the first; /get_server_info logs a deprecation
# warning on every call where /server_info exists.
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")


@dataclass(frozen=True, slots=True)
class RankLayout:
    tp_size: int
    dp_size: int
    dp_attention: bool
    # Every rank writes metrics (informative: the groups come out the same either way).
    all_schedulers: bool = False

    @property
    def ranks_per_group(self) -> int:
        groups = self.dp_size if self.dp_attention else 1
        return max(1, self.tp_size // groups)

    def group_of(self, tp_rank: str | None) -> str:
        """The data-parallel group of a series' tp_rank label ("0" when absent or odd)."""
        try:
            return str(int(tp_rank or "0") // self.ranks_per_group)
        except ValueError:
            return "0"


def parse_server_info(info: object) -> RankLayout | None:
    """The layout from a server info body (None: not SGLang's shape, nothing to go by)."""
    if not isinstance(info, dict):
        return None
    tp, dp = info.get("tp_size"), info.get("dp_size", 1)
    if not is_positive_int(tp) or not is_positive_int(dp):
        return None
    return RankLayout(tp_size=tp, dp_size=dp, dp_attention=info.get("enable_dp_attention") is True,
                      all_schedulers=info.get("enable_metrics_for_all_schedulers") is True)


@dataclass(slots=True)
class ServerInfoState:
    """One worker's server info: its layout once read (None: not yet, or no such route)."""

    layout: RankLayout | None = None
    due_at: float = -math.inf  # monotonic time of the next read (inf: read, valid until restart)
    # Counts the restarts the worker may have had: a read begun before one answers for the
    # engine that was there before, and must not settle the layout of the one there now.
    epoch: int = 0

    def due(self, now: float) -> bool:
        return now >= self.due_at

    def expire(self) -> None:
        """The worker may have restarted (with other arguments, or as another version)."""
        self.due_at = -math.inf
        self.epoch += 1
