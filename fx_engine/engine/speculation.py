"""The speculation policy (pure Python, no MLX, property-tested in
tests/engine/test_speculation_policy.py): when speculative decoding pays, and how long each
row's drafts are.

* `SpeculationPolicy` holds the step-cost model: measured seconds (EMA) of decode (K = 0)
  and verify steps per (row bucket, K), the drafters' time per speculating step, and
  chooses each step's K (`choose_k`) to maximise expected tokens per second.
* `DraftState` is one row's adaptive draft length (`k` <= `k_max`), its back-off after
  drafts that keep failing (`skip`, `misses`), its acceptance-rate estimate (`alpha`) and
  usage counters; `adapt` updates it after a verify, `plan` decides its next draft length.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from fx_engine.core.buckets import pow2_ceil

__all__ = ["SpeculationPolicy", "DraftState", "EMA_OLD", "GAIN_MARGIN", "MAX_SKIP", "draft_candidates"]

EMA_OLD = 0.7  # weight of the old value in the cost / drafter-time / acceptance EMAs
GAIN_MARGIN = 1.02  # a larger K must beat the best so far by 2%
MAX_SKIP = 64  # longest back-off (steps of plain decoding) of a row whose drafts fail
ALPHA_PRIOR = 0.6  # acceptance-rate prior until measured


class DraftState:
    """One speculating row's adaptive draft length and counters."""

    __slots__ = ("k_max", "k", "skip", "misses", "drafted", "accepted", "rounds", "alpha")

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.k = k_max
        self.skip = 0  # steps left without drafting (back-off)
        self.misses = 0  # fully rejected drafts in a row
        self.drafted = 0
        self.accepted = 0
        self.rounds = 0  # verifies of this row's drafts
        self.alpha = ALPHA_PRIOR  # EMA of the per-token acceptance rate

    def plan(self, left: int) -> int:
        """This step's draft length (0: do not draft), `left` = tokens the row may still
        generate. A row backing off counts one skipped step down instead."""
        if self.skip > 0:
            self.skip -= 1
            return 0
        return max(0, min(self.k, left - 1))

    def adapt(self, drafted: int, accepted: int) -> None:
        """After a verify of `drafted` (> 0) tokens of which `accepted` were accepted:
        double k after a fully accepted draft (up to k_max), else just past what was
        accepted; two fully rejected drafts in a row back off (skip 2, 4, ... up to 64
        steps of plain decoding) so a row whose drafts keep failing stops paying for them."""
        self.drafted += drafted
        self.accepted += accepted
        self.rounds += 1
        self.alpha = EMA_OLD * self.alpha + (1 - EMA_OLD) * (accepted / drafted)
        if accepted == drafted:
            self.k = min(self.k_max, 2 * self.k)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self.misses = 0
        else:
            self.misses += 1
            if self.misses >= 2:
                self.skip = min(MAX_SKIP, 2 ** (self.misses - 1))


def expected_accepted(alpha: float, n: int) -> float:
    """Expected accepted drafts of n tokens at per-token acceptance alpha:
    alpha + alpha^2 + ... + alpha^n."""
    return sum(alpha ** i for i in range(1, n + 1))


class SpeculationPolicy:
    """The step-cost model and the choice of K (0: a plain decode step)."""

    def __init__(self) -> None:
        # Measured step costs (EMA seconds) per (row bucket, K); K = 0 is a decode step.
        self.cost: dict[tuple[int, int], float] = {}
        self.draft_seconds = 0.0  # EMA of the drafters' time per speculating step

    def observe(self, rows: int, k: int, seconds: float) -> None:
        """A step with K = k over a `rows`-row batch took `seconds` (compiles excluded)."""
        key = (rows, k)
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else EMA_OLD * old + (1 - EMA_OLD) * seconds

    def observe_drafting(self, seconds: float) -> None:
        """The drafters of a speculating step took `seconds` (compiles excluded)."""
        self.draft_seconds = EMA_OLD * self.draft_seconds + (1 - EMA_OLD) * seconds

    def forget_drafting(self) -> None:
        """A step where drafting was judged too dear: the estimate decays toward zero, so
        drafting is tried (and timed) again after a while instead of never (one slow
        measurement, a loaded machine's, must not switch drafting off for good)."""
        self.draft_seconds *= EMA_OLD

    def step_cost(self, rows: int, k: int) -> float | None:
        """Expected seconds of a step with K = k (0: decode) at row bucket `rows`:
        measured, else the decode cost times 1 + k/4 (the measured order on CPU: a verify
        of K=4 costs 1.75-1.9x a decode step, docs/benchmarks.md); None before a decode
        step of that bucket was timed."""
        c = self.cost.get((rows, k))
        if c is not None:
            return c
        base = self.cost.get((rows, 0))
        return None if base is None else base * (1 + k / 4)

    def choose_k(self, rows: int, drafts: Iterable[tuple[float, int]], live: int,
                 extra: float = 0.0) -> int:
        """Speculate only when it pays: pick the K bucket (1, 2, 4, ... up to the power of
        two >= the longest draft) maximising expected tokens per second, (live rows +
        expected accepted drafts) / (cost(K) + extra), and verify only if that beats plain
        decoding's live / cost(0) (each larger K by GAIN_MARGIN). `drafts`: (acceptance
        rate, draft length) of each drafting row (at least one); `extra`: the drafters'
        expected time (before proposing). Returns 0 for a plain decode step (also until a
        decode step of this row bucket has been timed)."""
        base = self.step_cost(rows, 0)
        if base is None:
            return 0
        drafts = list(drafts)
        best_k, best = 0, live / base
        longest = pow2_ceil(max(n for _, n in drafts))
        k = 1
        while k <= longest:
            cost = self.step_cost(rows, k) + extra
            gain = live
            for a, n in drafts:
                gain += expected_accepted(a, min(k, n))
            if gain / cost > best * GAIN_MARGIN:
                best_k, best = k, gain / cost
            k *= 2
        return best_k

    def plan_drafts(self, rows: int, candidates: Mapping[object, tuple[DraftState, int]],
                    live: int) -> dict[object, int]:
        """How many tokens to ask each candidate row's drafter for this step ({}: do not
        draft). candidates: key -> (its DraftState, tokens it may still generate), for the
        live rows that may speculate at all. Rows backing off skip; the draft length is the
        row's adaptive k capped by what it may still generate; drafting happens only when
        `choose_k` (counting the drafters' own time) expects it to pay."""
        plan = {}
        for key, (ds, left) in candidates.items():
            k = ds.plan(left)
            if k > 0:
                plan[key] = k
        if plan and not self.choose_k(
                rows, [(candidates[key][0].alpha, n) for key, n in plan.items()], live,
                self.draft_seconds):
            self.forget_drafting()
            return {}
        return plan


def draft_candidates(live: Iterable[object]) -> dict[object, tuple[DraftState, int]]:
    """The live rows (engine requests) that may speculate this step, for `plan_drafts`:
    key -> (its DraftState, tokens it may still generate). A row needs a drafter; XTC rows
    never speculate (XTC's exclusion is not a distribution a draft can be verified
    against)."""
    return {r: (r.spec, r.max_tokens - len(r.generated)) for r in live  # type: ignore[attr-defined]
            if r.drafter is not None and not r.cfg.xtc_probability > 0}  # type: ignore[attr-defined]
