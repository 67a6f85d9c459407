"""What a production router asks of its workers, beside /health: SGLang's model gateway
(``sglang-router``) reads ``/server_info`` and ``/model_info`` (``/get_*`` are the older names)
when a worker registers, and polls ``/get_load`` for its load-aware policies. Same shapes as
an SGLang worker, filled from the engine; kvledger serves one data-parallel rank per server."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

import kvledger
from kvledger.server.serving import ServingContext


def mount_worker_info(app: FastAPI, ctx: ServingContext) -> None:
    aengine, config = ctx.aengine, ctx.config
    engine = aengine.engine
    tokenizer_path = engine.config.tokenizer or config.model_path

    async def server_info() -> JSONResponse:
        sc = engine.config.scheduler
        return JSONResponse(
            {
                "model_path": config.model_path,
                "served_model_name": ctx.model_name,
                "tokenizer_path": tokenizer_path,
                "dp_size": 1,
                "version": kvledger.__version__,
                "max_total_tokens": engine.kv.pool.num_blocks * engine.kv.block_size,
                "max_running_requests": sc.max_num_seqs,
                "max_prefill_tokens": sc.max_num_batched_tokens,
                "context_length": engine.max_model_len,
                "block_size": engine.kv.block_size,
                "prefix_caching_hash_algo": engine.kv.hash_algo,
            }
        )

    async def model_info() -> JSONResponse:
        hf = engine.hf_config
        return JSONResponse(
            {
                "model_path": config.model_path,
                "tokenizer_path": tokenizer_path,
                "is_generation": True,
                "model_type": hf.get("model_type"),
                "architectures": hf.get("architectures"),
            }
        )

    def _load(engine) -> dict:
        s = engine.scheduler
        return {
            "dp_rank": 0,
            "num_reqs": len(s.running) + len(s.waiting) + len(s.swapped),
            "num_waiting_reqs": len(s.waiting) + len(s.swapped),
            "num_tokens": engine.kv.num_used_blocks * engine.kv.block_size,
        }

    async def get_load() -> JSONResponse:
        return JSONResponse([await aengine.run_in_engine(_load)])

    for path, fn in (("server_info", server_info), ("model_info", model_info)):
        app.get(f"/{path}")(fn)
        app.get(f"/get_{path}")(fn)
    app.get("/get_load")(get_load)
