"""Token trees: several candidate continuations verified in one forward (SpecInfer's and Medusa's
tree attention, suffix decoding's speculation trees), torch-free.

On a small model a verification row costs next to nothing beside a step's fixed work, so when
the proposer is unsure of the next token it pays to verify its few likeliest continuations
together rather than bet on one. A tree of ``N`` draft nodes is sent as its tokens in preorder
with each node's parent (``-1``: the last accepted token, the root), the likeliest child first at
every node, so the likeliest path is nodes ``0, 1, ..., d - 1``: a chain. The verification
chunk is the root and the nodes in that order: node ``j`` takes slot ``start + 1 + j`` (the
scheduler reserved ``1 + N`` slots as for a chain), sits at position ``start + depth(j)`` for
RoPE, and attends to the context and its own ancestors only (``ancestor_masks``).

Acceptance (``walk``): from the root, the row's sampled token moves to the child holding it,
until no child does; the path's tokens are accepted and the last row's sample follows them. That
is the chain's rule at every node (a draft is a point mass, kvledger.spec_decode.rejection), so
every emitted token is the target's own sample from its own context, greedy or not. A path
that leaves the chain had its K/V written to other slots: the runner moves them to the path's
canonical slots in the same step (``moves``), before the scheduler trims the rest.
"""

from __future__ import annotations

# The root and its nodes: one 64-bit ancestor mask per row (csrc/paged_prefill.c).
MAX_TREE_ROWS = 64


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (1: a child of the root)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestor_masks(parents: list[int]) -> list[int]:
    """Per row of the verification chunk (the root, then the nodes): bit i set for row i itself
    and each of its ancestors (row 0 is the root)."""
    masks = [1]
    for j, p in enumerate(parents):
        masks.append(masks[p + 1] | (1 << (j + 1)))
    return masks


def walk(drafts: list[int], parents: list[int], sampled: list[int]) -> list[int]:
    """The accepted nodes, root to leaf: at each row (``sampled[0]`` the root's, ``sampled[1 +
    j]`` node j's), the child holding the sampled token, while there is one."""
    path: list[int] = []
    row = 0  # the current node's row: 0 the root, 1 + j node j
    parent = -1
    j = 0
    n = len(drafts)
    while True:
        want = sampled[row]
        # Children of ``parent`` follow it in preorder; scan them (the first child is next).
        nxt = -1
        for c in range(j, n):
            if parents[c] == parent and drafts[c] == want:
                nxt = c
                break
            if parents[c] < parent:  # left the subtree of parent: no more of its children
                break
        if nxt < 0:
            return path
        path.append(nxt)
        parent, row, j = nxt, nxt + 1, nxt + 1


def moves(path: list[int]) -> list[tuple[int, int]]:
    """(from, to) node slots for a path off the chain: node ``path[i]``'s K/V belongs in slot
    ``i`` (slot ``j`` is position ``start + 1 + j``). Sources lie at or after their targets, so
    moving in order never overwrites a source not yet read."""
    return [(j, i) for i, j in enumerate(path) if j != i]


def is_chain(parents: list[int]) -> bool:
    return all(p == j - 1 for j, p in enumerate(parents))
