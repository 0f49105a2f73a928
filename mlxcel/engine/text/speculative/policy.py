"""When drafting pays: measured round costs against the expected accepted tokens.

A verify round with k drafted tokens costs one target forward over k + 1 tokens (plus the
drafting) and yields 1 + (accepted drafts) tokens; a plain step costs one forward over one
token and yields one. Whether k > 0 pays depends on the hardware (a quantized matmul on the
CPU costs about k + 1 times a single token's; a float32 or GPU one about the same) and on the
acceptance rate, which depends on the text. So the engine measures both:

- `RoundCosts` (one per engine): seconds per lane step by draft length k (k = 0: a plain
  step), smoothed; an unmeasured k is extrapolated from the nearest measured one.
- `DraftPolicy` (one per sequence): the chance p that a drafted token is accepted given the
  ones before it were (counts decayed per round, with a weak prior), so k drafts are
  expected to give p + p^2 + ... + p^k accepted tokens. `choose` picks the k with the best
  expected tokens per second, or 0 (a plain step) when no k beats a plain step. While
  drafting does not pay but could at a high acceptance rate, a one-token probe runs now and
  then, less often after each probe that fails.
"""

from __future__ import annotations

_PROBE_P = 0.9  # the acceptance rate a probe bets on


class RoundCosts:
    """Smoothed seconds of a lane step by draft length (0 = a plain one-token step)."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._seconds: dict[int, float] = {}

    def record(self, k: int, seconds: float) -> None:
        """Fold one measured step with `k` drafted tokens into the average."""
        old = self._seconds.get(k)
        self._seconds[k] = seconds if old is None else old + self.alpha * (seconds - old)

    @property
    def plain(self) -> float | None:
        """Seconds of a plain step, None until one was measured."""
        return self._seconds.get(0)

    def estimate(self, k: int) -> float | None:
        """Seconds of a step drafting `k` tokens (None before a plain step was measured)."""
        if k in self._seconds:
            return self._seconds[k]
        plain = self._seconds.get(0)
        if plain is None:
            return None
        known = [w for w in self._seconds if w > 0]
        if not known:
            return plain  # optimistic until a round was measured: then it is tried
        w = min(known, key=lambda x: (abs(x - k), x))
        return max(plain, plain + (self._seconds[w] - plain) * k / w)


class DraftPolicy:
    """How many drafted tokens one sequence verifies next (0: a plain step)."""

    def __init__(
        self,
        costs: RoundCosts,
        *,
        n_max: int,
        n_min: int = 0,
        decay: float = 0.85,
        probe_every: int = 8,
        probe_every_max: int = 256,
        adaptive: bool = True,
    ) -> None:
        self.costs = costs
        self.adaptive = adaptive
        self.n_max = n_max
        self.n_min = max(1, n_min)
        self.decay = decay
        self._accepted = 0.0  # decayed accepted drafts
        self._rejected = 0.0  # decayed rejections (at most one per round)
        self._probe_base = probe_every
        self._probe_every = probe_every
        self._probe_max = probe_every_max
        self._declined = 0

    @property
    def acceptance(self) -> float:
        """The estimated chance that a drafted token is accepted (prior 1/2)."""
        return (self._accepted + 1.0) / (self._accepted + self._rejected + 2.0)

    def _rate(self, k: int, p: float) -> float:
        seconds = self.costs.estimate(k)
        if not seconds or seconds <= 0:
            return 0.0
        return (1.0 + sum(p**i for i in range(1, k + 1))) / seconds

    def choose(self, available: int, budget: int) -> int:
        """Draft length for the next step: `available` tokens can be drafted, and at most
        `budget` tokens may still be generated (a round yields up to k + 1)."""
        hi = min(available, self.n_max, budget - 1)
        if hi < self.n_min:
            return 0
        if not self.adaptive:
            return hi
        plain = self.costs.plain
        if plain is None or plain <= 0:
            return 0  # measure a plain step first
        p = self.acceptance
        best, best_rate = 0, 1.0 / plain
        for k in range(self.n_min, hi + 1):
            rate = self._rate(k, p)
            if rate > best_rate:
                best, best_rate = k, rate
        if best:
            return best
        if max(self._rate(k, _PROBE_P) for k in range(self.n_min, hi + 1)) <= 1.0 / plain:
            return 0  # no acceptance rate would make drafting pay here
        self._declined += 1
        if self._declined < self._probe_every:
            return 0
        self._declined = 0
        self._probe_every = min(self._probe_every * 2, self._probe_max)
        return self.n_min

    def record(self, k: int, accepted: int, seconds: float) -> None:
        """A step drafted `k` tokens, `accepted` of them were accepted, it took `seconds`."""
        self.costs.record(k, seconds)
        if k == 0:
            return
        self._accepted = self._accepted * self.decay + accepted
        self._rejected = self._rejected * self.decay + (1.0 if accepted < k else 0.0)
        if accepted:
            self._probe_every = self._probe_base
