"""The OpenAI-compatible HTTP server: FastAPI over AsyncEngine, assembled here.

The endpoints live one family per module: serving_completion (/v1/completions), serving_chat
(/v1/chat/completions), serving_messages (Anthropic's /v1/messages) and serving_responses
(OpenAI's /v1/responses), both over the chat path of chat_run; the pooling runner's
serving_embedding (/v1/embeddings), serving_classify (/classify, /pooling) and serving_score
(/score, /rerank), over pooling_inputs; ops (health, version, models, ledger, metrics,
tokenize), worker_info (what routers such as sglang-router read from a worker), with what
they share in serving (ServingContext) and streaming (the one SSE loop). Errors are OpenAI's
JSON (errors); the guard checks keys and body size before any parsing (guard). Input errors
are 400s and touch no other request; a 500 means a bug in kvledger.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from kvledger.engine.async_core_engine import AsyncCoreEngine
from kvledger.server.errors import APIError, error_response, install_error_handlers
from kvledger.server.guard import Guard
from kvledger.server.http_metrics import HTTPMetrics
from kvledger.server.metrics import ServerMetrics
from kvledger.server.serving import ServingContext
from kvledger.version import __version__

if TYPE_CHECKING:
    from kvledger.core.engine import LLMEngine
    from kvledger.engine.async_engine import AsyncEngine

__all__ = ["APIError", "DEFAULT_MAX_BODY_BYTES", "ServerConfig", "build_app", "error_response"]

logger = logging.getLogger("kvledger.server")

DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_path: str = ""
    api_key: str | list[str] | None = None  # one key or several, each accepted
    chat_template: str | None = None  # overrides the tokenizer's
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    dashboard: bool = True  # GET /dashboard (kvledger/server/dashboard.py)
    created: int = field(default_factory=lambda: int(time.time()))
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])  # CORS, as vLLM
    allow_credentials: bool = False
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    root_path: str = ""  # a proxy's path prefix
    log_requests: bool = True
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # kvledger.server.tools.TOOL_PARSERS
    reasoning_parser: str | None = None  # kvledger.reasoning.parsers.REASONING_PARSERS
    structured_outputs_config: dict[str, Any] = field(default_factory=dict)  # server defaults

    @property
    def api_keys(self) -> list[str]:
        if self.api_key is None:
            return []
        return [self.api_key] if isinstance(self.api_key, str) else list(self.api_key)


def build_app(engine: LLMEngine | AsyncCoreEngine, config: ServerConfig) -> FastAPI:
    """The app over an engine in this process (an ``LLMEngine``: stepped by a thread) or over
    engine core processes (an ``AsyncCoreEngine``, what ``kvledger serve`` starts)."""
    model_name = config.served_model_names[0]
    metrics = ServerMetrics(model_name)
    aengine: AsyncEngine | AsyncCoreEngine
    if isinstance(engine, AsyncCoreEngine):
        aengine = engine
        aengine.observer = metrics
    else:  # the engine runs in this process: only then is the in-process front loaded
        from kvledger.engine.async_engine import AsyncEngine

        aengine = AsyncEngine(engine, observer=metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            aengine.shutdown()
            logger.info("engine stopped; every request aborted")

    app = FastAPI(
        title="kvledger", version=__version__, lifespan=lifespan, root_path=config.root_path
    )
    app.state.engine = aengine
    app.state.metrics = metrics
    app.add_middleware(Guard, api_keys=config.api_keys, max_body_bytes=config.max_body_bytes)
    # Outside the guard, so its 401s / 413s are counted per endpoint too (vLLM's http_* series).
    app.add_middleware(HTTPMetrics, registry=metrics.registry, routes=lambda: app.router.routes)
    # CORS outermost (added last), so that preflights and 401s carry its headers, as in vLLM
    app.add_middleware(
        CORSMiddleware,
        allow_origins=config.allowed_origins,
        allow_credentials=config.allow_credentials,
        allow_methods=config.allowed_methods,
        allow_headers=config.allowed_headers,
    )
    if config.dashboard:
        from kvledger.server.dashboard import mount_dashboard

        keys = config.api_keys
        mount_dashboard(app, aengine, model_name, keys[0] if keys else None)
    install_error_handlers(app)

    from kvledger.server.ops import mount_ops
    from kvledger.server.serving_chat import mount_chat
    from kvledger.server.serving_classify import mount_classify
    from kvledger.server.serving_completion import mount_completions
    from kvledger.server.serving_embedding import mount_embeddings
    from kvledger.server.serving_messages import mount_messages
    from kvledger.server.serving_responses import mount_responses
    from kvledger.server.serving_score import mount_score
    from kvledger.server.worker_info import mount_worker_info

    ctx = ServingContext(aengine, config)
    mount_completions(app, ctx)
    mount_chat(app, ctx)
    mount_messages(app, ctx)
    mount_responses(app, ctx)
    mount_embeddings(app, ctx)
    mount_classify(app, ctx)
    mount_score(app, ctx)
    mount_ops(app, ctx, metrics)
    mount_worker_info(app, ctx)
    return app
