"""A Python server whose handler threads read their connection while they wait for calls
(ADR 0020): every shape of call, from several client threads at once on one connection, with
deadlines passing and streams that run out of flow-control credit, and none lost or mixed up.
The reader task lends its receiver to a waiting handler thread and takes it back when a call
needs a frame nobody reads; these calls exercise every way back."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType

import grpc
from echo_servicer import pattern
from peer import Served

import isthmus

THREADS = 6
ROUNDS = 60


def _worker(stub: object, pb: ModuleType, index: int, errors: list[str]) -> None:
    def check(cond: bool, what: str) -> None:
        if not cond:
            errors.append(f"thread {index}: {what}")

    for round_ in range(ROUNDS):
        seq = index * 100_000 + round_
        payload = pattern(64 + round_, seq)
        reply = stub.Unary(pb.EchoRequest(payload=payload, seq=seq), timeout=60)  # type: ignore[attr-defined]
        check(reply.payload == payload and reply.seq == seq, f"unary {seq} came back wrong")
        if round_ % 10 == 3:
            # Its handler waits for each request: the server's reader must be there to read it.
            requests = [pb.EchoRequest(payload=pattern(100 * i, i), seq=i) for i in range(5)]
            got = [(r.seq, r.payload) for r in stub.Bidi(iter(requests), timeout=60)]  # type: ignore[attr-defined]
            check(got == [(r.seq, r.payload) for r in requests], f"bidi in round {round_} came back wrong")
        if round_ % 15 == 7:
            # 10 MiB of replies: more than a stream's credit, so the handler waits for WINDOW frames.
            out = list(stub.ServerStream(pb.StreamRequest(count=40, size=256 << 10), timeout=60))  # type: ignore[attr-defined]
            check(
                [r.seq for r in out] == list(range(40))
                and all(r.payload == pattern(256 << 10, r.seq) for r in out),
                f"server stream in round {round_} came back wrong",
            )
        if round_ % 20 == 11:
            summary = stub.ClientStream(  # type: ignore[attr-defined]
                iter([pb.EchoRequest(payload=pattern(1000, i), seq=i) for i in range(20)]), timeout=60
            )
            check(
                summary.count == 20 and summary.bytes == 20_000, f"client stream in round {round_}: {summary}"
            )
        if round_ % 25 == 5:
            # A handler that outlives its deadline: the server ends it, the client sees the deadline.
            try:
                stub.Unary(pb.EchoRequest(payload=b"late", seq=seq, sleep_ms=2_000), timeout=0.05)  # type: ignore[attr-defined]
                check(False, "a call past its deadline succeeded")
            except grpc.RpcError as e:
                check(e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, f"late call: {e.code()}")


def test_calls_of_every_shape_from_many_threads_all_come_back(
    servers: Callable[[str], Served], pb: ModuleType, pb_grpc: ModuleType
) -> None:
    served = servers("isthmus")
    errors: list[str] = []
    with isthmus.insecure_channel(served.addresses["shm"]) as channel:
        stub = pb_grpc.EchoStub(channel)
        threads = [threading.Thread(target=_worker, args=(stub, pb, i, errors)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads), "a client thread is stuck"
        assert errors == []
        # And the connection still serves one caller alone, whose calls the same handler
        # thread reads one after another.
        for seq in range(200):
            assert stub.Unary(pb.EchoRequest(payload=b"after", seq=seq), timeout=60).seq == seq


def test_a_long_handler_does_not_hold_up_the_other_calls_of_its_connection(
    servers: Callable[[str], Served], pb: ModuleType, pb_grpc: ModuleType
) -> None:
    """While one handler sleeps (on a thread that had been reading the connection), calls on the
    same connection still reach free handler threads and come back; none waits for the sleeper."""
    served = servers("isthmus")
    with isthmus.insecure_channel(served.addresses["shm"]) as channel:
        stub = pb_grpc.EchoStub(channel)
        for seq in range(50):  # the handler threads settle into reading the connection
            stub.Unary(pb.EchoRequest(payload=b"warm", seq=seq), timeout=60)
        slow = stub.Unary.future(pb.EchoRequest(payload=b"slow", seq=1, sleep_ms=3_000), timeout=60)
        done = 0
        while not slow.done() and done < 500:
            stub.Unary(pb.EchoRequest(payload=b"beside", seq=done), timeout=60)
            done += 1
        # The sleeper finishes after 3 s; 500 calls beside it take far less unless they waited.
        assert not slow.done() or done == 500, f"only {done} calls went while the slow one ran"
        assert slow.result(timeout=60).payload == b"slow"
