"""`kvledger serve [MODEL]`: the OpenAI-compatible HTTP server (completions, chat, ledger,
Prometheus metrics)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvledger import envs
from kvledger.commands.engine_args import add_engine_args, engine_kwargs
from kvledger.errors import ConfigError

SHUTDOWN_GRACE_S = 5  # seconds in-flight responses get to finish on Ctrl-C / SIGTERM


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL over HTTP: /v1/completions, /v1/chat/completions (SSE "
        "streaming), /v1/models, /v1/ledger (the live KV ledger), /metrics (Prometheus), "
        "/health, /dashboard (the ledger drawn live). With no MODEL, serves the embedded "
        "default stories260k (a real "
        "260K-parameter Llama trained on TinyStories; MIT); 'kvledger-tiny' names the "
        "random-weight test model.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model folder, hub id, or kvledger-tiny (default: the embedded stories260k)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*; several keys (repeated or listed) "
        "are each accepted (default: $VLLM_API_KEY and $KVLEDGER_API_KEY; /health, /metrics, "
        "/tokenize stay open, as in vLLM)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help='CORS allowed origins, a JSON list (default: ["*"], as vLLM)',
    )
    p.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow credentials"
    )
    p.add_argument(
        "--allowed-methods", type=_json_list, default=["*"], help="CORS allowed methods (JSON list)"
    )
    p.add_argument(
        "--allowed-headers", type=_json_list, default=["*"], help="CORS allowed headers (JSON list)"
    )
    p.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a proxy serves the API under (FastAPI/uvicorn root_path)",
    )
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key file (PEM)")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate file (PEM)")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates file (PEM)")
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log each request's id, prompt size and sampling parameters",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (its access log is at info; default: info)",
    )
    p.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no uvicorn access-log line per HTTP request (vLLM's flag)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model' (default: MODEL as given, or stories260k)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template, as a file or the template itself (default: the tokenizer's)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto": the --tool-call-parser finds tool calls in the text',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json", "mistral", "pythonic"],
        help="the model family's tool-call format, for tool_choice auto",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["deepseek_r1", "qwen3"],
        help="separate a reasoning model's <think>...</think> into the message's reasoning field "
        "(grammars and tool parsing then apply to the answer after it)",
    )
    p.add_argument(
        "--structured-outputs-config",
        default=None,
        help='JSON defaults for structured outputs, e.g. \'{"disable_any_whitespace": true}\' '
        '(backend: "auto" (default: xgrammar, llguidance for what xgrammar refuses), "xgrammar" or "guidance"; '
        'max_whitespace_cnt: whitespace characters per JSON gap, default 4, null: unbounded)',
    )
    p.add_argument(
        "--max-body-bytes",
        default="1MiB",
        help="larger request bodies get a 413 (default: 1MiB)",
    )
    p.add_argument(
        "--no-dashboard",
        action="store_true",
        help="do not serve the live dashboard page at /dashboard (same API-key rules as /v1/*)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: info)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in its own process, fed over ZMQ by the HTTP front end "
        "(vLLM v1's split; default); --no-engine-process steps it in a thread of the server's "
        "process",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine cores (processes, each with its own KV pool) behind this one front end, "
        "each request sent to one of them by --dp-routing (default: 1)",
    )
    p.add_argument(
        "--dp-routing",
        choices=["cache_aware", "round_robin", "least_loaded"],
        default="cache_aware",
        help="how a request picks its core when --data-parallel-size > 1: cache_aware (exact "
        "prefix overlap from the cores' KV events, plus load), round_robin, least_loaded",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice, one per core); small models on "
        "a busy machine run far faster with 1",
    )
    p.add_argument(
        "--populate-kv-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU: map every page of the KV pool at start-up, as vLLM allocates its cache "
        "(default), so the first requests do not pay the page faults; --no-populate-kv-cache "
        "maps pages as blocks are first written (resident memory then follows use)",
    )
    add_engine_args(p)


def serve_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags; ``--max-prefill-tokens-while-decoding 0`` means no cap (None).

    The server used to cap prefills at 512 tokens a step while requests decode (its steps were
    slow then: TTFT p50 746 vs 1,997 ms at 64 streams). With the decode attention split and
    specialised, no cap, vLLM's behaviour, measured better on the opening burst's first tokens
    in every configuration tried (TTFT p99 -7 % to -33 %, tiny and 60M bf16, 8 and 64 streams;
    docs/measurements/serving_settings.md, "no prefill cap"), so it is the default again."""
    kw = engine_kwargs(args)
    if not kw.get("max_prefill_tokens_while_decoding"):
        kw.pop("max_prefill_tokens_while_decoding", None)
    return kw


def _json_list(text: str) -> list[str]:
    """vLLM's CORS flags take a JSON list of strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings like ["*"], got {text!r}')
    return value


def api_keys_from(args_keys: list[str] | None) -> list[str]:
    """--api-key wins (all of them); else $VLLM_API_KEY and $KVLEDGER_API_KEY, each if set."""
    if args_keys:
        return [k for k in args_keys if k]
    return [k for k in (envs.VLLM_API_KEY, envs.KVLEDGER_API_KEY) if k]


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's contents, or the Jinja template itself."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a template too long to be a path
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read chat template {value!r}: {e}") from None
    elif "{" in value:
        # A one-line shell argument: read "\\n" as a newline, as vLLM does.
        text = (
            value.encode().decode("unicode_escape") if "\\n" in value and value.isascii() else value
        )
    else:
        raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"chat template does not parse: {e}") from None
    return text


def capacity_line(info: Any) -> str:
    """The ledger's capacity (from an ``EngineInfo``), as `kvledger plan` would state it."""
    from kvledger.cache.attention_policy import cdiv
    from kvledger.ledger.accounting import format_bytes

    blocks, bs, bpt = info.num_blocks, info.block_size, info.bytes_per_token
    max_len = info.max_model_len
    concurrency = blocks // cdiv(max_len, bs)
    return (
        f"KV cache: {blocks:,} blocks x {bs} tokens = {blocks * bs:,} tokens, "
        f"{bpt:,} bytes/token, {format_bytes(blocks * bs * bpt)}; "
        f"max concurrency at max-model-len {max_len}: {concurrency} requests"
    )


OMP_SPIN_COUNT = "1000000"  # ~26 ms of spinning on this machine's cores, then sleep


def set_omp_wait_defaults(env) -> None:
    """How OpenMP workers wait between parallel regions, unless the user said
    (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set: both kept as they are).

    Workers that spin without bound (libgomp's ACTIVE) take the core the other process (front end or
    engine core) needs: on 2 shared cores the engine core ran ~10x slower, and an idle server would
    keep a core busy. Workers that sleep at once (PASSIVE) must be woken for each of a step's ~100
    parallel regions, and the cores sat idle between them: bf16 60M model, 8 streams, 324-350 tok/s.
    A bounded spin bridges the gaps: 10,000 spins (~0.26 ms) covered those inside a step, 464-474
    tok/s; 1,000,000 (~26 ms) also covers the engine core's work between steps (outputs, scheduling,
    inputs: 2-3 ms), so the worker is never put to sleep and woken again while requests run: +11 %
    tok/s at 56 streams and +17 % at 8 (medians of five alternated runs each, 60M bf16,
    docs/measurements/serving_settings.md, "OpenMP spin of 1,000,000"). An idle server's workers
    stop spinning ~26 ms after its last step.
    """
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT


def run(args: argparse.Namespace) -> int:
    set_omp_wait_defaults(os.environ)  # before torch loads libgomp
    from kvledger.ledger.accounting import parse_size

    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s:     %(name)s: %(message)s")
    log = logging.getLogger("kvledger.server")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    max_body = parse_size(args.max_body_bytes)
    if max_body <= 0:
        raise ConfigError("--max-body-bytes must be positive")
    template = load_chat_template(args.chat_template) if args.chat_template else None
    from kvledger.server.structured_fields import parse_structured_outputs_config

    so_config = parse_structured_outputs_config(args.structured_outputs_config)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser")
    api_keys = api_keys_from(args.api_key)
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"--{flag.replace('_', '-')} {path!r} is not a file")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together")

    if args.torch_threads is not None and args.torch_threads < 1:
        raise ConfigError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    if args.data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and not args.engine_process:
        raise ConfigError("--data-parallel-size > 1 needs engine core processes (drop --no-engine-process)")

    import prometheus_client
    import uvicorn

    from kvledger.engine.arg_utils import build_engine_config
    from kvledger.engine.async_core_engine import AsyncCoreEngine
    from kvledger.model.default import DEFAULT_MODEL_NAME
    from kvledger.server.app import ServerConfig, build_app

    # The front end runs no model: its modules import neither torch nor the engine
    # (tests/test_layers.py). But engine cores are forked from this process by default, and a
    # core that must import torch and the engine itself starts later (~1-4 s CPU on a busy
    # 2-core machine), while the front end loads torch anyway with the tokenizer (transformers
    # 5 imports it): so the engine's modules are imported here first, and every fork shares them.
    if args.engine_process and envs.KVLEDGER_ENGINE_START_METHOD == "fork":
        import kvledger.engine.builder  # noqa: F401
    prometheus_client.disable_created_metrics()  # no *_created series, as in vLLM
    # A server runs for days: its GEMM shapes are created now, not over its first 10k requests.
    engine_config = build_engine_config(
        args.model, **serve_engine_kwargs(args), warm_up_gemm_shapes=True,
        populate_kv_cache=args.populate_kv_cache,
    )
    engine: Any  # LLMEngine (in this process) or AsyncCoreEngine (core processes)
    if args.data_parallel_size > 1:  # N cores, one front end (kvledger/engine/dp_engine.py)
        from kvledger.engine.dp_engine import DataParallelEngine

        engine = DataParallelEngine.launch_dp(
            engine_config, args.data_parallel_size, args.dp_routing, torch_threads=args.torch_threads
        )
        info = engine.info
    elif args.engine_process:  # the engine core in its own process (vLLM v1's split)
        engine = AsyncCoreEngine.launch(engine_config, torch_threads=args.torch_threads)
        info = engine.info
    else:  # --no-engine-process: the engine in this process, stepped by a thread
        import torch

        from kvledger.engine.builder import build_engine
        from kvledger.engine.engine_info import EngineInfo

        if args.torch_threads:
            torch.set_num_threads(args.torch_threads)
        engine = build_engine(engine_config)
        info = EngineInfo.from_engine(engine)
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    log.info("model %s served as %s", info.model, ", ".join(repr(n) for n in names))
    log.info(capacity_line(info))
    if args.model == "kvledger-tiny":
        log.warning("kvledger-tiny has fixed-seed RANDOM weights: its text is gibberish by design")
    config = ServerConfig(
        served_model_names=names,
        model_path=info.model,
        api_key=api_keys or None,
        chat_template=template,
        max_body_bytes=max_body,
        dashboard=not args.no_dashboard,
        allowed_origins=args.allowed_origins,
        allow_credentials=args.allow_credentials,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        root_path=args.root_path or "",
        log_requests=not args.disable_log_requests,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        structured_outputs_config=so_config,
    )
    scheme = "https" if args.ssl_certfile else "http"
    if config.dashboard:
        key = "?key=<key>" if api_keys else ""
        log.info("dashboard: %s://%s:%d/dashboard%s", scheme, args.host, args.port, key)
    app = build_app(engine, config)
    from kvledger.engine.gc_heap import freeze_gc_heap

    log.info("front end: %d start-up objects frozen out of the garbage collector", freeze_gc_heap())
    try:
        _server(
            uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
                root_path=args.root_path or "",
                ssl_keyfile=args.ssl_keyfile,
                ssl_certfile=args.ssl_certfile,
                ssl_ca_certs=args.ssl_ca_certs,
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            ),
            on_exit=getattr(engine, "mark_stopping", None),
        ).run()
    finally:
        if isinstance(engine, AsyncCoreEngine):
            engine.shutdown()  # idempotent: also when uvicorn never started (port taken)
    return 0


def _server(config: Any, on_exit: Callable[[], None] | None) -> Any:
    """uvicorn's server, telling the engine cores the stop was asked for the moment SIGINT or
    SIGTERM reaches the front end: a core in the same process group may exit on the same
    signal before the lifespan shutdown runs, and that is not a crash to log as an error."""
    import uvicorn

    from kvledger.server import access_log

    access_log.install()  # after uvicorn.Config configured its loggers

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)

    return Server(config)
