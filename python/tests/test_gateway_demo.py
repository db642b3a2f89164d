"""The gateway ↔ sidecar demo (`make demo`), run briefly on all three transports so it cannot rot
unnoticed: every response's content is checked by the gateway, which exits non-zero on any
failure, and its workers' catalog subscriptions hear the sidecar's changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIDECAR = Path(os.environ.get("ISTHMUS_SIDECAR", ROOT / "target/debug/gateway-sidecar"))


@pytest.mark.skipif(not SIDECAR.exists(), reason="the sidecar is not built (make pytest builds it)")
def test_the_demo_answers_every_call_correctly_on_every_transport(tmp_path: Path) -> None:
    rows = tmp_path / "rows.json"
    argv = [
        sys.executable,
        str(ROOT / "examples/gateway-sidecar/gateway.py"),
        "--callers",
        "8",
        "--seconds",
        "1",
    ]
    done = subprocess.run(
        [*argv, "--sidecar", str(SIDECAR), "--json", str(rows)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {row["transport"]: row for row in json.loads(rows.read_text())}
    assert set(seen) == {"isthmus", "grpc-uds", "http-uds"}
    for transport, row in seen.items():
        assert row["failures"] == 0 and row["requests"] > 0, (transport, row)
    # The sidecar changed its catalog while the isthmus load ran, and the gateway's workers heard.
    assert "catalog changes during the isthmus run:" in done.stdout, done.stdout
