"""What one 64 B call costs besides time, on each side, counted from outside the processes
(issue 19, steps 2 and 3): heap allocations through the C library's allocator, mutex locks
through the C library, system calls by kind, and frames and doorbells from the client's
transport counters.

Usage: ``count_per_call.py [--size N] [--calls N] [engine] [python] [tonic]`` (all three by
default), from the repository root after ``make bench``'s builds (``target/release/isthmus-bench``
and the release Python package in ``.venv``). Needs root, or perf allowed to add uprobes and read
tracepoints.

- ``engine``: the engine's blocking client → the engine's server (``isthmus-rust``);
- ``python``: ``isthmus.insecure_channel`` → the same Rust server (``py-isthmus-sync``);
- ``tonic``: a tonic client on ``isthmus::Channel`` → a tonic service behind
  ``isthmus::Server`` (``tonic-isthmus-shm``).

How: ``perf probe`` puts uprobes on ``malloc``, ``calloc``, ``realloc``, ``posix_memalign`` and
``pthread_mutex_lock`` in the C library (removed again at the end if this run added them), and
``perf stat -p`` counts them and the system-call tracepoints in each process from just before
the client's calls to just after them (enabled and disabled through perf's control FIFOs; the
client has made 10,000 calls before, to warm up). What it cannot see, it does not claim:

- Python's small objects come from its own allocator (pymalloc) and are not counted; Rust's
  allocations all go through ``malloc`` and friends.
- Rust's and Go's locks are inline atomic instructions that make a system call only when they
  wait (``futex``); ``pthread_mutex_lock`` counts Python's GIL and locks.
- Atomic instructions are not counted: the virtual machines this runs on expose no hardware
  counters to perf (``perf stat -e instructions`` says ``<not supported>``).

Each uprobe hit costs the process a trap (~1-2 µs), so calls run slower under the probes than in
the benchmark, and a side that waited longer would make system calls a normal run does not (a
sleep on the doorbell, a wake-up). So each system runs twice: the system calls and the client's
transport counters are those of a run without uprobes; the last column gives the client's
sleeps in the run with them.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "target" / "release" / "isthmus-bench"
PYTHON = ROOT / ".venv" / "bin" / "python"

PROBED = ["malloc", "calloc", "realloc", "posix_memalign", "pthread_mutex_lock"]
SYSCALLS = ["futex", "sched_yield", "read", "write", "epoll_wait", "epoll_pwait"]
# Two runs per system: the uprobes slow every call (see the module's doc), which would change the
# system calls made while waiting, so those are counted in a run of their own.
PROBE_EVENTS = [f"probe_libc:{f}" for f in PROBED]
SYSCALL_EVENTS = [f"syscalls:sys_enter_{s}" for s in SYSCALLS] + ["raw_syscalls:sys_enter"]


def libc_path() -> str:
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if re.search(r"/libc\.so\.6$", path):
            return path
    raise SystemExit("no libc.so.6 in this process's maps")


def add_probes() -> list[str]:
    """Adds the uprobes missing; the ones this run added, to remove at the end."""
    have = subprocess.run(["perf", "probe", "-l"], check=False, capture_output=True, text=True).stdout
    added = []
    for f in PROBED:
        if re.search(rf"probe_libc:{f}\s", have + " "):
            continue
        r = subprocess.run(
            ["perf", "probe", "-x", libc_path(), "--add", f], check=False, capture_output=True, text=True
        )
        if r.returncode != 0:
            raise SystemExit(f"perf probe {f}: {r.stderr.strip()}")
        added.append(f"probe_libc:{f}")
    return added


class Side:
    """``perf stat`` on one process, counting `events` only between `enable` and `disable`
    (its control FIFOs, each command acknowledged): the client's calls and nothing around them."""

    def __init__(self, pid: int, tmp: Path, name: str, events: list[str]):
        self.out, ctl, ack = tmp / f"{name}.csv", tmp / f"{name}.ctl", tmp / f"{name}.ack"
        os.mkfifo(ctl)
        os.mkfifo(ack)
        self.perf = subprocess.Popen(
            [
                "perf",
                "stat",
                "-x",
                ",",
                "-o",
                str(self.out),
                "-e",
                ",".join(events),
                "-p",
                str(pid),
                "--delay=-1",
                f"--control=fifo:{ctl},{ack}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Each open waits for perf's own end of the FIFO: then perf has attached.
        self.ctl = open(ctl, "w")  # noqa: SIM115 (closed in `stop`)
        self.ack = open(ack)  # noqa: SIM115

    def command(self, what: str) -> None:
        self.ctl.write(what + "\n")
        self.ctl.flush()
        # perf ends each acknowledgement with a NUL after its newline ("ack\n\0").
        if (got := self.ack.readline()).replace("\0", "").strip() != "ack":
            raise SystemExit(f"perf stat did not acknowledge {what!r}: {got!r}")

    def stop(self) -> dict[str, int]:
        """The counts, by event; an event that never fired reads 0 (perf: ``<not counted>``)."""
        self.perf.send_signal(signal.SIGINT)
        self.perf.wait(timeout=30)
        self.ctl.close()
        self.ack.close()
        counts = {}
        for line in self.out.read_text().splitlines():
            fields = line.split(",")
            if len(fields) > 2 and fields[0].strip().isdigit():
                counts[fields[2]] = int(fields[0])
        return counts


def spawn(args: list[str]) -> subprocess.Popen[str]:
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    if line != "READY":
        p.kill()
        raise SystemExit(f"{args[:3]} printed {line!r}, not READY")
    return p


def measure(kind: str, size: int, calls: int, tmp: Path) -> dict[str, object]:
    """Both runs of one system: the system calls' (with its transport counters), then the
    uprobes'."""
    result = run(kind, size, calls, tmp, SYSCALL_EVENTS)
    probed = run(kind, size, calls, tmp, PROBE_EVENTS)
    for side in ("client", "server"):
        result["counts"][side].update(probed["counts"][side])  # type: ignore[index]
    result["probed_sleeps"] = probed["sleeps"]
    return result


def run(kind: str, size: int, calls: int, tmp: Path, events: list[str]) -> dict[str, object]:
    # A socket in the run's temporary directory, removed with it: the server is killed.
    addr = f"shm://{tmp}/count-{kind}-{time.monotonic_ns()}.sock"
    role = "serve-tonic-isthmus" if kind == "tonic" else "serve-isthmus"
    server = spawn([str(BENCH), role, addr])
    client_cmd = (
        [str(PYTHON), str(ROOT / "bench" / "py_client.py"), "count", addr, str(size), str(calls)]
        if kind == "python"
        else [str(BENCH), "count-client", kind, addr, str(size), str(calls)]
    )
    client = spawn(client_cmd)
    assert client.stdin is not None and client.stdout is not None
    try:
        own = Path(tempfile.mkdtemp(dir=tmp))  # this run's FIFOs and outputs
        sides = {name: Side(p.pid, own, name, events) for name, p in (("client", client), ("server", server))}
        for side in sides.values():
            side.command("enable")
        client.stdin.write("go\n")
        client.stdin.flush()
        done = client.stdout.readline().split()
        for side in sides.values():
            side.command("disable")
        if not done or done[0] != "DONE":
            raise SystemExit(f"{kind}: the client printed {done!r}")
        counts = {name: side.stop() for name, side in sides.items()}
        client.stdin.write("end\n")
        client.stdin.flush()
        client.wait(timeout=30)
    finally:
        for p in (client, server):
            if p.poll() is None:
                p.kill()
            p.wait()
    frames_sent, frames_received, doorbells, sleeps = (int(x) for x in done[1:5])
    return {
        "kind": kind,
        "counts": counts,
        "frames_sent": frames_sent / calls,
        "frames_received": frames_received / calls,
        "doorbells_rung": doorbells / calls,
        "sleeps": sleeps / calls,
    }


def table(results: list[dict[str, object]], calls: int, size: int) -> str:
    def per(c: dict[str, int], *events: str) -> str:
        return f"{sum(c.get(e, 0) for e in events) / calls:.2f}"

    allocs = [f"probe_libc:{f}" for f in ("malloc", "calloc", "realloc", "posix_memalign")]
    lines = [
        f"{size} B echo, {calls} calls, per call (client / server):",
        "",
        "| system | allocations (libc) | pthread mutex locks | futex | sched_yield | read+write | epoll waits"
        " | all system calls | frames sent / received (client) | doorbells rung, sleeps (client) |"
        " sleeps under the uprobes (client) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"engine": "isthmus-rust", "python": "py-isthmus-sync", "tonic": "tonic-isthmus-shm"}
    for r in results:
        counts: dict[str, dict[str, int]] = r["counts"]  # type: ignore[assignment]

        def both(*events: str, counts: dict[str, dict[str, int]] = counts) -> str:
            return f"{per(counts['client'], *events)} / {per(counts['server'], *events)}"

        lines.append(
            f"| {names[str(r['kind'])]} | {both(*allocs)} | {both('probe_libc:pthread_mutex_lock')}"
            f" | {both('syscalls:sys_enter_futex')} | {both('syscalls:sys_enter_sched_yield')}"
            f" | {both('syscalls:sys_enter_read', 'syscalls:sys_enter_write')}"
            f" | {both('syscalls:sys_enter_epoll_wait', 'syscalls:sys_enter_epoll_pwait')}"
            f" | {both('raw_syscalls:sys_enter')}"
            f" | {r['frames_sent']:.2f} / {r['frames_received']:.2f}"
            f" | {r['doorbells_rung']:.3f}, {r['sleeps']:.3f} | {r['probed_sleeps']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("kinds", nargs="*", help="engine, python, tonic (default: all three)")
    args = ap.parse_args()
    args.kinds = args.kinds or ["engine", "python", "tonic"]
    if unknown := set(args.kinds) - {"engine", "python", "tonic"}:
        ap.error(f"no system {', '.join(sorted(unknown))}")
    added = add_probes()
    try:
        with tempfile.TemporaryDirectory(prefix="isthmus-count-") as tmp:
            results = [measure(k, args.size, args.calls, Path(tmp)) for k in args.kinds]
    finally:
        for probe in added:
            subprocess.run(["perf", "probe", "-d", probe], check=False, capture_output=True)
    print(table(results, args.calls, args.size))


if __name__ == "__main__":
    sys.exit(main())
