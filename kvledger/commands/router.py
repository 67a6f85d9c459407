"""`kvledger router`: one HTTP front end dispatching over several kvledger servers (data-parallel
replicas), cache-aware from their KV events (kvledger/router)."""

from __future__ import annotations

import argparse
from typing import Any

from kvledger.errors import ConfigError


def add_parser(subparsers: Any) -> None:
    from kvledger.cache.block_hash import PREFIX_CACHING_HASH_ALGOS
    from kvledger.router.policy import ROUTING_POLICIES

    p = subparsers.add_parser(
        "router",
        help="route requests over several kvledger servers (cache-aware, from their KV events)",
        description="Forward /v1/completions and /v1/chat/completions to one of the "
        "--worker-urls, chosen by --dp-routing. cache_aware needs each worker started with "
        "--kv-events-config (its endpoint given here by --kv-events-endpoints, in the same order) "
        "and the workers' tokenizer (--tokenizer).",
    )
    p.add_argument("--worker-urls", nargs="+", required=True, help="http://host:port of each kvledger server")
    p.add_argument(
        "--kv-events-endpoints",
        nargs="+",
        default=None,
        help="each worker's KV events PUB endpoint (its kv_events_config endpoint), same order",
    )
    p.add_argument("--kv-events-replay-endpoints", nargs="+", default=None, help="their replay endpoints")
    p.add_argument("--dp-routing", choices=ROUTING_POLICIES, default="cache_aware")
    p.add_argument("--tokenizer", default=None, help="the workers' tokenizer (model folder or hub id)")
    p.add_argument("--block-size", type=int, default=16, help="the workers' --block-size")
    p.add_argument("--prefix-caching-hash-algo", choices=PREFIX_CACHING_HASH_ALGOS, default="sha256")
    p.add_argument("--overlap-weight", type=float, default=0.25, help="weight of prefill blocks against KV blocks in the cost (Dynamo: 1.0; see kvledger/router/policy.py)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


def config_from_args(args: argparse.Namespace):
    from kvledger.router.server import Replica, RouterConfig

    n = len(args.worker_urls)
    for name in ("kv_events_endpoints", "kv_events_replay_endpoints"):
        v = getattr(args, name)
        if v is not None and len(v) != n:
            raise ConfigError(f"--{name.replace('_', '-')} needs one endpoint per worker ({n}), got {len(v)}")
    if args.dp_routing == "cache_aware":
        if args.kv_events_endpoints is None:
            raise ConfigError("--dp-routing cache_aware needs --kv-events-endpoints (one per worker)")
        if args.tokenizer is None:
            raise ConfigError("--dp-routing cache_aware needs --tokenizer (the workers' tokenizer)")
        if args.prefix_caching_hash_algo == "builtin":
            raise ConfigError("--prefix-caching-hash-algo builtin differs per process: use sha256 or sha256_cbor")
    ev = args.kv_events_endpoints or [None] * n
    rp = args.kv_events_replay_endpoints or [None] * n
    return RouterConfig(
        replicas=[Replica(u.rstrip("/"), e, r) for u, e, r in zip(args.worker_urls, ev, rp)],
        policy=args.dp_routing,
        block_size=args.block_size,
        hash_algo=args.prefix_caching_hash_algo,
        overlap_weight=args.overlap_weight,
        tokenizer=args.tokenizer,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvledger.router.server import build_router_app

    app = build_router_app(config_from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
