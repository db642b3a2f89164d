"""A real grpcio client against an isthmus server's standard endpoint.

Usage: python grpcio_client.py TARGET PROTO_DIR
TARGET is what grpcio takes (`unix:/path.sock`, `localhost:50051`); the channel gets no special
options, as a user's would not. Stubs are generated from the conformance proto by grpcio-tools.
Prints one line per check and exits non-zero at the first failure.
"""

import importlib
import sys
import tempfile

import grpc
from grpc_tools import protoc


def stubs(proto_dir: str, out: str):
    args = [
        "protoc",
        f"-I{proto_dir}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"{proto_dir}/conformance.proto",
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    sys.path.insert(0, out)
    return importlib.import_module("conformance_pb2"), importlib.import_module("conformance_pb2_grpc")


def main() -> int:
    target, proto_dir = sys.argv[1], sys.argv[2]
    with (
        tempfile.TemporaryDirectory(prefix="isthmus-stubs-") as out,
        grpc.insecure_channel(target) as channel,
    ):
        pb, rpc = stubs(proto_dir, out)
        echo = rpc.EchoStub(channel)

        reply, call = echo.Unary.with_call(
            pb.EchoRequest(payload=b"hello", seq=7),
            metadata=[("x-echo", "hi"), ("x-echo-bin", b"\x00\x01\xff")],
            timeout=30,
        )
        assert reply.payload == b"hello" and reply.seq == 7, reply
        # grpc-core rounds the timeout it sends up to a coarser unit (30 s can travel as 30100m).
        assert 0 < reply.time_left_ms <= 31_000, reply.time_left_ms
        initial = dict(call.initial_metadata())
        assert initial.get("x-echo") == "hi" and initial.get("x-echo-bin") == b"\x00\x01\xff", initial
        print("unary ok")

        replies = list(echo.ServerStream(pb.StreamRequest(count=50, size=10_000)))
        assert [r.seq for r in replies] == list(range(50)) and all(len(r.payload) == 10_000 for r in replies)
        print("server streaming ok")

        big = pb.EchoRequest(payload=b"\x5a" * (2 << 20), seq=1)
        assert len(echo.Unary(big, timeout=60).payload) == 2 << 20  # under grpcio's default 4 MiB limit
        print("2 MiB unary ok")

        try:
            echo.Unary(pb.EchoRequest(fail_with=grpc.StatusCode.ABORTED.value[0], fail_message="stop"))
            raise SystemExit("expected ABORTED")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.ABORTED and e.details() == "stop", (e.code(), e.details())
            assert dict(e.trailing_metadata()).get("x-failed") == "yes", e.trailing_metadata()
        print("status ok")

        try:
            echo.Unary(pb.EchoRequest(sleep_ms=10_000), timeout=0.2)
            raise SystemExit("expected DEADLINE_EXCEEDED")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.code()
        print("deadline ok")

        channel_ready = grpc.channel_ready_future(channel)
        channel_ready.result(timeout=10)
        bidi = echo.Bidi(iter([pb.EchoRequest(payload=b"x" * i, seq=i) for i in range(20)]))
        assert [len(r.payload) for r in bidi] == list(range(20))
        print("bidi ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
