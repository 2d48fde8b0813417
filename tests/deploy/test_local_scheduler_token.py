"""The local launcher and compose give the scheduler and the gateway one gateway token (or none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deploy.local import build_specs, parse_args
from tests.deploy.helpers import DEPLOY


def _specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]):
    for name in ("SCHEDULER_GATEWAY_TOKEN", "ROUTER_SCHEDULER_TOKEN", "ROUTER_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    token_file = tmp_path / "admin-token"
    token_file.write_text("")
    _, scheduler, gateway = build_specs(parse_args(["--admin-token-file", str(token_file)]))
    return scheduler, gateway


@pytest.mark.parametrize("name", ["SCHEDULER_GATEWAY_TOKEN", "ROUTER_SCHEDULER_TOKEN"])
def test_a_token_in_either_variable_goes_to_both_and_never_on_a_command_line(tmp_path, monkeypatch, name):
    scheduler, gateway = _specs(tmp_path, monkeypatch, {name: "tok-123\n"})
    assert scheduler.env["SCHEDULER_GATEWAY_TOKEN"] == "tok-123"
    assert gateway.env["ROUTER_SCHEDULER_TOKEN"] == "tok-123"
    assert not any("tok-123" in arg for arg in scheduler.argv + gateway.argv)


def test_without_a_token_both_get_an_empty_one(tmp_path, monkeypatch):
    scheduler, gateway = _specs(tmp_path, monkeypatch, {})
    # Set, and empty: it overrides a variable the child would inherit otherwise.
    assert scheduler.env["SCHEDULER_GATEWAY_TOKEN"] == ""
    assert gateway.env["ROUTER_SCHEDULER_TOKEN"] == ""


def test_two_different_tokens_stop_the_launcher(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _specs(tmp_path, monkeypatch,
               {"SCHEDULER_GATEWAY_TOKEN": "tok-aaa", "ROUTER_SCHEDULER_TOKEN": "tok-bbb"})
    err = capsys.readouterr().err
    assert "differ" in err
    assert "tok-aaa" not in err and "tok-bbb" not in err


def test_compose_gives_the_scheduler_and_the_gateway_the_same_token():
    services = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())["services"]
    scheduler = services["scheduler"]["environment"]["SCHEDULER_GATEWAY_TOKEN"]
    gateway = services["gateway"]["environment"]["ROUTER_SCHEDULER_TOKEN"]
    # One shell variable for both; unset: empty, which both take as no token.
    assert scheduler == gateway == "${SCHEDULER_GATEWAY_TOKEN:-}"
