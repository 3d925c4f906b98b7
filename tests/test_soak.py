"""The soak and fault script's quick mode (scripts/load/soak.py --quick) on the real bundled models:
mixed load on `tokenfuse serve` with nothing lost and no 5xx, then the faults (a client gone inside
a re-sync, a remote member's server killed / restarted / stalled, a Ray actor's process killed and
restarted, a Ray node removed), each survived by the server."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parent.parent
NEEDS = ("fastapi", "uvicorn", "sse_starlette", "llama_cpp", "starlette_context", "pydantic_settings", "ray", "psutil")


def test_soak_quick(tmp_path):
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"scripts/load/soak.py needs {', '.join(missing)} (scripts/setup.sh installs them)")
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "load" / "soak.py"), "--quick", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == [] and run.returncode == 0, run.stdout[-3000:]
    load = report["load"]
    assert load["requests"] == 24 and load["5xx"] == 0 and load["failure_count"] == 0
    assert load["stream_pieces_checked"] > 0 and load["server_alive"] and load["running_after"] == 0
    assert load["status"].get("400") and load["status"].get("200")  # bad inputs refused, the rest served
    checks = {row["check"]: row["ok"] for row in report["faults"]}
    for name in ("resync: client gone inside a re-sync", "resync: every member's state released",
                 "resync: next request exact", "remote killed mid-stream: error event", "remote down: clear 503",
                 "remote restarted: next request works", "remote stalled mid-stream: error event",
                 "remote resumed: next request works",
                 "ray actor process killed mid-stream (max_restarts 1): the stream goes on, exact",
                 "ray actor restarted: next request works", "ray node removed mid-stream: error event",
                 "ray after the node removed: server up, clear 503",
                 "ray after the node removed, on_member_failure skip: answered without it"):
        assert checks.get(name) is True, name
    assert all(checks.values())
