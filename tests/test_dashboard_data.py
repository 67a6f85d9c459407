"""The dashboard's data without a browser: the block map against the ledger and the pool,
`kvledger simulate --html` as a file, and the server hook (--no-dashboard, the API key)."""

from __future__ import annotations

import json
import re
import time

import pytest
from fastapi.testclient import TestClient

from kvledger.cache.kv_cache_manager import KVCacheManager
from kvledger.cli import main
from kvledger.ledger.block_map import block_map

BS = 4


def _admit(kv: KVCacheManager, rid: str, prompt: list[int]) -> None:
    hits, cached = kv.get_computed_blocks(prompt)
    assert kv.allocate_slots(rid, len(prompt) - cached, hits)
    kv.cache_blocks(rid, prompt, len(prompt))


def test_block_map_cells_holders_hashes_and_groups():
    kv = KVCacheManager(10, BS, bytes_per_token=10, num_host_blocks=4)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    _admit(kv, "a", [*shared, 1, 2])  # blocks 0, 1 full (hashed), 2 holds 2 tokens
    _admit(kv, "b", [*shared, 3])  # takes blocks 0, 1 by reference
    _admit(kv, "c", [20, 21, 22, 23, 24])
    _admit(kv, "gone", [30, 31, 32, 33, 34])
    kv.free("gone")  # its full block stays cached, its partial block is free
    kv.swap_out("c")  # its two private blocks move to the host pool

    bm = json.loads(json.dumps(block_map(kv)))  # plain JSON, unchanged by a round trip
    assert bm["group_size"] == 1 and len(bm["cells"]) == 10
    pool = kv.pool.blocks
    ta, tb = kv.block_table("a"), kv.block_table("b")
    assert ta[:2] == tb[:2]
    for b in ta[:2]:
        cell = bm["cells"][b]
        assert cell["c"] == [0, 0, 0, 1] and cell["r"] == 2
        assert sorted(cell["o"]) == ["a", "b"] and cell["n"] == 2 and cell["t"] == BS
        assert cell["h"] == f"{pool[b].block_hash & (2**64 - 1):016x}"
    last = bm["cells"][ta[2]]
    assert last["c"] == [0, 0, 1, 0] and last["o"] == ["a"] and last["t"] == 2
    assert last["h"] is None  # a partial block has no prefix identity
    snap = kv.ledger()
    c = bm["counts"]
    assert c == {
        "free": snap.free_blocks,
        "cached": snap.cached_blocks,
        "used": snap.used_blocks - snap.shared_blocks,
        "shared": snap.shared_blocks,
        "swapped_out": snap.swapped_blocks,
    }
    assert (c["shared"], c["swapped_out"]) == (2, 2) and c["cached"] >= 1
    assert sum(cell["c"][1] for cell in bm["host"]["cells"]) == 2
    assert {o for cell in bm["host"]["cells"] for o in cell["o"]} == {"c"}

    grouped = block_map(kv, max_cells=3)  # 4 blocks per cell
    assert grouped["group_size"] == 4 and len(grouped["cells"]) == 3
    assert grouped["counts"] == c
    assert [sum(x["c"][s] for x in grouped["cells"]) for s in range(4)] == [
        c["free"],
        c["cached"],
        c["used"],
        c["shared"],
    ]
    assert all("h" not in x for x in grouped["cells"])
    for rid in ("a", "b", "c"):
        kv.free(rid)


def _embedded(path) -> dict:
    html = path.read_text()
    m = re.search(r'<script id="kvl-data" type="application/json">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def test_simulate_html_records_consistent_frames(tmp_path):
    out = tmp_path / "run.html"
    rc = main(["simulate", "--num-requests", "48", "--shared-prefix-len", "64",
               "--num-kv-blocks", "200", "--prompt-len", "64-256", "--output-len", "64-256",
               "--preemption-mode", "swap", "--html", str(out), "--json"])  # fmt: skip
    assert rc == 0
    html = out.read_text()
    # Self-contained: no script, style, image or link is fetched from anywhere.
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", html)
    assert "http://" not in html.split("<script")[0]
    rec = _embedded(out)
    assert rec["mode"] == "simulated" and rec["summary"]["num_finished"] == 48
    frames, series = rec["frames"], rec["series"]
    assert 10 <= len(frames) <= 81 and len(series) > len(frames)
    assert [f["time"] for f in frames] == sorted(f["time"] for f in frames)
    busy = 0
    for f in frames:
        bm, led, tot = f["block_map"], f["ledger"], f["totals"]
        assert bm["group_size"] == 1  # 200 blocks: one cell each
        counts = [sum(cell["c"][s] for cell in bm["cells"]) for s in range(4)]
        assert counts == [
            led["free_blocks"],
            led["cached_blocks"],
            led["used_blocks"] - led["shared_blocks"],
            led["shared_blocks"],
        ]
        # Sharing savings from the per-request ledger equal the holders beyond the first,
        # counted independently on the map's cells.
        extra = sum(cell["r"] - 1 for cell in bm["cells"] if cell["r"] > 1)
        assert tot["sharing_saved_blocks"] == extra
        assert tot["sharing_saved_bytes"] == extra * tot["bytes_per_block"]
        rows = f["requests"]
        nr = led["num_requests"]
        assert len(rows) == min(nr["running"], 64) + min(nr["waiting"], 64) + min(
            nr["swapped"], 64
        )
        if nr["running"] <= 64:
            running_blocks = sum(r["blocks"] for r in rows if r["state"] == "running")
            holders = sum(cell.get("n", 0) for cell in bm["cells"])
            swapped_dev = sum(r["blocks"] for r in rows if r["state"] == "swapped")
            assert running_blocks + swapped_dev == holders
        busy += led["used_blocks"] > 0
    assert busy >= 5
    assert max(f["totals"]["sharing_saved_blocks"] for f in frames) > 0  # the shared prefix
    assert series[-1]["tokens"] == rec["summary"]["output_tokens"]
    assert series[-1]["swap"] == rec["summary"]["num_preemptions"]["swap"] > 0


def test_simulate_html_unwritable_path_is_a_clear_error(tmp_path, capsys):
    rc = main(["simulate", "--num-requests", "4", "--html", str(tmp_path)])  # a directory
    assert rc != 0
    err = capsys.readouterr().err
    assert "cannot write --html" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def tiny_engine(stories_path):
    from kvledger.engine.builder import build_engine
    from kvledger.llm import build_engine_config

    config = build_engine_config(str(stories_path), num_kv_blocks=32, calibrate_preemption=False)
    return build_engine(config)


def test_dashboard_route_follows_the_api_key_and_can_be_turned_off(tiny_engine):
    from kvledger.server.app import ServerConfig, build_app

    keyed = build_app(tiny_engine, ServerConfig(["m"], api_key="sk-1"))
    with TestClient(keyed) as c:
        for path in ("/dashboard", "/dashboard/data"):
            r = c.get(path)
            assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
            assert c.get(path, params={"key": "nope"}).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
        # ?key= once: a cookie (a MAC, never the key) and a redirect to the bare URL.
        first = c.get("/dashboard", params={"key": "sk-1"}, follow_redirects=False)
        assert first.status_code == 303 and first.headers["location"].endswith("/dashboard")
        cookie = first.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
        assert "sk-1" not in cookie and "Path=/dashboard" in cookie
        c.cookies.clear()
        page = c.get("/dashboard", params={"key": "sk-1"})  # the redirect, followed with the cookie
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert c.get("/dashboard/data").status_code == 200  # the cookie alone opens the data
        assert c.get("/v1/models").status_code == 401  # and never the API
        token = c.cookies.get("kvledger_dashboard")
        c.cookies.clear()
        c.cookies.set("kvledger_dashboard", token[:-1] + ("0" if token[-1] != "0" else "1"))
        assert c.get("/dashboard/data").status_code == 401
        c.cookies.clear()
        assert "default-src 'none'" in page.headers["content-security-policy"]
        for _ in range(50):  # the sampler takes its first point as the server starts
            data = c.get("/dashboard/data", headers={"Authorization": "Bearer sk-1"}).json()
            if data["series"]:
                break
            time.sleep(0.1)
        led = c.get("/v1/ledger", headers={"Authorization": "Bearer sk-1"}).json()
        # The frame's ledger is /v1/ledger's body (less the per-request part, which is the table).
        assert set(data["frame"]["ledger"]) == set(led) - {"requests"}
        assert data["frame"]["ledger"]["total_blocks"] == led["total_blocks"] == 32
        assert data["frame"]["block_map"]["counts"]["free"] == 32
        assert data["series"] and set(data["series"][0]) >= {"t", "usage", "running", "tokens"}
    off = build_app(tiny_engine, ServerConfig(["m"], dashboard=False))
    with TestClient(off) as c:
        assert c.get("/dashboard").status_code == 404
        assert c.get("/dashboard/data").status_code == 404
        assert c.get("/health").status_code == 200


def test_totals_paged_vs_naive_sharing_and_quantisation_arithmetic():
    from kvledger.ledger.frame import totals
    from kvledger.ledger.snapshot import LedgerSnapshot, RequestBlocks

    reqs = {
        # 40 tokens in 3 blocks, 2 of them shared with "b"; "b": 33 tokens; "s": swapped out.
        "a": RequestBlocks(num_tokens=40, blocks=3, private_blocks=1, shared_blocks=2,
                           swapped_blocks=0),
        "b": RequestBlocks(num_tokens=33, blocks=3, private_blocks=1, shared_blocks=2,
                           swapped_blocks=0),
        "s": RequestBlocks(num_tokens=20, blocks=0, private_blocks=0, shared_blocks=0,
                           swapped_blocks=2),
    }  # fmt: skip
    snap = LedgerSnapshot(
        total_blocks=10, used_blocks=4, free_blocks=6, cached_blocks=0, block_size=16,
        bytes_per_token=100, bytes_per_block=1600, tokens_stored=49, shared_blocks=2,
        utilization=49 / 64, usage=0.4, requests=reqs, kv_cache_dtype="int8",
        overlay_bytes=1000, sink_cache_bytes=200,
    )  # fmt: skip
    t = totals(snap, max_model_len=128, reference_bytes_per_token=400)
    assert t["paged_utilization"] == 49 / 64
    assert t["naive_utilization"] == (40 + 33) / (2 * 128)  # the swapped request holds no slot
    assert t["naive_max_requests"] == 160 // 128 and t["resident_requests"] == 2
    # Like with like: requests the pool holds paged, at the residents' mean of 4 / 2 blocks.
    assert t["paged_max_requests"] == 10 * 2 // 4 and t["mean_resident_tokens"] == (40 + 33) / 2
    assert t["sharing_saved_blocks"] == 2 and t["sharing_saved_bytes"] == 3200
    assert t["quantization_gross_saved_bytes"] == 300 * 49
    assert t["quantization_saved_bytes"] == 300 * 49 - 1200
    assert t["quantization_capacity_ratio"] == 160 * 400 / (16000 + 1000)
    plain = totals(snap, max_model_len=128, reference_bytes_per_token=100)
    assert plain["quantization_saved_bytes"] == 0
