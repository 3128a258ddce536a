"""Built-in training data: seeded sequences with structure a small model can learn, no download.

Each sequence is a walk on a sparse random Markov chain (every token has a handful of likely
successors), and its second half repeats its first half. The loss first falls fast as the model
learns the transitions (from ln(vocab) towards the chain's entropy), then further as attention
learns to copy. Batch ``i`` of rank ``r`` is a pure function of (seed, i, r), so the data position
is one integer that the checkpoint carries.
"""

from __future__ import annotations

import torch


class SyntheticCorpus:
    def __init__(self, vocab: int, seq: int, batch: int, seed: int, rank: int, successors: int = 4) -> None:
        self.vocab, self.seq, self.batch, self.seed, self.rank = vocab, seq, batch, seed, rank
        g = torch.Generator().manual_seed(seed)
        self.next_tokens = torch.randint(0, vocab, (vocab, successors), generator=g)
        weights = torch.rand(vocab, successors, generator=g) ** 3 + 0.05
        self.cum = torch.cumsum(weights / weights.sum(1, keepdim=True), 1)
        self.position = 0  # index of the next batch this rank will read

    def batch_at(self, index: int) -> torch.Tensor:
        """Tokens of shape (batch, seq + 1) for batch ``index``."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + index) * 65_537 + self.rank)
        half = (self.seq + 2) // 2
        walk = torch.empty(self.batch, half, dtype=torch.long)
        walk[:, 0] = torch.randint(0, self.vocab, (self.batch,), generator=g)
        u = torch.rand(half, self.batch, 1, generator=g)
        for t in range(1, half):
            prev = walk[:, t - 1]
            choice = torch.searchsorted(self.cum[prev], u[t]).clamp_(max=self.cum.shape[1] - 1)
            walk[:, t] = self.next_tokens[prev, choice.squeeze(1)]
        return torch.cat([walk, walk], 1)[:, : self.seq + 1]

    def next_batch(self) -> torch.Tensor:
        tokens = self.batch_at(self.position)
        self.position += 1
        return tokens

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
