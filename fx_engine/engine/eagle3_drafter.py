"""EAGLE-3 heads as drafters of the engine (issue 45, items 2 and 4); the pure head is
fx_engine.core.drafters.eagle3, its checkpoint reader fx_engine.loading.drafter.

    drafter = Eagle3Drafter.load("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", model)  # or a folder
    fx_engine.generate(model, prompt, draft_model=drafter)      # any request's draft_model=

How it runs, per request (row):

* The head reads the target's hidden states at three layer boundaries (`drafter.capture`,
  a `core.models.Capture`). A drafter that has a `capture` is fed by the engine: every
  target step that processes one of its rows' positions (prefill chunks, decode, verify)
  runs with that capture, inside the same compiled forward, and hands the row drafter the
  states of the positions it processed and kept (`observe(start, states)`: a verify's
  accepted ones). Rows of one step share the union of their drafters' captures.
* The row's head keeps its own 1-row KV cache beside the target's. Its pair at position t
  is (the target's captured states at t, the token at t + 1), EAGLE's input: fed lazily when
  the next token is known (at `propose`, or early when many states wait), in chunks of a
  few power-of-two shapes (`head_step_compiled`, keyed on the chunk and span buckets).
* `propose(tokens, k)` feeds the new pairs, then chains the head on its own output (its
  pre-norm hidden state and the token it drafted) for k drafts, mapped from the draft
  vocabulary through d2t: a greedy row's are the argmax; a sampled row's (temperature > 0)
  are drawn from the head's distribution processed with the row's sampling settings
  (`core.drafters.sampled`), reported over the target's vocabulary (zero outside the draft
  vocabulary) as q for the target's acceptance rule. The chained entries are the head's guesses, not the target's:
  the next `propose` rolls the head's cache back by length to its real pairs (`with_lengths`)
  and feeds the target's states of the positions the verify accepted, as EAGLE and vLLM do.
  So rollback after a rejection needs no call, and the head never sees a rejected token.

The row side (lazy feeding, chaining, rollback by length) is engine/captured_drafter.py's
`CapturedRow`, shared with the checkpoints' MTP modules (engine/mtp_drafter.py).

A row whose captured states have a gap (a prefix restored from the prefix cache is skipped
for these requests so that does not happen) stops drafting (`broken` says why) and decodes.
Refused: targets split over processes (tensor / pipeline parallel: their captured layers and
embedding table live on several ranks) and families whose forward does not go through
`skeleton.decoder_step` (a CaptureError naming the model type, at construction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache, init_cache
from fx_engine.core.drafters import eagle3
from fx_engine.core.models import Capture, forward
from fx_engine.core.tree import tree_leaves
from fx_engine.engine.captured_drafter import FEED_CHUNK, FLUSH_AT, MIN_CAPACITY, CapturedDrafter, CapturedRow

__all__ = ["Eagle3Drafter", "Eagle3Row", "FEED_CHUNK", "FLUSH_AT", "MIN_CAPACITY"]


class Eagle3Drafter(CapturedDrafter):
    """An EAGLE-3 head drafting for `target` (a Model): a Drafter (`new_row`) whose rows are
    fed the target's captured hidden states by the engine (`capture`). `head`: the head's
    params (`loading.drafter.load_eagle3_head`, or `Eagle3Drafter.load`)."""

    kind = "eagle3"  # (usage's and /metrics' name for it)

    def __init__(self, head: eagle3.Eagle3Params, target: Any):
        if getattr(target, "tensor_parallel", 1) > 1 or getattr(target, "pipeline_parallel", 1) > 1:
            raise ValueError("EAGLE-3 drafting is not supported for targets split over processes (tensor / "
                             "pipeline parallelism): use prompt_lookup or a draft model there")
        layers = eagle3.check_target(head.config, target.config, own_embed=head.embed is not None)
        # evaluated here: lazily read arrays belong to this thread's stream, and the engine
        # drafts on its own thread (MLX: "no Stream(cpu, 0) in current thread")
        mx.eval(tree_leaves(head))
        num = getattr(getattr(target, "params", None), "numerics", None)
        if num is not None and num.batch_invariant and not head.numerics.batch_invariant:
            # a batch-invariant target's head is too: its rows draft the same alone or
            # batched with others (`propose_rows`), as the MTP modules (loaded with the
            # target's numerics) do
            head = attrs.evolve(head, numerics=attrs.evolve(head.numerics, batch_invariant=True, tile=num.tile,
                                                            kv_block=num.kv_block))
        self.head = head
        self.target = target
        self.table = head.embed if head.embed is not None else target.params.embed
        self.draft_ids = eagle3.draft_target_ids(head)  # (a sampled draft's target id)
        mx.eval(self.draft_ids)
        self.capture = Capture(layers)
        # the target's family must capture: a refusal (CaptureError naming its model type)
        # now, not at its first request; building the graph computes nothing
        forward(target.params, target.new_cache(1, 8), mx.zeros((1, 1), mx.int32), mx.ones((1,), mx.int32),
                None, self.capture)

    @classmethod
    def load(cls, path: str | Path, target: Any, *, dtype: str | None = None,
             revision: str | None = None, bits: int | None = None) -> "Eagle3Drafter":
        """The drafter of the head at `path` (a folder or a Hugging Face repo id) for `target`.
        bits (8 or 4): the head's matrices quantized at load to run on the target's native
        kernels (`eagle3.quantized_head`; a step of the default model's head: 1.75 -> 0.75
        ms); a target without native kernels keeps them as stored (MLX's CPU quantized
        matmul would be slower). The drafts change a little, the output never does."""
        from fx_engine.loading.drafter import load_eagle3_head

        head = load_eagle3_head(path, target, dtype=dtype, revision=revision)
        if bits is not None:
            if bits not in (4, 8):
                raise ValueError(f"bits must be 4 or 8 (or None: as stored), got {bits!r}")
            num = getattr(getattr(target, "params", None), "numerics", None)
            if num is not None and num.native:
                from fx_engine.runtime import native as fx_native

                head = eagle3.quantized_head(head, bits, lambda gs, b: fx_native.supports(gs, b), num)
        return cls(head, target)

    # ---------------------------------------------------------------- what its rows run
    def step(self, hidden: mx.array, ids: mx.array, cache: KVCache, n_valid: mx.array,
             span: int) -> tuple[mx.array, mx.array, mx.array, KVCache]:
        """One head step over pairs (hidden [B, T, 3 H_t] or a chained [B, 1, H], ids [B, T]):
        the greedy draft after the last valid pair (in the target's vocabulary), the
        draft-vocabulary logits it is the argmax of, its hidden state, the cache
        (`eagle3.head_step_compiled`, keyed on T and span)."""
        return eagle3.head_step_compiled(self.head, self.table, hidden, ids, cache, n_valid, span=span)

    def new_cache(self, capacity: int) -> KVCache:
        return init_cache(eagle3.cache_specs(self.head.config), 1, capacity, getattr(mx, self.head.dtype))

    def target_probs(self, q: mx.array) -> mx.array:
        """A sampled row's q [n, Vd] over the target's vocabulary [n, V] (zero elsewhere)."""
        return eagle3.draft_probs_to_target(self.head, q)


# (the row: one request's head, fed the target's captured states; engine/captured_drafter.py)
Eagle3Row = CapturedRow
