"""scripts/campaign.py in CI: 100 seeded fault runs over kimi-convert, kimi-quantize and kimi-verify end with no
flag at all (no traceback, no fallback to the last line of defence, no wrong success, no memory blowup, no hang,
nothing left behind). The full campaign (5,000 runs) is run by hand; docs/verification.md has its figures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_hundred_campaign_runs_are_all_clean(tmp_path):
    report = tmp_path / "campaign.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "campaign.py"), "--runs", "100", "--seed", "9",
                        "--workers", "2", "--timeout", "30", "--json", str(report), "--work", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert report.exists(), r.stdout + r.stderr
    result = json.loads(report.read_text())
    summary = result["summary"]
    assert summary["runs"] == 100, r.stdout            # no run was cut by the time limit
    flagged = [(f["index"], f["flags"], f["cls"], f["what"], f["command"], f["stderr"][-300:])
               for f in result["flagged"]]
    assert summary["clean"] == 100 and not flagged, "\n".join(map(str, flagged))
    assert r.returncode == 0
    # every fault class was drawn at least once
    assert set(summary["by_class"]) >= {"valid", "safetensors header", "config", "checkpoint", "gguf", "options",
                                        "signal", "overlap"}, summary["by_class"]
