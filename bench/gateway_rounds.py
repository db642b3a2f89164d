"""The gateway scenario of `make bench`: the example's gateway (examples/gateway-sidecar) against
its sidecar at 1, 32 and 125 concurrent callers, every transport in each run (so competitors
alternate), for several rounds; the rows join docs/bench/results.json as the systems
`gateway-isthmus-shm`, `gateway-grpc-aio-uds` and `gateway-httpx-axum-uds`, with `size` = the
request body's bytes and `inflight` = the callers; and each round's `gateway-floor` at 125
callers (`gateway_floor.py`: requests/s of the gateway's own work, no transport) and its
`gateway-floor-async` (the same with one turn of the event loop per reply and per streamed
message: the least a transport that completes calls on the loop adds).

Usage: gateway_rounds.py RESULTS_JSON [--quick] (a RESULTS_JSON not there yet is made)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import gateway_floor

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = {
    "isthmus": "gateway-isthmus-shm",
    "grpc-uds": "gateway-grpc-aio-uds",
    "http-uds": "gateway-httpx-axum-uds",
}


def versions() -> dict[str, str]:
    """The competitors' versions: the Python side's installed packages, the Rust side's lock."""
    found = {"python": sys.version.split()[0]}
    for package in ("grpcio", "protobuf", "httpx"):
        found[package] = metadata.version(package)
    lock = (ROOT / "Cargo.lock").read_text().split("[[package]]")
    for crate in ("tonic", "axum", "hyper", "pyo3"):
        entry = next((e for e in lock if f'\nname = "{crate}"\n' in e), "")
        found[crate] = entry.split('version = "')[1].split('"')[0] if entry else "unknown"
    return found


def main() -> int:
    results = Path(sys.argv[1])
    quick = "--quick" in sys.argv
    callers, rounds, seconds = ([1, 32, 125], 1, 1.5) if quick else ([1, 32, 125], 3, 5.0)
    records = []
    for round_ in range(1, rounds + 1):
        for n in callers:
            print(f"gateway: round {round_}/{rounds}, {n} callers", file=sys.stderr, flush=True)
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                argv = [sys.executable, str(ROOT / "examples/gateway-sidecar/gateway.py")]
                argv += ["--callers", str(n), "--seconds", str(seconds), "--json", out.name]
                argv += ["--sidecar", str(ROOT / "target/release/gateway-sidecar")]
                # No catalog subscribers: they would load the isthmus run alone.
                argv += ["--workers", "0"]
                done = subprocess.run(argv, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    print(done.stdout + done.stderr, file=sys.stderr)
                    return 1
                for row in json.loads(Path(out.name).read_text()):
                    records.append(
                        {
                            "system": SYSTEMS[row["transport"]],
                            "size": row["body_bytes"],
                            "inflight": n,
                            "p50_us": round(row["p50_us"], 3),
                            "p99_us": round(row["p99_us"], 3),
                            "rps": round(row["rps"], 1),
                            "round": round_,
                            "avg_us": round(row["avg_us"], 3),
                            "failures": row["failures"],
                        }
                    )
        # The floor in the same run (bench/gateway_floor.py): the gateway's own Python work
        # per request, at the most callers, as requests/s.
        body = next((r["size"] for r in records if r["system"] == SYSTEMS["isthmus"]), 0)
        for system, suspend in (("gateway-floor", False), ("gateway-floor-async", True)):
            floor, _, _ = gateway_floor.measure(max(callers), seconds, suspend)
            records.append(
                {
                    "system": system,
                    "size": body,
                    "inflight": max(callers),
                    "rps": round(1 / floor, 1),
                    "round": round_,
                }
            )
    # A file that is not there yet, or holds no header or records (a run of its own), is made.
    data = json.loads(results.read_text()) if results.exists() else {}
    header = data.setdefault("header", {})
    header.setdefault("versions", {}).update(versions())
    header["fields"] = (
        "system, size (bytes), inflight, p50_us, p99_us, rps, round; gateway rows also avg_us and failures; "
        "medians are taken across rounds"
    )
    ours = {*SYSTEMS.values(), "gateway-floor", "gateway-floor-async"}
    kept = [r for r in data.get("records", []) if r["system"] not in ours]
    data["records"] = kept + records
    # As isthmus-bench writes it: one compact record a line, keys sorted.
    compact = {"separators": (",", ":"), "sort_keys": True}
    lines = ",\n".join(f"    {json.dumps(r, **compact)}" for r in data["records"])  # type: ignore[arg-type]
    head = json.dumps(data["header"], indent=2, sort_keys=True).replace("\n", "\n  ")
    results.write_text(f'{{\n  "header": {head},\n  "records": [\n{lines}\n  ]\n}}\n')
    print(f"gateway: {len(records)} records into {results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
