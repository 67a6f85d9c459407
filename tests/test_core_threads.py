"""The engine core's torch thread count when the user gives none (kvledger/core/core_threads.py)."""

from __future__ import annotations

import pytest
import torch

from kvledger.core import core_threads
from kvledger.model.loader import load_model


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_model_whose_matmuls_save_little_gets_one_thread(stories_path, restore_threads):
    model = load_model(stories_path).model
    threads, work = core_threads.choose_core_threads(model, 2)
    assert threads == 1 and torch.get_num_threads() == 1
    assert 0 < work < core_threads.MIN_WORK_S  # stories260k's whole step of matmuls: ~0.05 ms


def test_the_work_counts_every_layer_and_the_head_once(stories_path, restore_threads, monkeypatch):
    """Layer 0's products stand for every layer; the LM head counts once. The decision flips at
    MIN_WORK_S exactly as that sum says, and only one-thread timings are taken."""
    model = load_model(stories_path).model
    linears, runs = core_threads._decode_matmuls(model)
    num_layers = len(model.model.layers)
    assert linears[-1] is model.head and runs[-1] == 1 and num_layers > 1
    assert runs[:-1] == [num_layers] * (len(linears) - 1)
    per_layer = len(linears) - 1
    seen = set()

    def fake(seconds_per_product: float):
        def _time(lins, xs, threads, repeats=5):
            seen.add(threads)
            return [seconds_per_product for _ in lins]

        return _time

    just_enough = core_threads.MIN_WORK_S / (per_layer * num_layers + 1)
    monkeypatch.setattr(core_threads, "_time", fake(just_enough * 1.01))
    assert core_threads.choose_core_threads(model, 2)[0] == 2 and torch.get_num_threads() == 2
    monkeypatch.setattr(core_threads, "_time", fake(just_enough * 0.99))
    assert core_threads.choose_core_threads(model, 2)[0] == 1 and torch.get_num_threads() == 1
    assert seen == {1}
    assert core_threads.choose_core_threads(model, 1) == (1, 0.0)
