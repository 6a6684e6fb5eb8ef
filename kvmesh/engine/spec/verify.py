"""Verification of draft tokens against the target model's distributions (one row per position).

Greedy: accept drafts while each equals the target's argmax; the token after the last accepted
draft is the target's own choice. Sampling: drafts are deterministic proposals, so speculative
rejection sampling reduces to: accept draft d with probability p(d); on the first rejection draw
from p with d removed (renormalised); if all drafts pass, draw the bonus token from the last row.
The emitted tokens are then distributed exactly as sampling from p one token at a time.
"""

from __future__ import annotations

import torch


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """logits [k + 1, V] at the positions of (last token, draft...) -> emitted tokens (1..k+1)."""
    choice = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for position, token in enumerate(draft):
        if choice[position] != token:
            break
        out.append(token)
    out.append(choice[len(out)])
    return out


def verify_sampled(
    probs: torch.Tensor, draft: list[int], generator: torch.Generator | None
) -> list[int]:
    """probs [k + 1, V]: the target's (temperature / top-k / top-p / min-p) distributions."""
    uniforms = torch.rand(len(draft), generator=generator).tolist() if draft else []
    out: list[int] = []
    for position, token in enumerate(draft):
        p = probs[position]
        if uniforms[position] < float(p[token]):
            out.append(token)
            continue
        residual = p.clone()
        residual[token] = 0.0
        if float(residual.sum()) <= 0.0:  # p was one-hot on the draft: cannot reject it
            out.append(token)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out
