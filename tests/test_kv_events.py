"""KV events: a real ZMQ subscriber, decoding vLLM's wire format with plain msgpack (no kvledger
types), follows the pool's prefix index exactly through evictions, swap and recompute
preemptions and a prefix-cache reset; the replay socket returns missed batches by sequence."""

from __future__ import annotations

import json
import random
import signal
import time

import msgspec
import pytest
import zmq

from kvledger import LLM, SamplingParams
from kvledger.cache.block_pool import hash_block
from kvledger.cache.kv_events import KVEventsConfig
from kvledger.errors import ConfigError


class View:
    """A router's view, built only from the wire: hash -> (parent hash, tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.next_seq = 0
        self.num_stored = self.num_removed = self.num_cleared = 0

    def apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, f"batch {seq} out of order (expected {self.next_seq})"
        self.next_seq += 1
        batch = msgspec.msgpack.decode(payload)  # untyped: vLLM's array-like tagged structs
        assert isinstance(batch[0], float) and batch[2:] in ([], [None])  # [ts, events, dp rank]
        for ev in batch[1]:
            tag = ev[0]
            if tag == "BlockStored":
                hashes, parent, tokens, block_size, lora_id, medium = ev[1:]
                assert (block_size, lora_id, medium) == (len(tokens), None, "GPU")
                assert len(hashes) == 1
                assert hashes[0] not in self.blocks
                self.blocks[hashes[0]] = (parent, tuple(tokens))
                self.num_stored += 1
            elif tag == "BlockRemoved":
                hashes, medium = ev[1:]
                assert medium == "GPU"
                for h in hashes:
                    del self.blocks[h]  # KeyError: removal of a block never stored
                self.num_removed += 1
            else:
                assert ev == ["AllBlocksCleared"]
                self.blocks.clear()
                self.num_cleared += 1


def drain(sub: zmq.Socket, view: View, until_seq: int | None = None, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(50):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@test"
            view.apply(int.from_bytes(seq, "big"), payload)
        elif until_seq is None or view.next_seq >= until_seq:
            return
    raise AssertionError("no events before the deadline")


def replay(ctx: zmq.Context, endpoint: str, view: View) -> None:
    """Ask for every batch from view.next_seq on; apply until the end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart((b"", view.next_seq.to_bytes(8, "big")))
    try:
        while True:
            assert sock.poll(5000), "replay socket did not answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return
            view.apply(int.from_bytes(seq, "big"), payload)
    finally:
        sock.close(linger=0)


def published_seq(llm: LLM) -> int:
    """Batches the publisher thread has sent so far (waits for its queue to empty)."""
    pub = llm.llm_engine.kv_event_publisher
    deadline = time.monotonic() + 5
    while pub._queue.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    return pub._seq


def check_view(view: View, llm: LLM) -> None:
    pool = llm.llm_engine.kv.pool
    assert set(view.blocks) == pool.cached_hashes()
    for h, (parent, tokens) in view.blocks.items():
        assert pool.blocks[pool._hash_index[h]].token_ids == tokens
        assert hash_block(parent, tokens) == h  # the chain a router recomputes (no salt here)


def workload(llm: LLM, rng: random.Random, n: int) -> list:
    """Prompts sharing a few random system prefixes, long enough to force evictions and
    preemptions in a small pool."""
    systems = [[rng.randrange(3, 500) for _ in range(rng.randrange(8, 24))] for _ in range(3)]
    prompts = [
        {"prompt_token_ids": rng.choice(systems) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))]}
        for _ in range(n)
    ]
    params = [SamplingParams(max_tokens=rng.randrange(4, 40), ignore_eos=True, temperature=0) for _ in range(n)]
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_subscriber_view_equals_pool(stories_path, tmp_path, mode):
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/ev",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
        "topic": "kv@test",
    }
    llm = LLM(str(stories_path), num_kv_blocks=40, block_size=4, max_num_seqs=8,
              preemption_mode=mode, calibrate_preemption=False, kv_events_config=cfg)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    late = ctx.socket(zmq.SUB)
    try:
        sub.connect(cfg["endpoint"])
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@test")
        time.sleep(0.3)  # PUB/SUB join before the first batch
        rng = random.Random(18 if mode == "swap" else 81)
        view = View()
        outs = workload(llm, rng, 24)
        drain(sub, view, published_seq(llm))
        mid = view.next_seq
        assert mid > 0
        # A subscriber that joins now has missed batches [0, mid): the replay socket has them.
        late.connect(cfg["endpoint"])
        late.setsockopt(zmq.SUBSCRIBE, b"kv@test")
        time.sleep(0.3)
        assert llm.reset_prefix_cache()
        outs += workload(llm, rng, 24)
        end = published_seq(llm)
        drain(sub, view, end)
        check_view(view, llm)
        late_view = View()
        live: list[tuple[int, bytes]] = []
        while late.poll(200):
            _, seq, payload = late.recv_multipart()
            live.append((int.from_bytes(seq, "big"), payload))
        assert live and live[0][0] == mid  # it heard the reset onwards, nothing before
        replay(ctx, cfg["replay_endpoint"], late_view)  # everything from seq 0
        assert late_view.next_seq == end
        assert late_view.blocks == view.blocks
        # Replay from the middle: exactly the missed tail comes back.
        tail = View()
        tail.next_seq = mid
        replay(ctx, cfg["replay_endpoint"], tail)
        assert tail.next_seq == end and tail.num_cleared == 1
        eng = llm.llm_engine
        # The workload did what it claims: evictions, preemptions of this kind, one reset.
        assert eng.kv.pool.num_evictions > 0 and view.num_removed > 0
        assert sum(o.metrics.num_preemptions for o in outs) > 0
        if mode == "swap":
            assert eng.swaps.out_blocks > 0
        assert view.num_cleared == 1 and view.num_stored > len(view.blocks)
    finally:
        sub.close(linger=0)
        late.close(linger=0)
        ctx.term()
        llm.llm_engine.shutdown()


def test_kv_events_config_errors(stories_path):
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert KVEventsConfig.parse({}).publisher == "null"
    with pytest.raises(ConfigError, match="unknown key.*endpont"):
        KVEventsConfig.parse({"endpont": "tcp://*:1"})
    with pytest.raises(ConfigError, match="not valid JSON"):
        KVEventsConfig.parse("{enable")
    with pytest.raises(ConfigError, match="publisher must be 'zmq' or 'null'"):
        KVEventsConfig.parse({"publisher": "kafka"})
    with pytest.raises(ConfigError, match="buffer_steps"):
        KVEventsConfig.parse({"buffer_steps": 0})
    with pytest.raises(ConfigError, match="cannot open ZMQ endpoint"):
        LLM(str(stories_path), num_kv_blocks=8, calibrate_preemption=False,
            kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://*:notaport"})


def test_cli_flag_reaches_the_engine_config():
    from kvledger.cli import build_parser
    from kvledger.commands.engine_args import engine_kwargs
    from kvledger.llm import build_engine_config

    args = build_parser(["serve"]).parse_args(
        ["serve", "m", "--kv-events-config", '{"enable_kv_cache_events": true, "topic": "t"}']
    )
    cfg = build_engine_config("m", **engine_kwargs(args))
    cfg.validate()
    assert cfg.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="t")


def test_serve_publishes_events(tmp_path):
    """`kvledger serve --kv-events-config`: a completion's prompt blocks come back by replay."""
    from test_server import STORIES, ServerProcess

    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    from transformers import AutoTokenizer

    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/ev",
           "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": "kv@test"}
    srv = ServerProcess(str(STORIES), "--torch-threads", "1", "--block-size", "4",
                        "--kv-events-config", json.dumps(cfg), log_path=tmp_path / "serve.log")
    ctx = zmq.Context()
    try:
        srv.wait_ready()
        prompt = "Tom and his dog Max went to the big green park."
        out = srv.client(api_key="x").completions.create(
            model=str(STORIES), prompt=prompt, max_tokens=8, temperature=0
        )
        assert out.usage.prompt_tokens >= 8
        ids = AutoTokenizer.from_pretrained(str(STORIES))(prompt)["input_ids"]
        view = View()
        deadline = time.monotonic() + 10
        while not view.blocks and time.monotonic() < deadline:
            replay(ctx, cfg["replay_endpoint"], view)
            time.sleep(0.1)
        first = [tokens for parent, tokens in view.blocks.values() if parent is None]
        assert tuple(ids[:4]) in first
        assert len(view.blocks) >= len(ids) // 4  # every full prompt block, chained
    finally:
        ctx.term()
        assert srv.stop() in (0, -signal.SIGTERM), srv.log()
        assert "Traceback" not in srv.log(), srv.log()
