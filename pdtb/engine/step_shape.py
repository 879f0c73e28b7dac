"""`StepShape`: what a step carries, reduced to what costs time (decode rows and context, prompt
tokens and query-key pairs).

What one engine step carries, reduced to what costs time (`StepShape`): the seam between a
step's scheduled chunks and a model of its seconds (the simulator's cost models, pdtb/sim/cost.py;
a node's own fit of its steps, step_cost.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """What one engine step carries (the scheduler's output, reduced to what costs time)."""

    decode_rows: int = 0  # rows feeding one token each (decoding)
    decode_ctx: int = 0  # context tokens those rows read, summed (KV read by their attention)
    prefill_chunks: int = 0  # prefill (or recompute) chunks
    prefill_tokens: int = 0  # tokens those chunks feed, summed
    prefill_attn: int = 0  # query-key pairs of the chunks' attention: sum of n * (offset + (n + 1) / 2)

    @property
    def tokens(self) -> int:
        """Tokens through the model's dense layers this step."""
        return self.decode_rows + self.prefill_tokens

    @classmethod
    def of(cls, chunks) -> "StepShape":
        """The shape of a scheduled step (a list of `ScheduledChunk`, before the engine advances
        the sequences). A chunk of one token past the prompt is a decode row; any other is prefill."""
        rows = ctx = nch = ntok = attn = 0
        for c in chunks:
            start, n = c.seq.num_computed_tokens, c.num_new_tokens
            if n == 1 and start >= c.seq.num_prompt_tokens:
                rows += 1
                ctx += start + 1
            else:
                nch += 1
                ntok += n
                attn += n * start + n * (n + 1) // 2
        return cls(rows, ctx, nch, ntok, attn)
