"""The dashboard in a real browser: Debian's Chromium, headless, driven by playwright.

One browser and one `kvledger serve` (API key, a small KV pool with a host swap pool, so that
sharing, swapping and preemption all happen) for the module. While concurrent completions run,
the counts the page shows (summed by the page from the cells it draws) must equal the ledger
of the same frame, which /v1/ledger's own code computes in the same engine-thread call; once
the load is over they must equal what GET /v1/ledger returns. The page must log no console
error, and a `simulate --html` file must play in the same browser.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import threading
import time

import openai
import pytest
from test_server import KEY, STORIES, ServerProcess

from kvledger.cli import main

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
STATES = ("free", "cached", "used", "shared", "swapped")
SYSTEM = "Once upon a time there was a little girl named Lily. She loved to play in the park."


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    s = ServerProcess(
        str(STORIES), "--torch-threads", "1", "--api-key", KEY, "--num-kv-blocks", "64",
        "--max-num-seqs", "6", "--swap-space", "0.002", "--preemption-mode", "swap",
        log_path=tmp_path_factory.mktemp("dash") / "serve.log",
    )  # fmt: skip
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def dom_counts(page) -> dict[str, int]:
    return {s: int(page.inner_text(f"#n-{s}")) for s in STATES}


def ledger_counts(led: dict) -> dict[str, int]:
    return {
        "free": led["free_blocks"],
        "cached": led["cached_blocks"],
        "used": led["used_blocks"] - led["shared_blocks"],
        "shared": led["shared_blocks"],
        "swapped": led["swapped_blocks"],
    }


def wait_for(page, expr: str, timeout: float = 10.0) -> None:
    """Poll ``expr`` from here: the page's CSP forbids playwright's in-page eval polling."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expr):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {expr}")
        time.sleep(0.05)


def next_frame(page) -> dict:
    """Wait for the page's next poll; then its frame and what it shows, read in one go."""
    wait_for(page, f"window.__kvl.frames > {page.evaluate('window.__kvl.frames')}")
    return page.evaluate(
        "() => { const f = window.__kvl.frame, c = {};"
        " for (const s of ['free','cached','used','shared','swapped'])"
        "   c[s] = Number(document.getElementById('n-' + s).textContent);"
        " return {ledger: f.ledger, shown: c, rows: document.querySelectorAll('#reqs tbody tr').length}; }"
    )


def hover(page, cell: int) -> str:
    """Move the mouse onto the map's cell; the tooltip's text."""
    box = page.locator("#map").bounding_box()
    size, cols = page.evaluate("[mapLayout.size, mapLayout.cols]")
    x = box["x"] + (cell % cols) * size + size / 2
    page.mouse.move(x, box["y"] + (cell // cols) * size + size / 2)
    return page.inner_text("#maptip")


def run_load(url: str, stop: threading.Event, worker: int, errors: list) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    i = 0
    try:
        while not stop.is_set():
            prompt = (SYSTEM + " " if worker % 2 == 0 else "") + f"Tom had {worker * 10 + i} balls."
            client.completions.create(
                model=str(STORIES), prompt=prompt, max_tokens=150 + 50 * (i % 3), temperature=0.7
            )
            i += 1
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


@contextlib.contextmanager
def load(server, clients: int):
    """``clients`` threads sending completions (``run_load``) while the block runs; yields the
    list their errors go to, checked by the caller once they are joined."""
    stop, errors = threading.Event(), []
    workers = [
        threading.Thread(target=run_load, args=(server.url, stop, w, errors), daemon=True)
        for w in range(clients)
    ]
    for t in workers:
        t.start()
    try:
        yield errors
    finally:
        stop.set()
        for t in workers:
            t.join(120)


def test_live_page_counts_equal_the_ledger_under_load(browser, server):
    page, console_errors = open_page(browser, f"{server.url}/dashboard?key={KEY}")
    first = next_frame(page)
    assert first["shown"] == ledger_counts(first["ledger"])
    seen = {"used": 0, "shared": 0, "swapped": 0, "waiting": 0}
    # Twice the server's --max-num-seqs in clients, so that requests wait at almost every frame
    # even when each client takes a while between requests (8 clients once saw none waiting in
    # 172 frames of a loaded full-suite run).
    with load(server, 12) as load_errors:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all(seen.values()):
            f = next_frame(page)
            led = f["ledger"]
            assert f["shown"] == ledger_counts(led), f
            nr = led["num_requests"]
            assert f["rows"] == nr["running"] + nr["waiting"] + nr["swapped"]
            seen["used"] += led["used_blocks"] > 0
            seen["shared"] += led["shared_blocks"] > 0
            # Swapped-out states can be brief; the swap preemptions that make them cannot hide.
            seen["swapped"] += led["preemptions"]["swap"] > 0
            seen["waiting"] += nr["waiting"] > 0
        assert all(seen.values()), seen
        # Hovering a held block names its holders (the block may change between the read and
        # the move, so a few tries).
        for _ in range(5):
            cell = page.evaluate("window.__kvl.frame.block_map.cells.findIndex((c) => c.n > 0)")
            tip = hover(page, cell) if cell >= 0 else ""
            if f"block {cell}\n" in tip and "holders: cmpl-" in tip:
                break
        else:
            raise AssertionError(f"no holders in the hovered block's details: {tip!r}")
    assert not load_errors, load_errors
    led = server.wait_idle()
    f = next_frame(page)
    f = next_frame(page)  # a poll wholly after the load
    assert f["shown"] == ledger_counts(led) == ledger_counts(server.ledger())
    assert f["shown"]["used"] == f["shown"]["shared"] == 0 and f["shown"]["cached"] > 0
    cell = page.evaluate("window.__kvl.frame.block_map.cells.findIndex((c) => c.c[1] === 1)")
    tip = hover(page, cell)
    assert "state: cached" in tip and re.search(r"prefix hash: [0-9a-f]{16}", tip), tip
    totals = page.inner_text("#totals")
    assert "utilisation: naive" in totals and "prefix sharing saves" in totals
    assert not console_errors, console_errors
    page.close()


def test_simulate_html_plays_in_the_browser(browser, tmp_path):
    out = tmp_path / "sim.html"
    argv = ["simulate", "--num-requests", "40", "--num-kv-blocks", "300",
            "--shared-prefix-len", "48", "--html", str(out)]  # fmt: skip
    assert main(argv) == 0
    page, console_errors = open_page(browser, out.as_uri())
    wait_for(page, "window.__kvl.frames > 0")
    start = page.evaluate("window.__kvl.frame")
    assert dom_counts(page) == ledger_counts(start["ledger"])
    assert start["ledger"]["used_blocks"] > 0  # it opens on the busiest frame
    page.eval_on_selector("#scrub", "(e) => { e.value = '0'; e.dispatchEvent(new Event('input')); }")
    assert page.evaluate("window.__kvl.frame.time") <= start["time"]
    assert dom_counts(page) == ledger_counts(page.evaluate("window.__kvl.frame.ledger"))
    assert "frame 1 /" in page.inner_text("#frameinfo")
    assert not console_errors, console_errors
    page.close()


def test_request_table_axes_and_capacity_card_read_right_at_1400px(browser, server):
    """At 1,400 px the request table (long `cmpl-` ids) does not scroll sideways and no header
    is cut; count axes tick at whole numbers; the capacity card compares requests with requests."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{server.url}/dashboard?key={KEY}")
    with load(server, 8) as load_errors:
        deadline = time.monotonic() + 60
        while True:
            next_frame(page)
            got = page.evaluate(
                "() => { const w = document.getElementById('reqwrap');"
                " return {rows: document.querySelectorAll('#reqs tbody tr').length,"
                "  wrap: [w.scrollWidth, w.clientWidth],"
                "  heads: [...document.querySelectorAll('#reqs th')].map((h) => [h.textContent, h.scrollWidth, h.clientWidth]),"
                "  cut: [...document.querySelectorAll('#reqs tbody td:not(:first-child)')]"
                "    .filter((d) => d.scrollWidth > d.clientWidth).map((d) => d.textContent),"
                "  title: (document.querySelector('#reqs tbody td') || {}).title || '',"
                "  queues: JSON.parse(document.getElementById('c-queues').dataset.yticks),"
                "  pre: JSON.parse(document.getElementById('c-pre').dataset.yticks) }; }"
            )
            if got["rows"] >= 4 or time.monotonic() > deadline:
                break
        # Read while the requests are resident: once the load stops (joining its clients can
        # take seconds on a busy machine) the page may already show an idle pool.
        card = page.inner_text("#totals")
    assert not load_errors, load_errors
    assert got["rows"] >= 4, got
    assert got["wrap"][0] <= got["wrap"][1], f"the table scrolls sideways: {got['wrap']}"
    cut = [h for h in got["heads"] if h[1] > h[2]]
    assert not cut and len(got["heads"]) == 10, got["heads"]
    assert not got["cut"], got["cut"]  # only ids are shortened, never a figure
    assert got["title"].startswith("cmpl-") and len(got["title"]) > 16  # the whole id, on hover
    for ticks in (got["queues"], got["pre"]):
        assert ticks and all(re.fullmatch(r"\d+", t) for t in ticks), ticks
    assert re.search(r"requests the pool holds\s+[\d,]+ paged / [\d,]+ naive", card), card
    server.wait_idle()
    page.close()


def test_the_key_in_the_url_is_traded_for_a_cookie_in_chromium(browser, server):
    """Opening /dashboard?key= in Chromium lands on the bare /dashboard (the key gone from the
    address bar and history); the page's data requests and a later visit go by the HttpOnly
    cookie (invisible to scripts); the cookie does not open the API; another browser context,
    with no cookie, gets a 401."""
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        first = page.goto(f"{server.url}/dashboard?key={KEY}")
        assert first.status == 200 and page.url == f"{server.url}/dashboard", page.url
        assert page.evaluate("document.cookie") == ""  # HttpOnly
        assert page.evaluate("fetch('/dashboard/data').then(r => r.status)") == 200
        assert page.evaluate("fetch('/v1/models').then(r => r.status)") == 401
        again = ctx.new_page()
        assert again.goto(f"{server.url}/dashboard").status == 200
        assert KEY not in str(ctx.cookies())
    finally:
        ctx.close()
    other = browser.new_context()
    try:
        assert other.new_page().goto(f"{server.url}/dashboard").status == 401
    finally:
        other.close()
