"""What a production router asks of its workers, beside /health: SGLang's model gateway
(``sglang-router``) reads ``/server_info`` and ``/model_info`` (``/get_*`` are the older names)
when a worker registers, and polls ``/get_load`` for its load-aware policies. Same shapes as
an SGLang worker, filled from the engine: with ``-dp N`` the server is N data-parallel ranks,
each with its own load."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvledger.errors import EngineDeadError
from kvledger.server.serving import ServingContext
from kvledger.version import __version__


def mount_worker_info(app: FastAPI, ctx: ServingContext) -> None:
    aengine, config = ctx.aengine, ctx.config
    info = aengine.info
    dp_size = len(getattr(aengine, "clients", ())) or 1  # engine-core processes; else one thread
    tokenizer_path = info.tokenizer or config.model_path

    async def server_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": config.model_path,
                "served_model_name": ctx.model_name,
                "tokenizer_path": tokenizer_path,
                "dp_size": dp_size,
                "tp_size": info.tensor_parallel_size,
                "version": __version__,
                "max_total_tokens": info.num_blocks * info.block_size,
                "max_running_requests": info.max_num_seqs,
                "max_prefill_tokens": info.max_num_batched_tokens,
                "context_length": info.max_model_len,
                "block_size": info.block_size,
                "prefix_caching_hash_algo": info.prefix_caching_hash_algo,
            }
        )

    async def model_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": config.model_path,
                "tokenizer_path": tokenizer_path,
                "is_generation": True,
                "model_type": info.model_type,
                "architectures": info.architectures,
            }
        )

    async def get_load() -> JSONResponse:
        loads = []
        for rank in range(dp_size):
            try:  # engine_info's named query, of each rank
                s = await (aengine.query("load", engine_index=rank) if dp_size > 1 else aengine.query("load"))
            except EngineDeadError:
                continue  # a dead replica takes no load; /health says the rest
            loads.append(
                {
                    "dp_rank": rank,
                    "num_reqs": s["running"] + s["waiting"] + s["swapped"],
                    "num_waiting_reqs": s["waiting"] + s["swapped"],
                    "num_tokens": s["used_blocks"] * info.block_size,
                }
            )
        return JSONResponse(loads)

    for path, fn in (("server_info", server_info), ("model_info", model_info)):
        app.get(f"/{path}")(fn)
        app.get(f"/get_{path}")(fn)
    app.get("/get_load")(get_load)
