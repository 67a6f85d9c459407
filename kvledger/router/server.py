"""``kvledger router``: one HTTP front end over kvledger servers (each one data-parallel replica),
dispatching every request by ``kvledger.router.policy`` from each replica's KV events.

The router tokenizes the prompt as the servers do (same tokenizer, same special tokens; chat
through the same template), hashes its full blocks with the servers' algorithm, and forwards the
request unchanged; responses (SSE included) are relayed byte for byte. A replica that refuses a
connection or breaks a response is taken out of rotation: the request fails with an OpenAI-style
error naming it, and the others keep serving; a health probe brings it back (with an empty index,
since its cache is unknown)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvledger.router.policy import NoReplicaError, Router
from kvledger.router.subscriber import EventSubscriber

logger = logging.getLogger("kvledger.router")


@dataclass
class Replica:
    url: str
    events_endpoint: str | None = None
    replay_endpoint: str | None = None


@dataclass
class RouterConfig:
    replicas: list[Replica]
    policy: str = "cache_aware"
    block_size: int = 16
    hash_algo: str = "sha256"
    overlap_weight: float = 0.25  # kvledger.router.policy.DEFAULT_OVERLAP_WEIGHT
    tokenizer: str | None = None  # folder or hub id; needed by cache_aware
    health_interval_s: float = 2.0
    default_max_tokens: int = 16
    errors: list[str] = field(default_factory=list)


def _error(status: int, message: str, type_: str = "server_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "code": status}}, status_code=status)


class Tokenizer:
    """The servers' tokenization of a request body, for hashing its blocks."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        from kvledger.tokenizer import bound_bpe_cache

        self.tok = AutoTokenizer.from_pretrained(path)
        bound_bpe_cache(self.tok)  # the router tokenizes every request too

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        try:
            if path.endswith("/chat/completions"):
                text = self.tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
                return self.tok(text, add_special_tokens=False).input_ids
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return prompt
            if isinstance(prompt, str):
                return self.tok(prompt, add_special_tokens=body.get("add_special_tokens", True)).input_ids
        except Exception:  # a malformed body: the replica answers it with its own 400
            return None
        return None  # batched prompts: dispatched by load alone


def build_router_app(cfg: RouterConfig) -> FastAPI:
    router = Router(len(cfg.replicas), cfg.policy, cfg.block_size, cfg.hash_algo, cfg.overlap_weight)
    tokenizer = Tokenizer(cfg.tokenizer) if cfg.tokenizer and cfg.policy == "cache_aware" else None
    ids = itertools.count()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        zctx = zmq.asyncio.Context()
        subs = []
        for rank, rep in enumerate(cfg.replicas):
            if rep.events_endpoint:
                s = EventSubscriber(zctx, rep.events_endpoint, router.replicas[rank].index, rep.replay_endpoint)
                s.start()
                subs.append(s)
        # Idle upstream connections expire well before a replica's keep-alive (uvicorn: 5 s), so
        # the router never sends a request on a connection the replica is closing, which would
        # fail that request and take a healthy replica out of rotation.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024, keepalive_expiry=2.0)
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits)
        probe = asyncio.get_running_loop().create_task(_probe_loop())
        try:
            yield
        finally:
            probe.cancel()
            for s in subs:
                s.close()
            await state["client"].aclose()
            zctx.term()

    async def _probe_loop() -> None:
        """Bring a dead replica back once its /health answers 200."""
        while True:
            await asyncio.sleep(cfg.health_interval_s)
            for rank, rep in enumerate(cfg.replicas):
                r = router.replicas[rank]
                if r.alive:
                    continue
                try:
                    ok = (await state["client"].get(f"{rep.url}/health", timeout=2.0)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    r.index.clear()
                    r.alive = True
                    logger.warning("replica %d (%s) is healthy again: back in rotation", rank, rep.url)

    def _dead(rank: int, exc: BaseException) -> str:
        rep = cfg.replicas[rank]
        if router.replicas[rank].alive:
            lost = router.mark_dead(rank)
            logger.error("replica %d (%s) failed (%s): out of rotation, %d in-flight requests fail", rank, rep.url, exc, len(lost))
        return f"data-parallel replica {rank} ({rep.url}) failed: {type(exc).__name__}: {exc}"

    app = FastAPI(title="kvledger router", lifespan=lifespan)

    async def proxy(request: Request) -> Response:
        path = request.url.path
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        token_ids = tokenizer.token_ids(path, body) if tokenizer is not None else None
        try:
            if token_ids is not None:
                hashes = router.block_hashes(token_ids)
                decision = router.choose(token_ids, hashes=hashes)
            else:
                hashes, token_ids = [], []
                decision = router.choose([], hashes=[])
        except NoReplicaError as e:
            return _error(503, str(e))
        rid = f"route-{next(ids)}"
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or cfg.default_max_tokens)
        router.dispatched(rid, decision, token_ids, max_tokens, hashes)
        rank = decision.rank
        rep = cfg.replicas[rank]
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type", "x-request-id")}
        client: httpx.AsyncClient = state["client"]
        try:
            req = client.build_request(request.method, f"{rep.url}{path}", content=raw, headers=headers)
            upstream = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            router.finished(rid)
            return _error(503, _dead(rank, e))
        out_headers = {"x-kvledger-replica": str(rank)}
        if not body.get("stream"):
            try:
                content = await upstream.aread()
            except httpx.HTTPError as e:
                router.finished(rid)
                return _error(502, _dead(rank, e))
            finally:
                await upstream.aclose()
            router.finished(rid)
            return Response(content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type"), headers=out_headers)

        async def relay() -> AsyncIterator[bytes]:
            first = True
            try:
                async for chunk in upstream.aiter_raw():
                    if first:
                        router.prefilled(rid)
                        first = False
                    yield chunk
            except httpx.HTTPError as e:
                msg = _dead(rank, e)
                yield f"data: {json.dumps({'error': {'message': msg, 'type': 'server_error', 'code': 502}})}\n\n".encode()
            finally:
                router.finished(rid)
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code, media_type=upstream.headers.get("content-type"), headers=out_headers)

    for p in ("/v1/completions", "/v1/chat/completions"):
        app.post(p)(proxy)

    @app.get("/health")
    async def health() -> Response:
        if not router.live():
            return _error(503, "no data-parallel replica is alive")
        return JSONResponse({"status": "ok", "replicas_alive": len(router.live())})

    @app.get("/v1/models")
    async def models() -> Response:
        for rank, rep in enumerate(cfg.replicas):
            if router.replicas[rank].alive:
                try:
                    r = await state["client"].get(f"{rep.url}/v1/models")
                    return Response(r.content, status_code=r.status_code, media_type="application/json")
                except httpx.HTTPError as e:
                    _dead(rank, e)
        return _error(503, "no data-parallel replica is alive")

    @app.get("/router/state")
    async def router_state() -> JSONResponse:
        return JSONResponse({"policy": router.policy, "replicas": router_status(router, cfg)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(router, cfg), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.state.router = router
    return app


def router_status(router: Router, cfg: RouterConfig) -> list[dict[str, Any]]:
    return [
        {
            "rank": r.rank,
            "url": cfg.replicas[r.rank].url,
            "alive": r.alive,
            "cached_blocks": len(r.index.hashes),
            "events_seq": r.index.last_seq,
            "events_lost": r.index.gaps,
            "queued_tokens": r.queued_tokens,
            "active_blocks": r.active_blocks,
            "num_requests": r.num_requests,
            "dispatched": r.dispatched,
            "hit_blocks": r.hit_blocks,
        }
        for r in router.replicas
    ]


def render_metrics(router: Router, cfg: RouterConfig) -> str:
    """Per replica (label ``replica``) and in total (no label), Prometheus text format."""
    rows = router_status(router, cfg)
    lines = []
    for name, key, kind in (
        ("kvledger_router_replica_alive", "alive", "gauge"),
        ("kvledger_router_requests_total", "dispatched", "counter"),
        ("kvledger_router_prefix_hit_blocks_total", "hit_blocks", "counter"),
        ("kvledger_router_requests_in_flight", "num_requests", "gauge"),
        ("kvledger_router_queued_prefill_tokens", "queued_tokens", "gauge"),
        ("kvledger_router_active_kv_blocks", "active_blocks", "gauge"),
        ("kvledger_router_indexed_blocks", "cached_blocks", "gauge"),
    ):
        lines.append(f"# TYPE {name} {kind}")
        for r in rows:
            lines.append(f'{name}{{replica="{r["rank"]}"}} {int(r[key])}')
        lines.append(f"{name} {sum(int(r[key]) for r in rows)}")
    return "\n".join(lines) + "\n"
