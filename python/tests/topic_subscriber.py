"""A subscriber process for the topic tests: `python -m topic_subscriber ADDRESS COUNT`
subscribes to `/topic.Feed/Watch`, prints `READY` once its call is open, then `GOT seq` for
each message it checked (see `topic_server.message`), and `END code` when the stream ends."""

from __future__ import annotations

import sys

import grpc

import isthmus


def main() -> None:
    address, count = sys.argv[1], int(sys.argv[2])
    with isthmus.insecure_channel(address) as channel:
        watch = channel.unary_stream("/topic.Feed/Watch")
        stream = watch(b"")
        print("READY", flush=True)
        try:
            for got, m in enumerate(stream, 1):
                seq = int.from_bytes(m[:8], "little")
                ok = all(b == seq % 251 for b in m[8:])
                print(f"GOT {seq}" if ok else f"BAD {seq}", flush=True)
                if got == count:
                    break
            print("END OK", flush=True)
        except grpc.RpcError as e:
            print(f"END {e.code().name}", flush=True)


if __name__ == "__main__":
    main()
