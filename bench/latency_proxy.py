"""A TCP proxy on loopback that adds a fixed delay to every request, so that DynamoDB Local
answers with the latency of a real AWS endpoint (a few milliseconds per call) instead of a
loopback round trip. A catch-up on the bare emulator is bound by the emulator's CPU; through
this proxy it is bound by latency, as against DynamoDB, and write concurrency shows.

Each chunk a client sends is forwarded after `--delay-ms`; answers come back at once. HTTP/1.1
requests of the SDK are one chunk each, so every call waits the delay once.

Usage: python -m bench.latency_proxy --listen 8130 --upstream 8120 --delay-ms 5 [--seconds 3600]
Listens on 127.0.0.1 only and stops by itself after --seconds.
"""

from __future__ import annotations

import argparse
import asyncio


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    try:
        while chunk := await reader.read(65536):
            if delay:
                await asyncio.sleep(delay)
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def serve(listen: int, upstream: int, delay: float, seconds: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, up_w, delay), pipe(up_r, client_w, 0.0))

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await asyncio.sleep(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=int, required=True)
    p.add_argument("--upstream", type=int, required=True)
    p.add_argument("--delay-ms", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=3600.0)
    a = p.parse_args()
    asyncio.run(serve(a.listen, a.upstream, a.delay_ms / 1000.0, a.seconds))


if __name__ == "__main__":
    main()
