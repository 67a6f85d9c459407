"""Which drafts a verification step accepts: the longest prefix the target agrees with.

The runner samples every verification row from the target distribution as it samples any
decode row (greedy: the argmax; random: its seeded draw, after temperature, top-k/p, min-p and
the grammar mask), then keeps the drafts up to the first row whose sample differs, and that
row's sample (the correction, or after a full match the bonus token).

For a proposer whose draft is one token for certain (n-gram, suffix: q = a point mass on x),
this *is* speculative sampling's rejection rule: the draw y ~ p equals x with probability
p(x) (accept), and given y != x it is distributed as p with x removed and renormalised, which
is the residual max(p - q, 0) / Z. So every emitted token is distributed exactly as without
speculation (tests/test_spec_decode.py checks the frequencies with a chi-square test); greedy
outputs are the target's own argmaxes, token for token.
"""

from __future__ import annotations


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """Drafts accepted: how many leading ``drafts`` equal the rows' samples (``sampled`` has
    one more row than ``drafts``: the bonus)."""
    a = 0
    for d, s in zip(drafts, sampled):
        if d != s:
            break
        a += 1
    return a
