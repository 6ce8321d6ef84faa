"""Tensor- and pipeline-parallel engines: every rank runs the same steps on the same rows.

A sharded model's forward is a collective: each rank's engine must run the same step
functions, with the same shapes, on the same requests, in the same order, or the ranks
wait on each other forever. Two ways to get there:

* Without lockstep (SPMD scripts, `fx-engine generate`): every rank submits the same
  requests itself and plans its own steps, which agree because the programs do; a request
  without a seed gets the same one on every rank (`spmd_seed`).
* With lockstep (a server: requests reach rank 0 only): rank 0 plans, and sends each step's
  plan with the records of the requests it needs (`StepMessage`: new requests' token ids
  and arguments, the intake, the prefill calls); the other ranks make the same requests,
  then only execute (`Engine.follow()`). When the step admitted requests whose prefix
  restore needs every rank's agreement (below), the prefill calls follow in a second
  message, since what is left to prefill is known only after the restores.

Either way, decisions that depend on timing (the speculation policy's draft plan and its
K) are rank 0's, broadcast when made (`Ranks.decided`), and what depends on each rank's own
memory is agreed: the KV token budget is the smallest rank's and prefix-cache entries are
costed in the largest share's bytes (`Ranks.share_budget`), and a restored prefix is the
length every rank holds (`Ranks.agree_prefix`). A draft model goes to the other ranks as
its place in `Engine(drafts=...)` (`DraftRef`), which every rank fills alike with its own
copy. A rank that cannot do what rank 0 does raises `RankMismatch` (the engine stops).
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
from typing import Any, Callable, Hashable, Sequence

import attrs
import mlx.core as mx

from fx_engine.core.cache import prefix_in_cache
from fx_engine.engine.scheduler import NO_INTAKE, Intake, StepPlan
from fx_engine.runtime.distributed import broadcast, gathered

__all__ = ["RankMismatch", "DraftRef", "RequestRecord", "StepMessage", "Ranks", "spmd_seed",
           "request_record", "draft_ref", "lead_step", "follow_step", "by_key", "check_drafts", "take_records"]


class RankMismatch(BaseException):
    """A tensor- or pipeline-parallel rank cannot do what rank 0 does in this step (not an
    Exception: no per-request handler may swallow it; the engine stops)."""


_SPMD_SEEDS = itertools.count()


def spmd_seed() -> int:
    """The default seed of a request on a sharded model without lockstep: every rank runs
    the same program, so the n-th request gets the same seed on every rank (a random one
    would make the ranks sample different tokens)."""
    digest = hashlib.blake2b(f"fx-engine-spmd-{next(_SPMD_SEEDS)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@attrs.frozen
class DraftRef:
    """A lockstep request's draft model as the other ranks get it: its place in
    `Engine(drafts=...)`, which every rank fills alike (the same program) with its own copy
    (a sharded model's self-draft is this rank's shard, with a per-rank fingerprint),
    never the weights."""

    index: int


def check_drafts(drafts: Sequence[Any]) -> list[Any]:
    """Engine(drafts=...): fx_engine Models (ValueError otherwise)."""
    for d in drafts:
        if not hasattr(d, "fingerprint") or not hasattr(d, "params"):
            raise ValueError(f"drafts: expected fx_engine Models, got {type(d).__name__}")
    return list(drafts)


def draft_ref(drafts: Sequence[Any], kw: dict[str, Any]) -> dict[str, Any]:
    """A lockstep request's arguments with its draft model as a DraftRef (every rank must
    have registered the same draft: Engine(drafts=...))."""
    d = kw.get("draft_model")
    if d is None or not hasattr(d, "fingerprint") or not hasattr(d, "params"):
        return kw
    at = [i for i, x in enumerate(drafts) if x is d or x.fingerprint == d.fingerprint]
    if not at:
        raise ValueError("draft_model: with lockstep tensor / pipeline parallelism every rank must "
                         "load the draft model and pass it as Engine(drafts=[...]) "
                         "(fx-engine serve --draft-model does)")
    return {**kw, "draft_model": DraftRef(at[0])}


@attrs.frozen
class RequestRecord:
    """What the other ranks of a lockstep engine need to make the same request as rank 0:
    its id, the prompt's token ids and the arguments, with the seed rank 0 drew, and a
    prompt with images its rows (image_prompt.portable; plain data: pickled)."""

    id: int
    ids: tuple[int, ...]
    kwargs: dict = attrs.field(eq=False)
    image: dict | None = attrs.field(default=None, eq=False)


def request_record(ids: Sequence[int], kw: dict[str, Any], seed: Any, image: dict | None = None) -> RequestRecord:
    """A request's record, made at submit (so arguments that cannot be sent to the other
    ranks are a ValueError there, naming them); the id is set when it is queued."""
    kw = {k: v for k, v in kw.items() if k != "chat"}
    kw["seed"] = seed
    try:
        pickle.dumps(kw)
    except Exception as e:
        bad = [k for k, v in kw.items() if not _picklable(v)]
        raise ValueError(f"{', '.join(bad) or 'arguments'}: with tensor parallelism a request's arguments "
                         f"must be plain data sent to every rank ({type(e).__name__})") from None
    return RequestRecord(-1, tuple(ids), kw, image)


def _picklable(v: Any) -> bool:
    try:
        pickle.dumps(v)
        return True
    except Exception:
        return False


def take_records(pending: Sequence[Any]) -> tuple[RequestRecord, ...]:
    """Rank 0: the records of the queued requests not sent yet (each is sent once, with
    the first step that may name it)."""
    new = [r for r in pending if r.record is not None]
    records = tuple(r.record for r in new)
    for r in new:
        r.record = None
    return records


@attrs.frozen
class StepMessage:
    """Rank 0's step, as the other ranks of a lockstep engine receive it: the records of
    the requests queued since the last step, the step's intake (retirements, admissions,
    abort) and its prefill calls (None: they follow in a second message, after the
    admissions' prefix restores); stop: rank 0 closed its engine."""

    records: tuple[RequestRecord, ...] = ()
    intake: Intake = NO_INTAKE
    prefill: StepPlan | None = None
    stop: bool = False


class Ranks:
    """This process's place in a sharded engine: its rank, whether it runs in lockstep, and
    the collectives that keep the ranks' steps equal."""

    def __init__(self, rank: int, lockstep: bool) -> None:
        self.rank = rank
        self.lockstep = lockstep
        self.stopped = False  # a follower: rank 0 has closed its engine

    @classmethod
    def of_model(cls, model: Any, lockstep: bool, budget: Any, prefix_cache: Any) -> "Ranks | None":
        """An engine's ranks (None: one process): the budgets agreed (`share_budget`) and
        the model's adapters frozen (loading one on some ranks only would split them).
        lockstep needs a sharded model (ValueError)."""
        if model.ranks <= 1:
            if lockstep:
                raise ValueError("lockstep: the model is not tensor-parallel (load it with tensor_parallel=N "
                                 "or pipeline_parallel=N)")
            return None
        ranks = cls(mx.distributed.init().rank(), lockstep)
        ranks.share_budget(budget, prefix_cache)
        model.adapters.freeze("a tensor- or pipeline-parallel engine is running: load adapters "
                              "on every rank before creating it")
        return ranks

    @property
    def leads(self) -> bool:
        """Rank 0 of a lockstep engine: it plans, the others follow."""
        return self.lockstep and self.rank == 0

    @property
    def follows(self) -> bool:
        return self.lockstep and self.rank != 0

    # ---- agreements made once
    def share_budget(self, budget: Any, prefix_cache: Any) -> None:
        """Every rank must make the same admission and prefix-cache decisions, but a rank's
        KV bytes per token depend on its share (SmolLM2's 3 KV heads: 2 + 1; pipeline
        stages of unequal layers): the smallest rank's token budget for everyone, and every
        prefix entry's cost measured in the largest share's bytes (this rank's bytes times
        the largest bytes per token over its own), so no rank holds more than its budgets."""
        ranks = gathered([-1 if budget.tokens is None else int(budget.tokens), int(budget.bytes_per_token)])
        budgets = [b for b, _ in ranks if b >= 0]  # (-1: no per-token entries, no bound)
        budget.tokens = min(budgets) if budgets else None
        if prefix_cache is not None:
            prefix_cache.cost_scale = (max(1, max(n for _, n in ranks)), max(1, int(budget.bytes_per_token)))

    # ---- agreements made during steps
    def decided(self, decide: Callable[[], Any]) -> Any:
        """A decision every rank must share (it depends on timing): rank 0's."""
        return broadcast(decide() if self.rank == 0 else None, self.rank)

    def agree_prefix(self, entry: Any, m: int) -> tuple[Any, int]:
        """The prefix every rank restores: the longest every rank holds (their stores agree
        while their memory budgets do, but disk files are each rank's own); a shorter one
        than this rank's match must still be restorable here (ring and recurrent layers
        keep only some lengths): if any rank cannot, none restores."""
        agree = lambda v: int(mx.distributed.all_min(mx.array([v], mx.int32)).item())  # noqa: E731
        want = agree(m if entry is not None else 0)
        if want and not agree(int(entry is not None and (
                want == m or prefix_in_cache(entry.cache.layout, len(entry.tokens), want)))):
            want = 0
        return (entry, want) if want else (None, 0)

    def restore_failed(self, m: int, e: BaseException) -> RankMismatch:
        """A restore every rank agreed on failed here alone: this rank is out of step."""
        return RankMismatch(f"rank {self.rank}: restoring the {m} prompt tokens every rank "
                            f"agreed on failed ({e!r})")

    def resolve_draft(self, drafts: Sequence[Any], kw: dict[str, Any]) -> dict[str, Any]:
        """A follower's arguments with rank 0's DraftRef replaced by this rank's own copy."""
        ref = kw.get("draft_model")
        if not isinstance(ref, DraftRef):
            return kw
        if ref.index >= len(drafts):
            raise RankMismatch(f"rank {self.rank}: rank 0's request uses draft model {ref.index} of its "
                               f"Engine(drafts=...); this rank has {len(drafts)}")
        return {**kw, "draft_model": drafts[ref.index]}

    # ---- lockstep messages
    def send(self, message: StepMessage | StepPlan) -> None:
        """Rank 0: this step's message (or its prefill plan) to the other ranks."""
        broadcast(message, 0)

    def receive(self) -> Any:
        """A follower: rank 0's next message (waits for rank 0's step)."""
        return broadcast(None, self.rank)


def lead_step(ranks: Ranks, records: tuple, intake: Intake, restores: bool,
              run_intake: Callable[[Intake], None],
              plan_prefill: Callable[[Intake], StepPlan]) -> StepPlan:
    """Rank 0's step up to its prefill calls, sent to the other ranks as it is decided:
    one message (the new requests' records, the intake, the prefill calls), or, when the
    intake's admissions restore prefixes (`restores`: a collective every rank joins, whose
    result decides what is left to prefill), the intake first and the prefill calls after
    the restores. Returns the prefill plan for rank 0 to execute."""
    if restores:
        ranks.send(StepMessage(records, intake, None))
        run_intake(intake)
        plan = plan_prefill(intake)
        ranks.send(plan)
        return plan
    run_intake(intake)
    plan = plan_prefill(intake)
    ranks.send(StepMessage(records, intake, plan))
    return plan


def follow_step(ranks: Ranks, msg: StepMessage, queue: Callable[[RequestRecord], None],
                run_intake: Callable[[Intake], None]) -> StepPlan:
    """A follower's step up to its prefill calls, from rank 0's message: its requests made
    and queued from their records (`queue`, under rank 0's ids), its intake run, and its
    prefill plan (received after the restores when rank 0 sends it apart)."""
    for rec in msg.records:
        queue(rec)
    run_intake(msg.intake)
    return msg.prefill if msg.prefill is not None else ranks.receive()


def by_key(requests: Sequence[Any], keys: Sequence[Hashable], rank: int | None) -> dict[Hashable, Any]:
    """The requests a plan names (by request id). Only a lockstep follower can lack one
    (its requests failed where rank 0's did not): it is out of step (RankMismatch)."""
    index = {r.handle.id: r for r in requests}
    missing = [k for k in keys if k not in index]
    if missing:
        raise RankMismatch(f"rank {rank}: rank 0's step names requests {missing} this rank does not hold")
    return {k: index[k] for k in keys}
