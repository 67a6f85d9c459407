"""`kvledger plan` as a user runs it: JSON figures, and one-line errors with no traceback."""

import json
import subprocess
import sys

import pytest


def kvledger(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvledger", *args], capture_output=True, text=True, timeout=60
    )


def test_plan_json_seed_70b_on_two_80gib_cards():
    r = kvledger("plan", "--model", "seed-70b", "--tp", "2", "--json")
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    budget = int(80 * 2**30 * 0.9) - 70_000_000_000
    assert f["bytes_per_token"] == 163_840 and f["bytes_per_block"] == 16 * 163_840
    assert f["weight_bytes"] == 70_000_000_000 and f["kv_budget_bytes"] == budget
    assert f["num_blocks"] == budget // (16 * 163_840) == 2788
    assert f["max_tokens"] == 2788 * 16
    assert f["max_concurrency"] == budget // (256 * 16 * 163_840) == 10
    assert 0 < f["naive_utilization"] < f["paged_utilization"] <= 1
    assert [h["num_kv_heads"] for h in f["heads_comparison"]] == [64, 8, 1]


def test_plan_tp2_shows_whole_model_and_per_rank_figures():
    """The seed's figures (320 KB/token for GQA-8; 2,560 / 40 KB for MHA / MQA) are the whole
    model's; a rank of tp=2 holds half the KV heads, so half the bytes (MQA's one head is
    replicated, so its rank holds all of it)."""
    f = json.loads(kvledger("plan", "--model", "seed-70b", "--tp", "2", "--json").stdout)
    assert f["model_bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327_680
    assert f["bytes_per_token"] == 327_680 // 2
    rows = {h["scheme"]: h for h in f["heads_comparison"]}
    assert [rows[s]["model_bytes_per_token"] for s in ("MHA", "GQA", "MQA")] == [
        2560 * 1024,
        320 * 1024,
        40 * 1024,
    ]
    assert [rows[s]["bytes_per_token"] for s in ("MHA", "GQA", "MQA")] == [
        1280 * 1024,
        160 * 1024,
        40 * 1024,
    ]
    # fewer KV heads, more concurrent requests of the same length
    assert rows["MHA"]["max_concurrency"] < rows["GQA"]["max_concurrency"] == f["max_concurrency"]
    assert rows["GQA"]["max_concurrency"] < rows["MQA"]["max_concurrency"]
    table = kvledger("plan", "--model", "seed-70b", "--tp", "2").stdout
    for figure in ("327,680 B", "163,840 B", "2,560 KiB", "320 KiB", "40 KiB", "per rank"):
        assert figure in table, figure


def test_plan_defaults_pick_the_smallest_tp_that_fits():
    f = json.loads(kvledger("plan", "--model", "seed-70b", "--json").stdout)
    assert (f["model"], f["tp"], f["bytes_per_token"]) == ("seed-70b", 2, 163_840)


def test_plan_with_no_model_plans_the_model_generate_runs_and_names_it():
    """No --model: the embedded stories260k (what `kvledger generate` just ran), by the name it
    is served under too: 5 layers x 4 KV heads x 8 dims x 2 (K, V) x 4 bytes (float32)."""
    default = json.loads(kvledger("plan", "--json").stdout)
    named = json.loads(kvledger("plan", "--model", "stories260k", "--json").stdout)
    assert default == named and default["bytes_per_token"] == 2 * 5 * 4 * 8 * 4 and default["tp"] == 1


def test_plan_says_when_holding_every_request_exceeds_the_kv_budget():
    table = kvledger("plan", "--model", "seed-70b", "--tp", "2").stdout
    # The note spans wrapped lines of the value column: read the cells' text as one.
    cells = " ".join(line.split("│")[2] for line in table.splitlines() if line.count("│") == 3)
    assert "naive and paged exceed the 6.81 GiB" in " ".join(cells.split()), table
    small = kvledger("plan").stdout
    assert "exceed" not in small, small


def test_plan_table_says_what_the_reserved_row_means():
    table = " ".join(kvledger("plan", "--model", "seed-70b", "--tp", "2").stdout.split())
    assert "reserved: KV memory per rank to hold all 256 sample requests at once" in table, table
    assert "naive reserves the full 4,096-token context for each, paged only the blocks each fills" in table, table


def test_llm_accepts_the_served_name_of_the_embedded_model():
    from kvledger import LLM, SamplingParams
    from kvledger.model.default import embedded_model_path

    llm = LLM("stories260k")
    assert str(llm.llm_engine.config.model) == str(embedded_model_path())
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.outputs[0].text == ", there was a", out.outputs[0].text


def test_generate_accepts_the_served_name_of_the_embedded_model(capsys):
    """In process (the CLI's own main: a subprocess would spend seconds importing torch again;
    test_default_model runs `python -m kvledger generate` as a process)."""
    from kvledger.cli import main

    rc = main(["generate", "stories260k", "--max-tokens", "4"])
    out = capsys.readouterr()
    assert rc == 0 and "Once upon a time" in out.out, out.err


def test_plan_json_with_given_lengths_and_quantised_kv(tmp_path):
    (tmp_path / "lengths.txt").write_text("300\n16, 17\n")
    r = kvledger(
        "plan",
        "--model",
        "llama-3-8b",
        "--kv-dtype",
        "int8",
        "--tp",
        "1",
        "--context-len",
        "4096",
        "--lengths",
        f"@{tmp_path / 'lengths.txt'}",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    assert (f["bytes_per_token"], f["scale_bytes_per_token"]) == (66_560, 1_024)
    assert f["per_request_overhead_bytes"] == 4 * 131_072  # 4 sink tokens in bf16
    assert f["paged_utilization"] == 333 / 352 and f["lengths_source"] == "given"


def test_plan_table():
    r = kvledger("plan", "--model", "kvledger-tiny")
    assert r.returncode == 0, r.stderr
    assert "max concurrency" in r.stdout and "MQA" in r.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "no-such-model"], "no-such-model"),
        (["--model", "{bad}"], "preset"),
        (["--device-memory=-80GiB"], "negative"),
        (["--device-memory", "0"], "device memory"),
        (["--device-memory", "80G"], "ambiguous"),
        (["--memory-fraction", "1.5"], "fraction"),
        (["--memory-fraction", "0"], "fraction"),
        (["--weight-bytes", "0"], "weight"),
        (["--block-size", "0"], "block-size"),
        (["--model", "seed-70b", "--tp", "1"], "short by"),
        (["--tp", "3"], "tp"),
        (["--kv-dtype", "int4"], "int4"),
        (["--lengths", "10,x"], "lengths"),
        (["--lengths", "@/nonexistent/lengths.txt"], "lengths"),
        (["--context-len", "9000"], "9000"),
    ],
)
def test_plan_bad_input_is_one_line_error(args, needle):
    r = kvledger("plan", *args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("kvledger: error:") and r.stderr.count("\n") == 1, r.stderr
    assert needle in r.stderr


def test_plan_malformed_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    r = kvledger("plan", "--model", str(tmp_path))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "config.json" in r.stderr and r.stderr.count("\n") == 1


def test_plan_counts_the_tokens_each_prefix_cache_tier_holds():
    """seed-70b: 320 KiB per token, 5 MiB per 16-token block; the host tier holds bytes / block
    bytes, the disk tier bytes / (block bytes + a file header)."""
    r = kvledger("plan", "--model", "seed-70b", "--tp", "2", "--json",
                 "--kv-offload-host-bytes", "100GiB", "--kv-offload-disk-bytes", "1TB")  # fmt: skip
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["tiers"]
    block = 16 * 327_680
    assert t["host"] == {"bytes": 100 << 30, "blocks": (100 << 30) // block, "tokens": 16 * ((100 << 30) // block)}
    assert t["disk"]["blocks"] == 10**12 // (block + 512 + 8 * 16) and t["disk"]["tokens"] == 16 * t["disk"]["blocks"]
