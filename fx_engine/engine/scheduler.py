"""Pure-Python step planning for the continuous-batching engine (no MLX, property-testable).

Every decision of an engine step is made here and returned as plain data (frozen
dataclasses of ints and tuples, hashable, picklable: a lockstep engine broadcasts them
from rank 0, `engine/lockstep.py`). One step's `StepPlan` is built in three phases,
because each phase's inputs exist only once the previous one has run:

1. `plan_intake` -> `Intake`: which cancelled requests retire, which queued requests are
   admitted (FIFO while a row is free and the KV budget holds, `can_admit`);
2. `plan_step` -> the prefill calls: which pieces run (`plan_prefill`: decode rows are
   served first, one token each; the rest of the per-step token budget goes to prefill
   pieces, FIFO, at most `prefill_chunk` tokens per request, each padded to a shape bucket
   `chunk_bucket` and counted at its padded size), how they share `prefill_step` calls
   (`group_prefill`: similar padded sizes and the same prefill-cache shape, a power of two
   of rows) and how a call is split (`split_call`: scoring rows alone, power-of-two row
   counts); admitted requests' restored prefixes change what is left to prefill, so this
   phase follows the admissions;
3. `plan_decode` -> `DecodePlan`: decode or verify over the whole batch, each verifying
   row's draft length (per-row K) and the K bucket, the rows whose grammar masks are
   filled, and the cache growth before the step; it follows the prefill calls (requests
   they finish join the batch and decode in the same step) and the drafters (the
   speculation policy, engine/speculation.py, weighs the drafts actually proposed).

After the step, `plan_maintenance` -> `Maintenance` (drop, compaction, capacity shrink);
`plan_growth` is the growth's arithmetic (compaction first when the KV budget demands it).
Shape buckets: `row_bucket`, `capacity_bucket` (decode batch), `chunk_bucket` (prefill
pieces); admission against the KV budget: `kv_footprint`, `can_admit`, `ever_fits`
(engine/budget.py holds a model's budget). The engine executes the plans
(engine/executor.py, engine/batch.py) and emits the tokens (engine/emit.py).

The policy is documented in specs/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Hashable, Iterable, Mapping, Sequence

from fx_engine.core.buckets import pow2_ceil, pow2_floor  # noqa: F401  (re-exported)

MIN_CHUNK = 16  # smallest prefill piece shape
MIN_CAPACITY = 256  # smallest decode-cache capacity bucket


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Decode batch sizes: 1, 2, 4, ... below max_rows, then max_rows itself."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    out.append(max_rows)
    return tuple(out)


def row_bucket(n: int, max_rows: int) -> int:
    """The smallest row bucket holding n rows (n <= max_rows)."""
    if not 0 <= n <= max_rows:
        raise ValueError(f"row count {n} outside [0, {max_rows}]")
    return min(max_rows, pow2_ceil(max(1, n)))


def capacity_bucket(n: int, minimum: int = MIN_CAPACITY) -> int:
    """Decode-cache capacity bucket (a power of two >= minimum) holding n slots."""
    return max(minimum, pow2_ceil(n))


def chunk_bucket(n: int) -> int:
    """Padded shape of a prefill piece of n real tokens: a power of two up to 64, then a
    multiple of a quarter of the power of two below n (four shapes per octave: 80, 96,
    112, 128, 160, ...). Prompts' last pieces have any length: powers of two alone made
    25% of a padded piece (65-512 tokens) padding on average, these shapes under 8% (at
    most 20%); in the 32-request serving burst 10,544 -> 9,472 padded tokens for 8,865 real
    ones. A shape compiles in ~0.5 s, once."""
    if n <= 64:
        return max(MIN_CHUNK, pow2_ceil(n))
    step = pow2_floor(n - 1) // 4  # n is in (4 * step, 8 * step]
    return -(-n // step) * step


def normalize_chunk(prefill_chunk: int) -> int:
    """Prefill chunks are powers of two (>= MIN_CHUNK) so full pieces need no padding."""
    if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive integer, got {prefill_chunk!r}")
    return max(MIN_CHUNK, pow2_floor(prefill_chunk))


def step_budget(step_token_budget: int | None, prefill_chunk: int, max_rows: int) -> int:
    """Tokens per step shared by decode rows (1 each) and prefill pieces (padded): by
    default a whole chunk beside a full batch; never below max_rows + MIN_CHUNK, so prefill
    always progresses (ValueError)."""
    if step_token_budget is None:
        step_token_budget = prefill_chunk + max_rows
    if step_token_budget < max_rows + MIN_CHUNK:
        raise ValueError(
            f"step_token_budget must be >= max_rows + {MIN_CHUNK} "
            f"({max_rows + MIN_CHUNK}), got {step_token_budget}"
        )
    return step_token_budget


def plan_prefill(
    decode_rows: int,
    waiting: Sequence[tuple[Hashable, int]],
    prefill_chunk: int,
    step_token_budget: int,
    packable: Collection[Hashable] = (),
) -> list[tuple[Hashable, int]]:
    """Prefill pieces for one step: [(key, n_tokens)] in FIFO order.

    decode_rows: rows that decode this step (each costs one token of the budget).
    waiting: (key, remaining prompt tokens) of admitted requests still prefilling, FIFO.
    Each piece has n <= min(remaining, prefill_chunk) real tokens and costs its padded size
    `chunk_bucket(n)`, or n where its request is `packable` (its calls run on packed rows,
    core/packing.py, whose padding costs no products); the costs sum to at most
    `step_token_budget - decode_rows` (the engine guarantees that is >= MIN_CHUNK, so
    prefill always progresses). A piece that does not finish its prompt is exactly a
    bucket shape (no padding waste).
    """
    avail = step_token_budget - decode_rows
    plan: list[tuple[Hashable, int]] = []
    for key, remaining in waiting:
        if remaining <= 0:
            continue
        if avail < MIN_CHUNK:
            break
        cost = (lambda n: n) if key in packable else chunk_bucket
        n = min(remaining, prefill_chunk, avail)
        if cost(n) > avail or (n < remaining and chunk_bucket(n) != n):
            n = pow2_floor(min(n, avail))
            if n < MIN_CHUNK:
                break
        plan.append((key, n))
        avail -= cost(n)
    return plan


MAX_GROUP_PAD = 1.25  # a piece joins a wider call only if its padded shape grows <= 25%
# ... or, packed (its products on the valid tokens alone), if its attention's rows grow
# <= 4x: attention is ~1-4% of a 1B model's work per token at spans up to 512
PACKED_GROUP_PAD = 4.0


def packed_rows(tokens: int) -> int:
    """The packed rows (core/packing.py) a call of `tokens` valid tokens runs on: the
    prefill pieces' shape bucket of the total (< 20% padding, few shapes)."""
    return chunk_bucket(tokens)


def pack_arg(tokens: int, padded: int) -> dict[str, int]:
    """A step's `pack` keyword for `tokens` valid tokens in `padded` positions (rows x
    chunk): {"pack": packed_rows(tokens)} where that is fewer rows, else {} (the padded
    step: packing would save nothing)."""
    rows = packed_rows(tokens)
    return {"pack": rows} if rows < padded else {}


def pow2_splits(n: int) -> list[int]:
    """n as a sum of distinct powers of two, largest first (7 -> [4, 2, 1])."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def group_prefill(
    decode_rows: int,
    waiting: Sequence[tuple[Hashable, int, Hashable]],
    prefill_chunk: int,
    step_token_budget: int,
    max_rows: int,
    packable: Collection[Hashable] = (),
) -> list[tuple[int, list[tuple[Hashable, int]]]]:
    """Batched prefill for one step: [(C, [(key, n), ...])], each entry one `prefill_step`
    call over len(pieces) rows (a power of two <= max_rows) of C tokens, row i holding n_i
    real tokens.

    waiting: (key, remaining prompt tokens, group key) in FIFO order; only pieces with equal
    group keys share a call (the engine: the prefill cache's capacity, so stacking rows
    never changes a request's memory). The pieces are `plan_prefill`'s (the same requests,
    FIFO, the same budget); then, widest first, each piece joins an open call of its group
    whose C is at most MAX_GROUP_PAD x its own padded size, if the budget's slack pays the
    padding. A piece that does not finish its prompt grows to C real tokens instead (so
    unfinished pieces are still never padded). The calls' rows x C sum to at most
    `step_token_budget - decode_rows`. Why: one forward over B rows of C tokens costs less
    than B forwards of C (measured 1.1-1.4x for C <= 128 on a 2-core CPU, more on GPUs),
    and N prompts that arrive together get their first tokens together.

    packable: keys of requests whose calls may run on packed rows (`packed_rows`; the
    engine: a family that packs, no images, no adapter). They cost their real tokens, call
    only with each other, and join a call whose C is at most PACKED_GROUP_PAD x their own
    bucket (the padding costs attention alone); their calls' packed rows sum to at most
    the budget, up to `packed_rows`' rounding.
    """
    remaining = {k: r for k, r, _ in waiting}
    gkey = {k: g for k, _, g in waiting}
    order = {k: i for i, (k, _, _) in enumerate(waiting)}
    pieces = plan_prefill(decode_rows, [(k, r) for k, r, _ in waiting], prefill_chunk,
                          step_token_budget, packable)
    slack = step_token_budget - decode_rows - sum(n if k in packable else chunk_bucket(n) for k, n in pieces)
    calls: list[tuple[int, Hashable, list[tuple[Hashable, int]]]] = []  # (C, group, pieces)
    for key, n in sorted(pieces, key=lambda kn: -chunk_bucket(kn[1])):  # stable: FIFO ties
        own = chunk_bucket(n)
        packs = key in packable
        group = (gkey[key], packs)
        for i, (c, g, members) in enumerate(calls):
            grown = min(remaining[key], c)
            extra = grown - n if packs else c - own  # what joining costs the budget
            if (g == group and len(members) < max_rows and own * (PACKED_GROUP_PAD if packs else MAX_GROUP_PAD) >= c
                    and extra <= slack):
                slack -= extra
                members.append((key, grown))
                break
        else:
            calls.append((own, group, [(key, n)]))
    out: list[tuple[int, list[tuple[Hashable, int]]]] = []
    for _, _, members in calls:
        members.sort(key=lambda kn: (-kn[1], order[kn[0]]))
        at = 0
        for size in pow2_splits(len(members)):
            part = sorted(members[at : at + size], key=lambda kn: order[kn[0]])
            out.append((max(chunk_bucket(n) for _, n in part), part))
            at += size
    out.sort(key=lambda call: order[call[1][0][0]])
    return out


def prefill_slots(prompt_len: int, prefill_chunk: int) -> int:
    """Token slots of the 1-row cache a request prefills into (its prompt plus one padded
    chunk of headroom, bucketed); it lives until the request joins the decode batch."""
    return capacity_bucket(prompt_len + chunk_bucket(min(prefill_chunk, prompt_len)))


def kv_footprint(needs: Sequence[int], max_rows: int, prefilling: Sequence[int] = ()) -> int:
    """Token slots of the KV memory for admitted requests: the rectangular decode cache that
    can hold rows needing `needs` slots each (prompt + max_tokens), row_bucket(len) x
    capacity_bucket(max need), plus the prefill caches (`prefill_slots`) of the requests
    still prefilling."""
    rect = row_bucket(len(needs), max_rows) * capacity_bucket(max(needs)) if needs else 0
    return rect + sum(prefilling)


def can_admit(
    admitted_needs: Sequence[int], need: int, max_rows: int, budget_tokens: int | None,
    prefilling: Sequence[int] = (), new_prefill: int = 0,
) -> bool:
    """A free row exists and the KV memory of every admitted request plus this one (decode
    cache and prefill caches, see `kv_footprint`) fits the budget (None = unbounded).
    prefilling: prefill-cache slots of admitted requests still prefilling; new_prefill: this
    request's."""
    if len(admitted_needs) >= max_rows:
        return False
    if budget_tokens is None:
        return True
    used = kv_footprint([*admitted_needs, need], max_rows, [*prefilling, new_prefill])
    return used <= budget_tokens


def ever_fits(need: int, max_rows: int, budget_tokens: int | None, new_prefill: int = 0) -> bool:
    """Whether a request needing `need` slots (and `new_prefill` while it prefills) fits the
    KV budget alone."""
    return budget_tokens is None or kv_footprint([need], max_rows, [new_prefill]) <= budget_tokens


def shrink_rows_target(live: int, rows: int, max_rows: int) -> int | None:
    """Compaction with hysteresis: shrink the decode batch only when the live rows fit in a
    quarter of it (so a batch oscillating around a bucket edge never copies every step)."""
    target = row_bucket(max(live, 1), max_rows)
    if live == 0 or target * 4 <= rows:
        return target
    return None


def shrink_capacity_target(max_len: int, capacity: int) -> int | None:
    """Shrink the decode-cache capacity when every live row fits in a quarter of it; the new
    capacity keeps 2x headroom."""
    target = capacity_bucket(2 * (max_len + 1))
    if capacity_bucket(max_len + 1) * 4 <= capacity and target < capacity:
        return target
    return None


# --------------------------------------------------------------------------------------
# Plans as plain data
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Intake:
    """A step's first decisions: `retire` the cancelled requests (queued, prefilling or
    decoding: a cancelled row is free within one step), then `admit` queued requests, in
    FIFO order. `abort`: the engine was closed without waiting (every request is in
    `retire`). Keys are the engine's request ids."""

    retire: tuple[Hashable, ...] = ()
    admit: tuple[Hashable, ...] = ()
    abort: bool = False


NO_INTAKE = Intake()


def plan_intake(
    queued: Iterable[tuple[Hashable, int, int]],
    admitted: Sequence[tuple[Hashable, int, int]],
    cancelled: Sequence[Hashable],
    max_rows: int,
    budget_tokens: int | None,
    abort: bool = False,
) -> Intake:
    """queued: (key, need, prefill slots) of the waiting requests, FIFO (read lazily: only
    up to the first that does not fit); admitted: (key, need, prefill slots or 0 once
    decoding) of the prefilling and decoding requests; cancelled: keys of the requests
    whose handle was cancelled (every request when aborting), queued ones first, the
    order they retire in. Retiring comes first, so their rows and budget are free for the
    admissions of the same step; then requests are admitted from the head while
    `can_admit` holds, each counted for the next: the head blocks the queue (no
    overtaking, so long requests never starve)."""
    if abort:
        return Intake(tuple(cancelled), (), True)
    gone = set(cancelled)
    needs = [n for k, n, _ in admitted if k not in gone]
    slots = [s for k, _, s in admitted if k not in gone and s]
    admit = []
    for key, need, pslots in queued:
        if key in gone:
            continue
        if not can_admit(needs, need, max_rows, budget_tokens, slots, pslots):
            break
        needs.append(need)
        slots.append(pslots)
        admit.append(key)
    return Intake(tuple(cancelled), tuple(admit))


@dataclass(frozen=True)
class PrefillCall:
    """One call that runs: `size` padded tokens in each of len(pieces) rows, pieces (key,
    real tokens) in row order. score: a `score_step` (prompt logprobs need the logits at
    every position), always one row. packed: the rows its products run on (`prefill_step`'s
    `pack`: `packed_rows` of its tokens), None: all rows x size."""

    size: int
    pieces: tuple[tuple[Hashable, int], ...]
    score: bool = False
    packed: int | None = None


def packed_call(size: int, pieces: Sequence[tuple[Hashable, int]], packs: bool) -> PrefillCall:
    """A (not scoring) call of these pieces at C = size, on packed rows when `packs` and
    that is fewer rows than the padded ones (one row never is: its bucket is its C)."""
    pack = pack_arg(sum(n for _, n in pieces), size * len(pieces)) if packs else {}
    return PrefillCall(size, tuple(pieces), packed=pack.get("pack"))


def split_call(
    size: int, pieces: Sequence[tuple[Hashable, int]], scoring: Sequence[Hashable] | set = (),
    planned: int | None = None, packs: bool = False,
) -> tuple[PrefillCall, ...]:
    """How one of `group_prefill`'s calls (`size`, `pieces`) runs. Rows in `scoring` run
    alone, first, each at its own bucket (`score_step` returns logits at every position,
    which only they need). When the rest is not the `planned` row count (default: all the
    pieces; also when a testing fault hook failed some rows) it runs as power-of-two row
    counts, largest first, each call at the widest bucket of its rows: bounded compile
    shapes, never a row count that was not a bucket. packs: the calls but the scoring ones
    run on packed rows (`packed_call`)."""
    gone = set(scoring)
    calls = [PrefillCall(chunk_bucket(n), ((k, n),), True) for k, n in pieces if k in gone]
    rest = [(k, n) for k, n in pieces if k not in gone]
    if len(rest) == (len(pieces) if planned is None else planned):
        return tuple(calls) + ((packed_call(size, rest, packs),) if rest else ())
    at = 0
    for rows in pow2_splits(len(rest)):
        part = rest[at : at + rows]
        at += rows
        calls.append(packed_call(max(chunk_bucket(n) for _, n in part), part, packs))
    return tuple(calls)


@dataclass(frozen=True)
class DecodePlan:
    """The step's decode or verify over the whole batch.

    k: 0 for a plain `decode_step`, else the K bucket of one `verify_step` (a power of two
    >= the longest draft). drafts: (key, draft length) of the rows that verify drafts
    this step, the per-row K (rows not named decode: n_draft = 0). masked: the constrained
    rows, whose grammar masks are filled before the step (a grammar may still cut a row's
    drafts to what it allows). grow_to: positions every row must have room for (the
    cache grows, compacting first if the KV budget demands, `plan_growth`). split: some
    row has logits processors, so the decode runs as forward, processors, sampling.
    """

    k: int
    drafts: tuple[tuple[Hashable, int], ...]
    masked: tuple[Hashable, ...]
    grow_to: int
    split: bool = False


def plan_decode(
    rows: Sequence[tuple[Hashable, int, bool, bool]], drafts: Mapping[Hashable, int] | None = None,
    k: int = 0,
) -> DecodePlan:
    """rows: (key, cache length, constrained, has logits processors) of the live rows;
    drafts: key -> draft length of the rows that proposed drafts (cut to k), with k the
    chosen K bucket (0: decode). The growth is each row's length plus its drafts plus the
    token sampled after them (span and capacity are bucketed by the executor)."""
    drafts = dict(drafts or {}) if k else {}
    grow_to = max(n + drafts.get(key, 0) for key, n, _, _ in rows) + 1
    return DecodePlan(k, tuple((key, drafts[key]) for key, _, _, _ in rows if drafts.get(key)),
                      tuple(key for key, _, constrained, _ in rows if constrained), grow_to,
                      any(p for _, _, _, p in rows))


@dataclass(frozen=True)
class StepPlan:
    """One engine step's decisions, as plain data (see the module docstring's phases).

    decode_rows: rows decoding when the prefill was planned (served first: one token each).
    prefill: the step's grouped `prefill_step` calls, `group_prefill`'s [(C, [(key, n)])].
    calls: what runs: each group cut by `split_call` (scoring rows, power-of-two rows).
    intake: the retirements and admissions made before (phase 1).
    decode: the decode/verify (phase 3; None until planned, or when no row is live).
    Requests whose prompt a call finishes are inserted into the decode batch in the same
    step; then the decode (or verify) runs, then `Maintenance`.
    """

    decode_rows: int
    prefill: tuple[tuple[int, tuple[tuple[Hashable, int], ...]], ...]
    calls: tuple[PrefillCall, ...] = ()
    intake: Intake = NO_INTAKE
    decode: DecodePlan | None = None


def plan_step(
    decode_rows: int,
    waiting: Sequence[tuple[Hashable, int, Hashable]],
    prefill_chunk: int,
    step_token_budget: int,
    max_rows: int,
    scoring: Sequence[Hashable] | set = (),
    intake: Intake = NO_INTAKE,
    packable: Collection[Hashable] = (),
) -> StepPlan:
    """The step's prefill plan: `group_prefill` over the prefilling requests (see there),
    each call cut by `split_call` (`scoring`: keys of the requests that return prompt
    logprobs; `packable`: of those whose calls may run on packed rows, never scoring ones);
    `intake` is carried along (phase 1 of the same step)."""
    gone = set(scoring)
    packable = set(packable) - gone
    calls = group_prefill(decode_rows, waiting, prefill_chunk, step_token_budget, max_rows, packable)
    return StepPlan(decode_rows, tuple((size, tuple(members)) for size, members in calls),
                    tuple(c for size, members in calls
                          for c in split_call(size, members, gone, packs=members[0][0] in packable)),
                    intake)


@dataclass(frozen=True)
class Maintenance:
    """The decode batch's upkeep after a step: `drop` the batch (no live row, nothing
    prefilling); else compact the live rows into rows 0..live-1 of a `compact_to`-row
    batch (None: keep the rows), then resize the capacity to `capacity_to` (None: keep)."""

    drop: bool = False
    compact_to: int | None = None
    capacity_to: int | None = None


NO_MAINTENANCE = Maintenance()


def plan_maintenance(
    live_rows: Sequence[int], lengths: Sequence[int], rows: int, capacity: int, max_rows: int,
    budget_tokens: int | None, prefilling: bool,
) -> Maintenance:
    """live_rows: indices of the live rows (ascending), lengths: their cache lengths; rows x
    capacity: the batch. Shrink rows with hysteresis (`shrink_rows_target`), or to the live
    rows' bucket when the batch is over the KV budget; compact also when the live rows are
    not already rows 0..live-1; shrink the capacity when every row fits in a quarter of it
    (`shrink_capacity_target`)."""
    if not live_rows:
        return NO_MAINTENANCE if prefilling else Maintenance(drop=True)
    live = len(live_rows)
    target = shrink_rows_target(live, rows, max_rows)
    if target is None and budget_tokens is not None and rows * capacity > budget_tokens:
        target = row_bucket(live, max_rows)
    if target is not None and not (target < rows or list(live_rows) != list(range(live))):
        target = None
    cap = shrink_capacity_target(max(lengths), capacity)
    if target is None and cap is None:
        return NO_MAINTENANCE
    return Maintenance(compact_to=target, capacity_to=cap)


def plan_growth(
    needed: int, rows: int, live: int, capacity: int, max_rows: int, budget_tokens: int | None,
) -> tuple[int | None, int | None]:
    """Before a step that writes up to `needed` positions in some row: (compact_to,
    capacity_to). The capacity grows to `capacity_bucket(needed)` (None: it fits);
    if rows x that capacity would exceed the KV budget, the `live` rows are compacted
    into their row bucket first (None: no compaction)."""
    if needed <= capacity:
        return None, None
    cap = capacity_bucket(needed)
    if budget_tokens is not None and rows * cap > budget_tokens:
        return row_bucket(live, max_rows), cap
    return None, cap
