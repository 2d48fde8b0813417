"""Policies by name. Each is a small class behind the `Policy` interface (base.py)."""

from __future__ import annotations

from typing import Any

from scheduler.policies.base import Pick, Policy, PolicyEnv, Request, build_params
from scheduler.policies.llm_aware import LlmAware
from scheduler.policies.prefix_affinity import PrefixAffinity
from scheduler.policies.session import SessionAffinity
from scheduler.policies.simple import LeastKv, LeastRequest, PowerOfTwo, Random, RoundRobin

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RoundRobin, Random, LeastRequest, PowerOfTwo, LeastKv, PrefixAffinity,
                              SessionAffinity, LlmAware)
}

__all__ = ["POLICIES", "Pick", "Policy", "PolicyEnv", "Request", "make_policy", "validate_params"]


def _policy_class(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


def validate_params(name: str, params: dict[str, Any]) -> None:
    """Raises ValueError naming the unknown policy or the offending parameter."""
    build_params(_policy_class(name).Params, params, name)


def make_policy(name: str, params: dict[str, Any] | None = None, env: PolicyEnv | None = None) -> Policy:
    return _policy_class(name)(params, env)
