"""A loopback TCP proxy that holds each HTTP request N ms before forwarding it: cloud first-byte latency.

    python benchmarks/latency_proxy.py --target 127.0.0.1:8333 --latency-ms 30 [--port 0]

Prints ``listening PORT`` on stdout once it accepts connections; runs until terminated. Per
connection, the first bytes of every request are held ``--latency-ms`` before they go to the
server: a request starts when the client sends after the server last answered (or on a new
connection), so keep-alive connections pay the latency once per request, and the bytes of a
request body that follow its head are not held again (a body sent after ``100 Continue`` is,
as a real round trip would be). Connection set-up is not delayed (no TLS handshake here).
Bytes are copied in 1 MiB reads; the proxy is a separate process so its CPU is counted apart
(``bench.py`` reports it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

BUF = 1 << 20


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, before_chunk=None,
               after_chunk=None) -> None:
    try:
        while True:
            data = await reader.read(BUF)
            if not data:
                break
            if before_chunk is not None:
                await before_chunk()
            if after_chunk is not None:
                after_chunk()
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            pass


async def handle(creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter, host: str, port: int,
                 delay: float) -> None:
    try:
        sreader, swriter = await asyncio.open_connection(host, port, limit=BUF)
    except OSError:
        cwriter.close()
        return
    state = {"new_request": True}

    async def hold() -> None:
        if state["new_request"]:
            state["new_request"] = False
            if delay > 0:
                await asyncio.sleep(delay)

    def answered() -> None:
        state["new_request"] = True

    up = asyncio.create_task(pipe(creader, swriter, before_chunk=hold))
    down = asyncio.create_task(pipe(sreader, cwriter, after_chunk=answered))
    await asyncio.wait([up, down], return_when=asyncio.ALL_COMPLETED)
    for w in (swriter, cwriter):
        try:
            w.close()
        except OSError:
            pass


async def main_async(args: argparse.Namespace) -> None:
    host, _, port = args.target.rpartition(":")
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, host, int(port), args.latency_ms / 1000), "127.0.0.1", args.port,
        limit=BUF, backlog=512)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="HOST:PORT of the server (loopback)")
    ap.add_argument("--latency-ms", type=float, required=True)
    ap.add_argument("--port", type=int, default=0, help="port to listen on, 127.0.0.1 (0: any free)")
    args = ap.parse_args()
    if not args.target.startswith(("127.", "localhost:")):
        sys.exit("latency_proxy: the target must be on loopback")
    try:
        asyncio.run(main_async(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
