"""The retry schedule both notifiers share: so many attempts, exponential backoff, a cap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    attempts: int = 4
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay_s(self, retry_count: int) -> float:
        """Seconds before retry number `retry_count + 1` (0-based count of retries done)."""
        return min(self.backoff_s * 2 ** retry_count, self.max_backoff_s)
