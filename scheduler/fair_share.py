"""Token-weighted turns for the admission queue's flows (`--fair-share tokens`, the default).

With `requests` the flows of a priority take turns one request each, as the
Gateway API Inference Extension's flow control does: a tenant of 3,000-token prompts with
long answers gets as many turns as one of short chats, and so most of the GPUs' time. With
`tokens`, the queue serves next the flow that has been served the fewest tokens: a virtual
token counter per flow, as in VTC (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024). A request costs its prompt tokens plus `output_token_weight` times its output
tokens: a generated token costs an engine more than a prompt token (a decode step reads every
weight for one token per sequence); VTC weighs it 2.

Counting:
- when a request gets its worker (whether it waited or not), its flow is charged an estimate:
  its prompt, plus its answer guessed as the flow's recent mean answer (capped by max_tokens);
- when it ends, the estimate is replaced by what it used (the usage the gateway counted);
- a flow that starts waiting is lifted to the lowest counter of the flows waiting beside it
  (none waiting: the counter of the flow served last), so a tenant idle for an hour does not
  bank an hour of turns to spend ahead of everybody at once (VTC's lift). A flow seen for the
  first time starts there too.
Counters are per model (one model's workers are not another's). Each gateway replica keeps its
own, for the turns in its queue (router/queue.py); the scheduler keeps the same counters over
every replica's traffic, and when every worker is saturated it hands freed room to the held call
of the flow served least (scheduler/service.py). So a tenant whose connections all land on one
replica gets no more of the cluster than one spread over all of them. It lives here, in the
lower part, because both use it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

# Output weight: VTC's; a flag (--fair-output-token-weight) for engines where it differs.
DEFAULT_OUTPUT_TOKEN_WEIGHT = 2.0
# How fast a flow's mean answer follows its recent answers (exponential moving average).
_MEAN_OUTPUT_ALPHA = 0.2
# Past this many flows, those at or below the level are forgotten: recreated, they start at
# the level, which is where a lift would put them. If that is not enough (a client making up
# a fairness id per request), the half served least is forgotten too: each comes back at the
# level, no better placed than a new flow.
MAX_ACCOUNTS = 4096


@dataclass(slots=True)
class _Account:
    served: float  # weighted tokens: settled requests, plus estimates of those running
    mean_output: float | None = None  # recent answers' mean length (None: none ended yet)


class FlowLedger:
    """One model's flows' counters (router/queue.py asks it which flow goes next; the scheduler
    which held call does)."""

    def __init__(self, output_token_weight: float = DEFAULT_OUTPUT_TOKEN_WEIGHT) -> None:
        self.output_token_weight = output_token_weight
        self.level = 0.0  # the counter of the flow served last
        self._accounts: dict[str, _Account] = {}
        self.mean_output: float | None = None  # over every flow: a new flow's first guess

    def __len__(self) -> int:
        return len(self._accounts)

    def served(self, flow: str) -> float:
        account = self._accounts.get(flow)
        return self.level if account is None else account.served

    def lift(self, flow: str, waiting: Iterable[str]) -> None:
        """`flow` starts waiting beside the flows `waiting`: no lower than the lowest of them."""
        floor = min((self.served(f) for f in waiting if f != flow), default=self.level)
        account = self._account(flow)
        account.served = max(account.served, floor)

    def pick(self, flows: Iterable[str]) -> str:
        """The flow served least (the first of equals); `flows` must not be empty."""
        best = min(flows, key=self.served)
        self.level = self.served(best)
        return best

    def charge(self, flow: str, prompt_tokens: int, max_tokens: int | None) -> float:
        """A request of `flow` got its worker: charge it an estimate. Returns the estimate,
        which `settle` takes back."""
        account = self._account(flow)
        guess = account.mean_output if account.mean_output is not None else self.mean_output or 0.0
        if max_tokens is not None:
            guess = min(guess, max_tokens)
        estimate = prompt_tokens + self.output_token_weight * guess
        account.served += estimate
        return estimate

    def settle(self, flow: str, charged: float, prompt_tokens: int, output_tokens: int) -> None:
        """A request charged `charged` ended having used these tokens."""
        account = self._account(flow)
        account.served += prompt_tokens + self.output_token_weight * output_tokens - charged
        if not (prompt_tokens or output_tokens):
            return  # refused, or failed before its worker took it: no answer length to learn
        for owner in (account, self):
            mean = owner.mean_output
            owner.mean_output = (output_tokens if mean is None
                                 else mean + _MEAN_OUTPUT_ALPHA * (output_tokens - mean))

    def most_served(self, limit: int) -> dict[str, float]:
        """The `limit` flows served most, and their counters (for /admin/state)."""
        top = heapq.nlargest(limit, self._accounts.items(), key=lambda fa: fa[1].served)
        return {flow: round(account.served, 1) for flow, account in top}

    def _account(self, flow: str) -> _Account:
        account = self._accounts.get(flow)
        if account is None:
            if len(self._accounts) >= MAX_ACCOUNTS:
                self._forget_settled()
            account = self._accounts[flow] = _Account(self.level)
        return account

    def _forget_settled(self) -> None:
        level = self.level
        kept = {f: a for f, a in self._accounts.items() if a.served > level}
        if len(kept) >= MAX_ACCOUNTS:
            kept = dict(heapq.nlargest(MAX_ACCOUNTS // 2, kept.items(), key=lambda fa: fa[1].served))
        self._accounts = kept
