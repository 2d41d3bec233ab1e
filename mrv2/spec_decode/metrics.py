"""Acceptance statistics of speculative decoding, as vLLM reports them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counts over verified steps: drafts proposed and accepted, and acceptances per draft position."""

    num_drafts: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify step: `num_accepted` of its `num_draft_tokens` drafts held."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits on average: the accepted drafts plus the one sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def snapshot(self) -> "SpecDecodingStats":
        """A copy that later observations leave unchanged."""
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.accepted_per_position))

    def minus(self, earlier: "SpecDecodingStats") -> "SpecDecodingStats":
        """What was observed since `earlier` (a snapshot of these counts)."""
        per_position = [a - (earlier.accepted_per_position[i] if i < len(earlier.accepted_per_position) else 0)
                        for i, a in enumerate(self.accepted_per_position)]
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts, self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens, per_position)

    def position_rates(self) -> list[float]:
        """Per draft position, the share of verify steps that accepted it."""
        return [a / self.num_drafts for a in self.accepted_per_position] if self.num_drafts else []
