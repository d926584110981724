"""The P/D proxy of the serve bench's ``mooncake`` row (vLLM's MooncakeConnector behind HTTP).

vLLM's toy proxy, which the other P/D rows run unchanged, hands the decode what the prefill's
response says in ``kv_transfer_params``. MooncakeConnector (vLLM 0.32) says nothing there: its
prefill saves a request only when the request names a ``transfer_id``, and its decode needs that
id, the prefill's engine id (``engine_id`` of its ``--kv-transfer-config``) and the address of
the bootstrap server its workers registered with. This proxy gives them, and otherwise does what
the toy proxy does, in the same order, so that the rows compare connectors and not proxies: per
request, round-robin, the prefill (``max_tokens`` 1, not streamed) and, once it has answered,
the decode, whose answer streams to the client as it comes.

    python -m kvferry.app.bench.engine.mooncake_proxy --port P --bootstrap http://127.0.0.1:B \\
        --prefill http://127.0.0.1:8100 ENGINE_ID --decode http://127.0.0.1:8200

It runs where vLLM is installed (aiohttp comes with it); :func:`prefill_body` and
:func:`decode_body` are the hand-off, pure.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import uuid
from collections.abc import Mapping
from typing import Any

__all__ = ["prefill_body", "decode_body", "main"]

#: Seconds one upstream request may take (the servers' own limits are far below).
UPSTREAM_S = 600.0


def prefill_body(body: Mapping[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill's request for client request ``body``: its first token only, not streamed,
    saved under ``transfer_id``. ``body`` is left as it is."""
    out = dict(body)
    out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    out["max_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: Mapping[str, Any], transfer_id: str, engine_id: str, bootstrap: str) -> dict[str, Any]:
    """The decode's request for client request ``body``: the client's own, pulling the KV saved
    under ``transfer_id`` by prefill engine ``engine_id`` (its workers found at ``bootstrap``)."""
    out = dict(body)
    out["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap,
    }
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bootstrap", required=True, help="the bootstrap server's URL (http://host:port)")
    parser.add_argument("--prefill", nargs=2, action="append", required=True, metavar=("URL", "ENGINE_ID"))
    parser.add_argument("--decode", action="append", required=True, metavar="URL")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import aiohttp
    from aiohttp import web

    args = _parse(argv)
    prefills = itertools.cycle([(url.rstrip("/"), engine) for url, engine in args.prefill])
    decodes = itertools.cycle([url.rstrip("/") for url in args.decode])
    timeout = aiohttp.ClientTimeout(total=UPSTREAM_S)
    sessions: list[aiohttp.ClientSession] = []

    async def start(app: web.Application) -> None:
        sessions.append(aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)))

    async def stop(app: web.Application) -> None:
        for session in sessions:
            await session.close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        transfer_id = f"kvferry-bench-{uuid.uuid4().hex}"
        (prefill, engine_id), decode = next(prefills), next(decodes)
        session = sessions[0]
        async with session.post(prefill + request.path, json=prefill_body(body, transfer_id)) as r:
            answer = await r.read()
            if r.status != 200:  # the client sees the prefill's error as it is
                return web.Response(status=r.status, body=answer, content_type="application/json")
        async with session.post(
            decode + request.path, json=decode_body(body, transfer_id, engine_id, args.bootstrap)
        ) as r:
            out = web.StreamResponse(status=r.status)
            out.content_type = r.content_type
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/healthcheck", health)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
