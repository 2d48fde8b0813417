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
