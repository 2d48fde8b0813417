"""benchmarks.tenant_share: one small run end to end (real sim workers, scheduler and gateway
in each of the queue's modes; no timing asserted)."""

from __future__ import annotations

import json

from benchmarks.tenant_share import main


def test_a_small_run_measures_both_tenants_in_every_mode(tmp_path, capsys):
    out = tmp_path / "share.json"
    assert main(["--profile", "tiny", "--workers", "1", "--concurrency", "6", "--seconds", "3",
                 "--sample", "400", "--heavy-min-prompt", "150", "--heavy-max-output", "40",
                 "--light-max-prompt", "40", "--light-max-output", "8", "--log-dir", str(tmp_path),
                 "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["modes"]) == {"one-line", "requests", "tokens"}
    for by_tenant in doc["modes"].values():
        assert set(by_tenant) == {"documents", "chat"}
        assert all(t["completed"] > 0 for t in by_tenant.values())
        shares = [t["share of weighted tokens (%)"] for t in by_tenant.values()]
        assert abs(sum(shares) - 100) < 1e-6
    assert "share of weighted tokens (%)" in capsys.readouterr().out


def test_two_gateway_replicas_each_carry_one_tenant(tmp_path):
    out = tmp_path / "share.json"
    assert main(["--profile", "tiny", "--workers", "1", "--concurrency", "6", "--seconds", "3",
                 "--sample", "400", "--heavy-min-prompt", "150", "--heavy-max-output", "40",
                 "--light-max-prompt", "40", "--light-max-output", "8", "--log-dir", str(tmp_path),
                 "--gateways", "2", "--modes", "tokens-local,tokens", "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["scenario"]["gateways"] == 2
    assert set(doc["modes"]) == {"tokens-local", "tokens"}
    for by_tenant in doc["modes"].values():
        assert all(t["completed"] > 0 for t in by_tenant.values())
    # Each tenant went through its own replica: both replicas logged requests.
    for mode in ("tokens-local", "tokens"):
        logs = [tmp_path / mode / "llm_aware" / name for name in ("gateway.log", "gateway1.log")]
        assert all("POST /v1/completions" in log.read_text() for log in logs), mode
