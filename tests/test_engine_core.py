"""The engine core in its own process (``kvledger serve``'s default): what the split must keep.

One server for the module. Its engine core process is killed with SIGKILL at the end: the
front end must notice, answer 503 (and /health 503) instead of hanging, and keep serving
errors, and log the crash as an ERROR naming the core. The engine's own start-up errors still
reach the user as one line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server import STORIES, ServerProcess

ROOT = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


@pytest.fixture(scope="module")
def core_server(tmp_path_factory):
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    log = tmp_path_factory.mktemp("core") / "server.log"
    srv = ServerProcess(str(STORIES), "--torch-threads", "1", "--no-dashboard", log_path=log)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def complete(srv: ServerProcess, **kw) -> httpx.Response:
    body = {"model": str(STORIES), "prompt": "Once upon a time", "max_tokens": 8,
            "temperature": 0, **kw}  # fmt: skip
    return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)


def test_the_engine_runs_in_a_child_process_that_the_front_end_feeds(core_server):
    (core,) = children(core_server.proc.pid)
    assert "kvledger" in Path(f"/proc/{core}/cmdline").read_text()
    r = complete(core_server)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(", there was a little girl")
    # Named queries cross the boundary: the ledger and the metrics read the core's pool.
    led = httpx.get(f"{core_server.url}/v1/ledger", timeout=30).json()
    assert led["used_blocks"] == 0 and led["total_blocks"] > 0
    metrics = httpx.get(f"{core_server.url}/metrics", timeout=30).text
    assert 'vllm:generation_tokens_total{engine="0"' in metrics


def test_both_server_processes_freeze_their_start_up_heap(core_server):
    """kvledger/engine/gc_heap.py: the front end and the engine core each say how many objects they
    froze out of the garbage collector's walks: a loaded server's worth, not a handful."""
    text = core_server.log_path.read_text()
    for who in ("front end: ", "engine core 0: "):
        line = next((ln for ln in text.splitlines() if who in ln and "objects frozen" in ln), None)
        assert line is not None, (who, text[-2000:])
        assert int(line.split(who)[1].split()[0]) > 10_000, line


def test_a_killed_engine_core_makes_the_server_answer_503_not_hang(core_server):
    (core,) = children(core_server.proc.pid)
    os.kill(core, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(f"{core_server.url}/health", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 after the core died"
        time.sleep(0.05)
    assert httpx.get(f"{core_server.url}/health", timeout=5).status_code == 503
    r = complete(core_server)
    assert r.status_code == 503, r.text
    assert "engine is not running" in r.json()["error"]["message"]
    r = complete(core_server, stream=True)
    assert r.status_code == 503, r.text
    assert httpx.get(f"{core_server.url}/v1/ledger", timeout=5).status_code == 503
    assert core_server.proc.poll() is None  # the front end lives on, answering errors
    # A core that crashes (unlike one stopped on request) is an error in the log, naming it.
    while "ERROR" not in (log := core_server.log()):
        assert time.monotonic() < deadline + 10, log
        time.sleep(0.1)
    assert "engine core 0 is dead: the engine core process exited (code -9)" in log, log


def test_an_engine_start_up_error_is_one_line(tmp_path):
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    r = subprocess.run(
        [sys.executable, "-m", "kvledger", "serve", str(STORIES), "--max-model-len", "100000"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode != 0
    assert "max_model_len 100000 exceeds the model's context" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_request_crosses_the_wire_with_its_constraint():
    """ADD carries SamplingParams pickled; a grammar is re-parsed on the far side (xgrammar's
    native object does not pickle), and one only llguidance takes travels as its source."""
    from kvledger.engine import core_protocol as wire
    from kvledger.sampling_params import SamplingParams
    from kvledger.structured.backends import guidance_available
    from kvledger.structured.params import StructuredOutputsParams as SO

    constraints = [SO(regex="ab+"), SO(json={"type": "object"})]
    if guidance_available():
        constraints.append(SO(json={"type": "object"}, whitespace_pattern=r"[ ]?"))
    for so in constraints:
        params = SamplingParams(max_tokens=5, stop=["x"], structured_outputs=so)
        rid, ids, text, back, arrival, prio, salt = wire.decode_add(
            wire.encode_add("r1", [5, 6], "hi", params, 12.5, 3, "tenant-a")
        )
        assert (rid, ids, text, arrival, prio, salt) == ("r1", [5, 6], "hi", 12.5, 3, "tenant-a")
        assert back == params  # dataclass equality: every field made it
        got = back.structured_outputs
        assert got.key() == so.key() and got.xgrammar_error == so.xgrammar_error
        assert (got.parsed_grammar is None) == (so.parsed_grammar is None)


def test_a_core_stopped_by_sigterm_is_a_warning_and_a_group_stop_logs_no_error(tmp_path):
    """A service manager stops a server by SIGTERM to its whole process group (systemd's
    default): the core ends with the front end, which is not a crash to log as an error. A core
    stopped alone by SIGTERM still fails what it held (503), with a warning saying so."""
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    srv = ServerProcess(
        str(STORIES), "--torch-threads", "1", "--no-dashboard", log_path=tmp_path / "server.log",
        new_session=True,
    )  # fmt: skip
    proc, url, log_path = srv.proc, srv.url, srv.log_path
    try:
        srv.wait_ready()
        (core,) = children(proc.pid)
        os.kill(core, signal.SIGTERM)  # the core alone
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 after the core stopped"
            time.sleep(0.05)
        line = "engine core 0 is dead: the engine core process was stopped by SIGTERM"
        while line not in (text := log_path.read_text()):  # logged once no server stop followed
            assert time.monotonic() < deadline + 10, text
            time.sleep(0.1)
        assert "WARNING" in text and "ERROR" not in text, text
        os.killpg(proc.pid, signal.SIGTERM)  # then the whole group, as systemd stops a unit
        assert proc.wait(30) in (0, -signal.SIGTERM)
        text = log_path.read_text()
        assert "ERROR" not in text and "Traceback" not in text, text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        srv.stop()
