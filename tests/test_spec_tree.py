"""Token-tree speculation (kvledger.spec_decode.tree, method suffix's ``tree_nodes``): the tree's
bookkeeping, the best-first proposal, the attention mask in the native prefill kernel (a tree
row's result is its chain's, bit for bit) and in SDPA, and the engine: greedy outputs identical
to speculation off, paths off the chain taken (their K/V moved), and every rejected node's slot
released in its step (preemption: tests/test_spec_decode.py's, with TREE)."""

from __future__ import annotations

import pytest
import torch

from kvledger import LLM, SamplingParams
from kvledger.kernels import native
from kvledger.spec_decode import tree
from kvledger.spec_decode.suffix import SuffixCache, SuffixIndex
from tests.test_spec_decode import PROMPTS, TREE, outputs

#        root
#       /    \
#      0(5)   3(9)
#     /   \      \
#    1(6) 2(7)   4(6)
DRAFTS, PARENTS = [5, 6, 7, 9, 6], [-1, 0, 0, -1, 3]


def test_tree_bookkeeping():
    assert tree.depths(PARENTS) == [1, 2, 2, 1, 2]
    # Rows: root, then nodes 0..4; a row sees itself and its ancestors.
    assert tree.ancestor_masks(PARENTS) == [0b1, 0b11, 0b111, 0b1011, 0b10001, 0b110001]
    assert tree.is_chain([-1, 0, 1]) and not tree.is_chain(PARENTS)
    # sampled[r]: the token row r samples (row 0 the root, row 1 + j node j).
    assert tree.walk(DRAFTS, PARENTS, [5, 6, 0, 0, 0, 0]) == [0, 1]  # the chain
    assert tree.walk(DRAFTS, PARENTS, [5, 7, 0, 0, 0, 0]) == [0, 2]  # a sibling
    assert tree.walk(DRAFTS, PARENTS, [9, 0, 0, 0, 6, 0]) == [3, 4]  # the second subtree
    assert tree.walk(DRAFTS, PARENTS, [9, 0, 0, 0, 1, 0]) == [3]
    assert tree.walk(DRAFTS, PARENTS, [6, 0, 0, 0, 0, 0]) == []  # node 1's token is no root child
    assert tree.moves([3, 4]) == [(3, 0), (4, 1)] and tree.moves([0, 2]) == [(2, 1)]
    assert tree.moves([0, 1]) == []


def test_propose_tree_is_the_chain_first_then_alternatives():
    shared = SuffixCache(8, 10)
    shared.add([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4])
    shared.add([1, 2, 3, 7, 8])  # another continuation of "1 2 3", less frequent
    toks = [9, 1, 2]
    chain = SuffixIndex(shared, 0.1, 8.0).propose(list(toks), 4)
    drafts, parents = SuffixIndex(shared, 0.1, 8.0).propose_tree(list(toks), 8, 4)
    assert drafts[: len(chain)] == chain == [3, 4, 1, 2]
    assert parents[: len(chain)] == [-1, 0, 1, 2]
    assert len(drafts) <= 8 and max(tree.depths(parents)) <= 4
    assert all(p < j for j, p in enumerate(parents))  # preorder: parents first
    assert (drafts[4], parents[4]) == (7, 0)  # "1 2 3 -> 7": a second child of node 0
    # Best first by path probability: 3 (1), 3 4 (3/4), 3 4 1 (3/4), then 3 7 (1/4); at depth 3
    # 3 4 1 2 is out of reach, so the fourth node is the branch.
    drafts, parents = SuffixIndex(shared, 0.1, 8.0).propose_tree(list(toks), 4, 3)
    assert drafts == [3, 4, 1, 7] and parents == [-1, 0, 1, 0]
    assert SuffixIndex(shared, 0.1, 8.0).propose_tree([42], 8, 4) == ([], [])


@pytest.mark.skipif(native.library() is None, reason="native kernels not built here")
def test_native_tree_rows_equal_their_chains_bit_for_bit():
    """Each tree row's attention is that of a causal chunk of its ancestors alone, in the same
    slots order; rows of other nodes in between change nothing."""
    from kvledger.storage.kv_cache import KVCachePool

    torch.manual_seed(0)
    H, Hkv, D, bs, ctx = 8, 4, 16, 4, 11
    pool = KVCachePool(1, 16, bs, Hkv, D, torch.float32)
    cache = pool.layers[0]
    n = 1 + len(PARENTS)  # root + nodes in slots ctx .. ctx + n - 1
    total = ctx + n
    table = torch.arange(16, dtype=torch.int64)[None, : -(-total // bs)].contiguous()
    cache._k_slots[:total] = torch.randn(total, Hkv, D)
    cache._v_slots[:total] = torch.randn(total, Hkv, D)
    q = torch.randn(n, H, D)
    out = torch.empty(n, H * D)
    one = torch.tensor([0], dtype=torch.int64)
    masks = torch.tensor(tree.ancestor_masks(PARENTS), dtype=torch.int64)
    native.paged_prefill(
        q, cache, table, torch.tensor([total]), one, torch.tensor([n]), out, 0.3, 0, masks
    )
    for row, bits in enumerate(tree.ancestor_masks(PARENTS)):
        keep = [r for r in range(n) if bits >> r & 1]  # its ancestors and itself, in slot order
        chain = ctx + len(keep)
        pool2 = KVCachePool(1, 16, bs, Hkv, D, torch.float32)
        c2 = pool2.layers[0]
        c2._k_slots[:ctx], c2._v_slots[:ctx] = cache._k_slots[:ctx], cache._v_slots[:ctx]
        c2._k_slots[ctx:chain] = cache._k_slots[[ctx + r for r in keep]]
        c2._v_slots[ctx:chain] = cache._v_slots[[ctx + r for r in keep]]
        out2 = torch.empty(len(keep), H * D)
        native.paged_prefill(
            q[keep].contiguous(),
            c2,
            table,
            torch.tensor([chain]),
            one,
            torch.tensor([len(keep)]),
            out2,
            0.3,
        )
        assert torch.equal(out[row], out2[-1]), row
    # SDPA's mask (the backend's fallback) says the same.
    from kvledger.model.attention.torch_backend import _tree_mask

    m = _tree_mask(masks, total)
    assert m[:, :ctx].all() and m[:, ctx:].int().tolist() == [
        [b >> r & 1 for r in range(n)] for b in tree.ancestor_masks(PARENTS)
    ]


@pytest.fixture(scope="module")
def spec_tree(stories_path):
    return LLM(str(stories_path), calibrate_preemption=False, speculative_config=TREE)


def test_tree_greedy_outputs_are_identical_and_leave_the_chain(spec_tree, stories_llm):
    llm = spec_tree
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    ref = outputs(stories_llm, PROMPTS, sp)
    assert [outputs(llm, [p], sp)[0] for p in PROMPTS] == ref
    assert outputs(llm, PROMPTS, sp) == ref  # batched, the shared cache warm
    runner = llm.llm_engine.executor.worker.runner
    assert runner.num_tree_moves > 0, "no accepted path left the chain: the test proves nothing"
    s = llm.llm_engine.scheduler.speculator.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 13])
def test_tree_max_tokens_stop_strings_logprobs_n(spec_tree, stories_llm, max_tokens):
    """A path is cut at max_tokens and at a stop string as one-by-one decoding would be; the
    accepted tokens' logprobs are their rows' (the node's parent's); n > 1 children too."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    a = spec_tree.generate(PROMPTS[1:3], sp, use_tqdm=False)
    b = stories_llm.generate(PROMPTS[1:3], sp, use_tqdm=False)
    for x, y in zip(a, b):
        x, y = x.outputs[0], y.outputs[0]
        assert x.token_ids == y.token_ids and len(x.token_ids) == max_tokens
        assert [list(d) for d in x.logprobs] == [list(d) for d in y.logprobs]
        for dx, dy in zip(x.logprobs, y.logprobs):
            assert [dx[t].logprob for t in dx] == pytest.approx(
                [dy[t].logprob for t in dy], abs=1e-4
            )
    ref = stories_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    text = ref[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    sp = SamplingParams(temperature=0, max_tokens=60, stop=[stop], n=2)
    a = spec_tree.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs
    b = stories_llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs
    assert [(o.token_ids, o.text, o.stop_reason) for o in a] == [
        (o.token_ids, o.text, o.stop_reason) for o in b
    ]


def test_tree_seeded_random_sampling_is_reproducible(stories_path):
    """Two engines from the same state give a seeded request the same tokens (one engine run
    twice would not: its second run drafts from the first's outputs in the shared cache, so
    the rows sampled, and the generator's draws, differ: suffix decoding's, chain or tree)."""
    sp = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=60, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(str(stories_path), calibrate_preemption=False, speculative_config=TREE)
        runs.append(outputs(llm, PROMPTS[:2], sp))
        assert llm.llm_engine.scheduler.speculator.stats.num_accepted_tokens > 0
    assert runs[0] == runs[1] and all(len(o[0]) == 60 for o in runs[0])


def test_tree_nodes_slots_released_in_their_step(stories_path):
    """After every step each running request's table covers exactly its computed tokens, with
    a tree of up to 12 nodes reserved and rolled back across blocks of 4."""
    llm = LLM(str(stories_path), calibrate_preemption=False, block_size=4, speculative_config=TREE)
    eng = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), str(i))
    trees = []  # the steps' token trees, as the runner gets them
    eng.schedule_observers.append(lambda so: trees.extend(so.spec_tree_parents.values()))
    while eng.has_unfinished_requests():
        eng.step()
        for req in eng.scheduler.running:
            assert eng.kv.requests[req.request_id].num_tokens == req.num_computed_tokens
            assert req.num_computed_tokens == req.num_tokens - 1
        eng.kv.check_invariants()
    assert trees and eng.scheduler.speculator.stats.released_blocks > 0


def test_engines_that_cannot_verify_trees_draft_chains(stories_path, stories_llm):
    """A quantised cache (its rows are not moved as they are): chains, same tokens."""
    llm = LLM(
        str(stories_path),
        calibrate_preemption=False,
        kv_cache_dtype="int8",
        speculative_config=TREE,
    )
    assert llm.llm_engine.scheduler.speculator.tree_nodes == 0
    b = LLM(str(stories_path), calibrate_preemption=False, kv_cache_dtype="int8")
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    assert outputs(llm, PROMPTS[:3], sp) == outputs(b, PROMPTS[:3], sp)


def test_grammar_requests_draft_chains(spec_tree, stories_llm):
    """A grammar's mask rows follow one chain of drafts: a constrained request gets no tree,
    and its tokens are the plain engine's."""
    from kvledger.sampling_params import StructuredOutputsParams

    words = r"( ?(Tom|the|dog|park|and|went|to|The|big|red)){6,40}\."
    so = StructuredOutputsParams(regex=words + r"( Tom and his dog went to the park\.){1,4}")
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
    trees = []
    eng = spec_tree.llm_engine
    eng.schedule_observers.append(lambda s: trees.extend(s.spec_tree_parents))
    try:
        a = spec_tree.generate(PROMPTS[1:3], sp, use_tqdm=False)
    finally:
        eng.schedule_observers.pop()
    b = stories_llm.generate(PROMPTS[1:3], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert not trees
