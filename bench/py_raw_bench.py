"""Python workers at memory speed, in the shape of SlimeRPC's table: a raw echo, one call in
flight, of 1 KiB to 16 MiB, as avg/p50/p99 µs and GB/s (2 x size / avg, as SlimeRPC reports it).

- `py-isthmus-raw`: an isthmus Python client sends a numpy `uint8` array with
  `Channel.raw_unary` (read in place, copied once into shared memory) to a Python server whose
  raw handler copies the request it views into a reply block (`context.alloc`); the client gets
  a view of that block. No Python `bytes` on either side.
- `py-py-grpcio`: grpcio's client sends `bytes` to grpcio's Python server over a Unix socket,
  whose handler returns its request.
- `py-ray-actor`: Ray's actor echo (`ray.get(actor.echo.remote(array))`), Ray started here with
  `ray.init(address="local")` and its default object store, a numpy `uint8` argument so that
  large ones go through its shared-memory object store, 300 warm-up calls per size (with fewer,
  its 4-16 MB figures are first-touch page faults). HOME and Ray's temp dir point at a temp dir.
  Skipped, with a note, if `ray` is not installed (`python/requirements-bench.txt`).
- `py-memcpy`: one `numpy.copyto` of the same size in this process, the yardstick the targets
  are set against.
- `py-floor-copy`: the floor under `py-isthmus-raw`'s two copies, in the same rounds: the
  transport matrix's `floor-copy` (`isthmus-bench floor-copy`: two processes, each copies the
  message once into shared memory the way the transport does, and each hands over by spinning
  on a shared word). numpy's copy of a large array runs on huge pages; shared memory has them
  only where the host allows (ADR 0023, `shmem_huge_pages` in the header), so this floor, not
  two `py-memcpy`s, is what no echo that copies twice can beat.

Records go into results.json, replacing the cells (system, size, one in flight) measured here:
system, size, inflight, round, p50_us, p99_us, rps, avg_us, gbps.

    python bench/py_raw_bench.py docs/bench/results.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

import isthmus

SIZES = [1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
ROUNDS = 3
PATH = "/bench.Echo/Unary"
ROOT = Path(__file__).resolve().parent


def measure(op: Callable[[], None], warmup: int, budget: float, min_iters: int) -> dict[str, float]:
    for _ in range(warmup):
        op()
    lat: list[float] = []
    start = time.perf_counter()
    while len(lat) < min_iters or (time.perf_counter() - start < budget and len(lat) < 100_000):
        t = time.perf_counter()
        op()
        lat.append(time.perf_counter() - t)
    lat.sort()
    avg = statistics.fmean(lat)
    return {
        "p50_us": lat[len(lat) // 2] * 1e6,
        "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
        "avg_us": avg * 1e6,
        "rps": 1.0 / avg,
    }


def start_server(system: str, target: str) -> subprocess.Popen[str]:
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "py_server.py"), system, target], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    if server.stdout.readline().strip() != "READY":
        raise SystemExit(f"py_server.py {system} did not start")
    return server


def payload(size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return (np.arange(size, dtype=np.uint64) % 251).astype(np.uint8)


def bench_isthmus(sizes: list[int], budget: float) -> dict[int, dict[str, float]]:
    sock = Path(tempfile.gettempdir()) / f"pyraw-{os.getpid()}.sock"
    target = f"shm://{sock}"
    server = start_server("isthmus-raw", target)
    out: dict[int, dict[str, float]] = {}
    try:
        with isthmus.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)]) as ch:
            for size in sizes:
                array = payload(size)
                reply = ch.raw_unary(PATH, array)
                assert np.array_equal(np.frombuffer(reply, dtype=np.uint8), array), "a wrong reply"
                del reply

                def once(array: Any = array) -> None:
                    ch.raw_unary(PATH, array)

                out[size] = measure(once, 20, budget, 20)
    finally:
        server.kill()
        server.wait()
        sock.unlink(missing_ok=True)
    return out


def bench_grpcio(sizes: list[int], budget: float) -> dict[int, dict[str, float]]:
    sock = Path(tempfile.gettempdir()) / f"pyraw-grpc-{os.getpid()}.sock"
    server = start_server("grpcio", str(sock))
    out: dict[int, dict[str, float]] = {}
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    try:
        with grpc.insecure_channel(f"unix:{sock}", options=options) as ch:
            echo = ch.unary_unary(PATH)
            for size in sizes:
                data = payload(size).tobytes()
                assert echo(data) == data, "a wrong reply"

                def once(data: bytes = data) -> None:
                    echo(data)

                out[size] = measure(once, 20, budget, 20)
    finally:
        server.kill()
        server.wait()
        sock.unlink(missing_ok=True)
    return out


def bench_ray(
    sizes: list[int], budget: float, warmup: int, rounds: int
) -> list[dict[int, dict[str, float]]] | None:
    """Every round in one Ray instance: a second `ray.init` in one process can time out."""
    try:
        import ray  # noqa: PLC0415 (optional: the bench runs without it)
    except ImportError:
        print("ray is not installed (pip install -r python/requirements-bench.txt): py-ray-actor skipped")
        return None
    home = tempfile.mkdtemp(prefix="ray-home-")
    os.environ["HOME"] = home
    ray.init(address="local", include_dashboard=False, _temp_dir=os.path.join(home, "t"), log_to_driver=False)
    out: list[dict[int, dict[str, float]]] = []
    try:

        @ray.remote
        class Echo:
            def echo(self, x: Any) -> Any:
                return x

        actor = Echo.remote()  # type: ignore[attr-defined]
        for round_ in range(1, rounds + 1):
            print(f"round {round_}: ray", file=sys.stderr)
            by_size = {}
            for size in sizes:
                array = payload(size)
                assert np.array_equal(ray.get(actor.echo.remote(array)), array), "a wrong reply"

                def once(array: Any = array) -> None:
                    ray.get(actor.echo.remote(array))

                by_size[size] = measure(once, warmup, budget, 20)
            out.append(by_size)
    finally:
        ray.shutdown()
        shutil.rmtree(home, ignore_errors=True)
    return out


def bench_memcpy(sizes: list[int], budget: float) -> dict[int, dict[str, float]]:
    out = {}
    for size in sizes:
        src, dst = payload(size), np.empty(size, dtype=np.uint8)

        def once(src: Any = src, dst: Any = dst) -> None:
            np.copyto(dst, src)

        out[size] = measure(once, 20, budget, 20)
    return out


def bench_floor(sizes: list[int], budget: float) -> dict[int, dict[str, float]] | None:
    binary = ROOT.parent / "target" / "release" / "isthmus-bench"
    if not binary.exists():
        print(f"note: {binary} is not built; no py-floor-copy rows", file=sys.stderr)
        return None
    run = subprocess.run(
        [str(binary), "floor-copy", str(budget), *map(str, sizes)], check=True, capture_output=True, text=True
    )
    out = {}
    for line in run.stdout.splitlines():
        m = json.loads(line)
        out[m["size"]] = {
            "p50_us": m["p50_us"],
            "p99_us": m["p99_us"],
            "avg_us": 1e6 / m["rps"],
            "rps": m["rps"],
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    budget = 0.3 if args.quick else 1.0
    rounds = 1 if args.quick else ROUNDS
    records: list[dict[str, Any]] = []

    def add(system: str, by_size: dict[int, dict[str, float]] | None, round_: int) -> None:
        for size, m in (by_size or {}).items():
            gbps = 2 * size / (m["avg_us"] * 1e-6) / 1e9
            if system == "py-memcpy":  # one copy, not an echo
                gbps = size / (m["avg_us"] * 1e-6) / 1e9
            records.append(
                {"system": system, "size": size, "inflight": 1, "round": round_, **m, "gbps": gbps}
            )

    for round_ in range(1, rounds + 1):
        print(f"round {round_}: memcpy, floor, isthmus, grpcio", file=sys.stderr)
        add("py-memcpy", bench_memcpy(SIZES, budget), round_)
        add("py-floor-copy", bench_floor(SIZES, budget), round_)
        add("py-isthmus-raw", bench_isthmus(SIZES, budget), round_)
        add("py-py-grpcio", bench_grpcio(SIZES, budget), round_)
    # Ray last and once started: its raylet and workers would run beside the others.
    for round_, by_size in enumerate(bench_ray(SIZES, budget, 30 if args.quick else 300, rounds) or [], 1):
        add("py-ray-actor", by_size, round_)

    path = Path(args.results)
    data = json.loads(path.read_text())
    cells = {(r["system"], r["size"], r["inflight"]) for r in records}
    data["records"] = [
        r for r in data["records"] if (r.get("system"), r.get("size"), r.get("inflight")) not in cells
    ] + records
    path.write_text(json.dumps(data, indent=1) + "\n")
    summarize(records)
    return 0


def summarize(records: list[dict[str, Any]]) -> None:
    def med(system: str, size: int, field: str) -> float | None:
        xs = [float(r[field]) for r in records if r["system"] == system and r["size"] == size]
        return statistics.median(xs) if xs else None

    systems = ["py-isthmus-raw", "py-ray-actor", "py-py-grpcio", "py-memcpy", "py-floor-copy"]
    print("\nRaw echo, one in flight (medians of rounds): avg / p50 / p99 µs, GB/s\n")
    print("| size | " + " | ".join(systems) + " | isthmus ÷ memcpy | floor ÷ memcpy | Ray ÷ isthmus |")
    print("|---:|" + "---:|" * (len(systems) + 3))
    for size in SIZES:
        cells = []
        for system in systems:
            avg, p50, p99, gbps = (med(system, size, f) for f in ("avg_us", "p50_us", "p99_us", "gbps"))
            cells.append("–" if avg is None else f"{avg:.1f} / {p50:.1f} / {p99:.1f}, {gbps:.2f}")
        ours, mem, ray = med("py-isthmus-raw", size, "p50_us"), med("py-memcpy", size, "p50_us"), None
        ray = med("py-ray-actor", size, "p50_us")
        floor = med("py-floor-copy", size, "p50_us")
        ratio = f"{ours / mem:.2f}×" if ours and mem else "–"
        floor_ratio = f"{floor / mem:.2f}×" if floor and mem else "–"
        vs_ray = f"{ray / ours:.1f}×" if ours and ray else "–"
        print(f"| {size} | " + " | ".join(cells) + f" | {ratio} | {floor_ratio} | {vs_ray} |")


if __name__ == "__main__":
    raise SystemExit(main())
