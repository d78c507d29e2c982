"""The block memory past the window (`attention_memory_blocks` = k > 0): one layer's evicted keys and values, and
which of their blocks a forward reads.

Keys and values that leave a LexCache's window part are appended here, in stream order, without positions
(RoPE keys are rotated back to position 0 first: the record's `MemoryTerms.unrotate`), so the store holds the
stream's tokens 0 ... E - 1 (E: tokens evicted so far) in blocks of b = `attention_memory_block_size`; the last,
incomplete block waits for its last token. Each complete block has `representative_count(b)` = b / 4
representative keys per key/value head: the block's keys of largest norm (chosen by measurement on SmolLM2-135M,
benchmarks/memory_retrieval_probe.py: as good as the block's mean at finding a passkey's block, and better with
natural filler; and benchmarks/RESULTS.md: with 4 of a block of 64, no key hidden in natural text at 40% of 4,096
tokens was recalled, with 8 two of three, with 16 three of three).

The retrieval rule (one forward, one layer): every query q of a forward of T <= p = max(b, w / 16) tokens
(`memory_piece`: a piece of a prompt's end), else b of them (every ceil(T / b)-th, ending at its last: the whole
forward reads the blocks, so they choose together; on SmolLM2-135M with blocks of 16, 16 queries of each piece of 64
read two passages of the Bible seen 32k tokens earlier at 1.12x and 1.29x full attention's NLL, all 64 at 1.08x and
1.02x; 64 queries of every forward of w as well, 0.69 of the window's prefill speed at 32k tokens against 0.75,
benchmarks/RESULTS.md); a decoding step's one query, when a block has completed since the layer last chose, else the
step reads the blocks chosen then; per head, before positions, times the attention's scale) score every candidate
block j (`MemoryRead.candidates`: complete, every token real, after the sinks of the last query's document) as the
sum over those queries and query heads h of the square of the share that their softmax over the candidates gives j,
each block's logit being max over its representatives r of q_h . r (each query head against its key/value head): the
attention each head would pay the block, so that a head which looks for one block weighs as much as a head whose
logits are large everywhere, and squared, so that one head that finds one block outweighs many that spread over the
same few (the blocks after the sinks, which every query of some layers attends to). A layer ranks the blocks by its
scores plus those of the layers below it in the same forward (`MemoryRead.evidence`): what a few heads of a
few layers find (the heads that copy a passage seen before) carries to the layers above; and the forward's evidence
starts from what the last forward that chose found (its layers' scores over their number, one layer's worth:
`MemoryRead.carried`), so that a question read in pieces (`LexForCausalLM.reading_spans`) hands what its
words point to on to the token that answers (on SmolLM2-135M, benchmarks/RESULTS.md: of a key hidden in natural
text at 90% of 32k tokens, the question read in pieces of 64 without this read the block in 21 of the last token's
30 layers, and the key was missed; with it in 30 of 30, recalled; carried whole, not over the layers, what the
filler had found outweighed the question). The best floor(k / 3)
blocks are read each with the blocks beside it, so that a passage cut by a block boundary is read whole; the slots
left take the best of the rest (of equal scores, always the later block).
These min(k, candidates) blocks are read in the last of the k slots (the first are empty, masked), each run of
consecutive blocks in stream order and the runs by their best score, the best next to the window (`placed`:
in stream order, a key that full attention as published recalls with the document's last 1,000 tokens after it
and misses with its last 2,000 was read about 1,650 tokens back, and missed).
Slot s's token t sits at frame position -k*b + s*b + t: just before the query's window and after its sinks
(visibility.memory_frame), the same for every layer. Tried on SmolLM2-135M (benchmarks/RESULTS.md): the best k
blocks alone never read a passkey cut at token 2,048 of 4,096 whole; with a neighbour or both it was recalled; each
key/value head choosing its own blocks read the key's block in more heads but lost a digit of a key l back; summing
the raw logits over heads (not their softmax shares) recalled no key hidden in natural text, the shares 3 of 3 at
10% depth. A passage read again 8,192 tokens later (benchmarks/memory_reread.py): each layer choosing by the last
query and its own scores read the passage's first reading in 43 of 90 layer reads (NLL 1.78, full attention 0.73;
the passage's blocks forced into every layer, 0.76); by the last 16 queries, 1.47; by the scores summed up the
layers, 1.15; by both with the last 64 queries (one block's worth), 0.95 (the passage's first block, which the end
of the passage does not look for, missing in 20 of 30 layers), and 128, 0.94; by both with 64 queries spread over
the forward, 0.73; but a passage at 5,120 not (1.68 against 0.69): blocks that every query attends to won the sum;
with each share squared, 0.74 and 0.71.

The store grows with the document by its keys' and values' bytes (the model's dtype) plus the representatives (a
quarter of each block's keys); attention per token stays O(S + k*b + w), and choosing the blocks reads the
representatives of every candidate block (E / 4 keys per key/value head): once per forward of more than one
token, and while decoding once per completed block (every b steps in sliding mode: choosing at every step made
decoding the memory's main cost, benchmarks/RESULTS.md). With `directory` set, the keys and values live in
memory-mapped files there (unlinked at once: their space is the process's until it drops them, and the files
vanish with it; the kernel writes their pages out and reads them back, so the store may outgrow RAM); the
representatives, a ninth of the store's bytes, which every choice reads whole, stay in RAM.
"""

import os
import tempfile
from collections.abc import Callable

import torch
from torch import nn

from .record import MemoryRead


def representative_count(block: int) -> int:
    """Representative keys per block of `block` tokens and key/value head: a quarter of them, at least one."""
    return max(1, block // 4)


def _allocate(like: torch.Tensor, shape: tuple[int, ...], directory: str | None) -> torch.Tensor:
    """An uninitialised tensor of `shape` like `like`: in RAM, or memory-mapped from a file in `directory`."""
    if directory is None:
        return like.new_empty(shape)
    count = 1
    for size in shape:
        count *= size
    handle, path = tempfile.mkstemp(prefix="lex-memory-", suffix=".bin", dir=directory)
    os.close(handle)
    try:
        storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=count * like.element_size())
    finally:
        os.unlink(path)
    return torch.tensor([], dtype=like.dtype).set_(storage).view(shape)


FIRST_TOKENS = 256  # what a store that grows without a reservation (while decoding) first makes room for


def _grown(buffer: torch.Tensor | None, like: torch.Tensor, used: int, needed: int, dim: int,
           directory: str | None, least: int, unit: int = 1) -> torch.Tensor:
    """`buffer` with room for `needed` entries along `dim` (doubling: amortised O(1) copies per entry), at least
    `least`, a multiple of `unit`."""
    if buffer is not None and buffer.shape[dim] >= needed:
        return buffer
    shape = list(like.shape)
    room = max(needed, 2 * (0 if buffer is None else buffer.shape[dim]), least)
    shape[dim] = -(-room // unit) * unit
    grown = _allocate(like, tuple(shape), directory)
    if used:
        grown.narrow(dim, 0, used).copy_(buffer.narrow(dim, 0, used))
    return grown


def block_representatives(keys: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, n*block, d) keys -> (B, H, r, n, d), r = representative_count(block): each block's keys of largest
    norm, the i-th of every block in one row i (so that a block's best logit is the elementwise max of r rows of
    logits, `block_scores`)."""
    blocks = keys.unflatten(2, (-1, block))
    top = blocks.norm(dim=-1).topk(representative_count(block), dim=-1).indices
    return blocks.gather(3, top[..., None].expand(*top.shape, keys.shape[-1])).transpose(2, 3)


SCORED_LOGITS_AT_ONCE = 1 << 21  # logits of one slice of blocks (8 MB in float32): (B, Hkv, r, Hq / Hkv * m, n)


def block_scores(query: torch.Tensor, representatives: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """queries (B, Hq, m, d), scaled as attention scales them, against representatives (B, Hkv, r, n, d) of blocks
    of which `candidates` (B, n) may be read -> (B, n), 0 where no candidate: over query heads and queries, the
    sum of the squared share of each one's softmax over the candidates that the block's best representative
    takes. The representatives are scored in slices of blocks whose logits are at most `SCORED_LOGITS_AT_ONCE`, so
    that the temporaries stay of one size however long the document (the logits of all of them at once were 75 MB a
    layer at 131k tokens of a prompt's choosing queries, and glibc kept what they left behind), and a decoding
    step's one query scores every block at once (8,127 blocks, 131k tokens: 1.7 ms, in slices of 256 blocks 2.4-3.1
    ms, benchmarks/memory_choice_speed.py); a block's best logit is the elementwise max of its r rows of logits (a
    max over each block's r adjacent logits took 40% more time than the logits themselves)."""
    batch, heads, queries, width = query.shape
    kv_heads, count, blocks = representatives.shape[1], representatives.shape[2], representatives.shape[3]
    grouped = query.reshape(batch, kv_heads, 1, heads // kv_heads * queries, width).float()
    best = grouped.new_empty(batch, kv_heads, grouped.shape[3], blocks)  # each block's best logit
    at_once = max(1, SCORED_LOGITS_AT_ONCE // (batch * kv_heads * count * grouped.shape[3]))
    for start in range(0, blocks, at_once):
        part = representatives[:, :, :, start : start + at_once]
        best[..., start : start + part.shape[3]] = (grouped @ part.float().transpose(-1, -2)).amax(2)
    shares = best.masked_fill_(~candidates[:, None, None, :], -torch.inf).softmax(-1)
    return shares.nan_to_num_(0.0).square_().sum((1, 2))  # a row without candidates: nothing to share


def _best(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices (..., count) of the `count` best scores along the last dimension, of equal scores the later ones, in
    stream order: by one top-k and linear passes (`choose_blocks` among 8,127 blocks, 131k tokens, in 0.7 ms where
    two stable sorts took 1.4-1.7 ms; among 447, 8k tokens, 0.46 ms against 0.16-0.19: benchmarks/RESULTS.md)."""
    n = scores.shape[-1]
    if count >= n:
        return torch.arange(n, device=scores.device).expand(*scores.shape[:-1], n)
    if count == 0:
        return scores.new_zeros((*scores.shape[:-1], 0), dtype=torch.long)
    threshold = scores.topk(count, dim=-1).values[..., -1:]
    above, tied = scores > threshold, scores == threshold
    wanted = count - above.sum(-1, keepdim=True)  # of the tied, the last `wanted`
    tied_before = tied.cumsum(-1)
    kept = above | (tied & (tied_before[..., -1:] - tied_before < wanted))  # (tied after it: fewer than wanted)
    slot = torch.where(kept, kept.cumsum(-1) - 1, count)  # each kept index's place; the rest to a column dropped
    index = torch.arange(n, device=scores.device).expand_as(scores)
    return scores.new_zeros((*scores.shape[:-1], count + 1), dtype=torch.long).scatter_(-1, slot, index)[..., :count]


def choose_blocks(scores: torch.Tensor, slots: int) -> torch.Tensor:
    """Which blocks a row reads (one layer, its heads together): scores (..., n), -inf where a block is no candidate ->
    block indices (..., slots) in the order the slots read them (`placed`), -1 (first) where fewer candidates than
    slots.

    The best floor(slots / 3) blocks, each with the candidates beside it, so that a passage cut by a block boundary
    is read whole and in its context; the slots left, the best of the rest (of equal scores, always the later
    block)."""
    n = scores.shape[-1]
    centres = _best(scores, min(slots // 3, n))
    beside = (centres[..., None] + torch.arange(0, 3, device=scores.device)).flatten(-2)  # in `padded`: -1, 0, +1
    padded = nn.functional.pad(scores, (1, 1), value=-torch.inf)  # (no candidate before the first, after the last)
    near = padded.gather(-1, beside)
    # the centres' candidate neighbours (the centres among them) first; if a centre is no candidate, every candidate
    # is a centre
    first = padded.scatter(-1, beside, torch.where(near > -torch.inf, torch.inf, near))[..., 1:-1]
    chosen = _best(first, min(slots, n))
    chosen = torch.where(scores.gather(-1, chosen) > -torch.inf, chosen, -1).sort(dim=-1).values
    if chosen.shape[-1] < slots:  # fewer blocks than slots: the missing slots come first, empty
        chosen = torch.cat([chosen.new_full((*chosen.shape[:-1], slots - chosen.shape[-1]), -1), chosen], -1)
    return placed(chosen, scores)


def placed(chosen: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Chosen blocks (..., k) in stream order, -1 (empty) first -> the same blocks in the order the slots read them:
    each run of consecutive blocks whole and in stream order, the runs by their best score, the best last (next to
    the window); of equal scores the earlier run first. The slots nearest the window are the ones the model reads
    best: on SmolLM2-135M the passkey 19665, hidden in natural text at 50% of 32k tokens, was read in all 30 of the
    answering token's layers with 34-41 other blocks (544-656 tokens) between it and the window, and missed; with
    the runs by score, 8-19 (128-304 tokens), and recalled (benchmarks/RESULTS.md)."""
    starts = torch.ones_like(chosen, dtype=torch.bool)
    starts[..., 1:] = (chosen[..., 1:] != chosen[..., :-1] + 1) | (chosen[..., :-1] < 0)
    run = starts.long().cumsum(-1) - 1  # each slot's run
    value = torch.where(chosen >= 0, scores.gather(-1, chosen.clamp(min=0)), -torch.inf)
    best = torch.full_like(value, -torch.inf).scatter_reduce(-1, run, value, "amax")
    return chosen.gather(-1, best.gather(-1, run).sort(dim=-1, stable=True).indices)


class BlockMemory:
    """One layer's evicted keys and values (raw, stream order) and their blocks' representatives."""

    def __init__(self, block: int, slots: int, directory: str | None = None) -> None:
        self.block, self.slots, self.directory = block, slots, directory
        self.keys = self.values = self.representatives = None
        self.length = 0  # tokens held (E)
        self.reserved = 0  # tokens the store makes room for at its next growth (`reserve`)
        self.chosen: torch.Tensor | None = None  # (B, k): the blocks the last choosing forward read
        self.chosen_among = 0  # complete blocks there were then
        self.recalled: tuple[torch.Tensor, torch.Tensor] | None = None  # their keys and values, read then
        self.pending: tuple[torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]] | None = None  # this forward's
        # choice, its count of blocks and their keys and values, held once it commits

    @property
    def blocks(self) -> int:
        """Complete blocks."""
        return self.length // self.block

    def nbytes(self) -> int:
        """Bytes of what is held (keys, values and representatives)."""
        if self.keys is None:
            return 0
        per_token = 2 * self.keys[:, :, :1].nbytes
        if self.representatives is None:  # no complete block yet
            return self.length * per_token
        return self.length * per_token + self.blocks * self.representatives[:, :, :, :1].nbytes

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` held tokens at the next growth, not by doublings: a prompt read in many forwards
        copied its store at each doubling (3 s of a 32k prompt's prefill on 2 CPU cores, and the old buffer beside
        the new one while it copied). Pages not yet written take no memory."""
        self.reserved = max(self.reserved, tokens)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold evicted keys and values (B, H, n, d), the next n tokens of the stream; representatives of the
        blocks they complete."""
        count = keys.shape[2]
        if count == 0:
            return
        complete = self.blocks
        stop = self.length + count
        room = max(stop, self.reserved)
        if self.keys is None or self.keys.shape[2] < stop:
            self.keys = _grown(self.keys, keys, self.length, room, 2, self.directory, FIRST_TOKENS, self.block)
            self.values = _grown(self.values, values, self.length, room, 2, self.directory, FIRST_TOKENS, self.block)
        self.keys[:, :, self.length : stop] = keys.detach()
        self.values[:, :, self.length : stop] = values.detach()
        self.length = stop
        if self.blocks > complete:
            shape = (*keys.shape[:2], representative_count(self.block), 1, keys.shape[3])
            if self.representatives is None or self.representatives.shape[3] < self.blocks:
                self.representatives = _grown(self.representatives, keys.new_empty(shape), complete,
                                              max(self.blocks, self.reserved // self.block), 3, None,
                                              FIRST_TOKENS // self.block)
            span = self.keys[:, :, complete * self.block : self.blocks * self.block]
            self.representatives[:, :, :, complete : self.blocks] = block_representatives(span, self.block)

    def read(self, query: torch.Tensor, read: MemoryRead) -> tuple[torch.Tensor, torch.Tensor]:
        """The k slots' keys and values (B, H, k*block, d) for the forward's choosing queries (B, Hq, m, d), raw; the
        empty slots (first) hold block 0, masked by the plan. This layer's scores join the forward's evidence (the
        layers below it), which chooses; a forward of one token among the same complete blocks as the last choice
        (a decoding step before the next block completes) reads the blocks chosen then, as they were read then
        (held with the choice: gathering them again at every step was a tenth of a decoding step at 4k tokens). A
        new choice is held from `commit` on, so a forward that raises leaves none. The tensors returned are read,
        never written."""
        blocks = read.candidates.shape[1]
        if query.shape[2] > 1 or self.chosen is None or blocks != self.chosen_among:
            scores = block_scores(query, self.representatives[:, :, :, :blocks], read.candidates)
            read.evidence += scores
            read.layers_scored += 1
            chosen = choose_blocks(torch.where(read.candidates, read.evidence, -torch.inf), self.slots)
            self.pending = chosen, blocks, (self._blocks(self.keys, chosen), self._blocks(self.values, chosen))
            return self.pending[2]
        self.pending = None
        return self.recalled

    def commit(self) -> None:
        """The forward completed: its choice, if it made one, is the one later steps read."""
        if self.pending is not None:
            (self.chosen, self.chosen_among, self.recalled), self.pending = self.pending, None

    def _blocks(self, held: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """held (B, H, capacity, d) at blocks chosen (B, k), -1 read as block 0 -> (B, H, k*block, d): whole blocks
        as rows of one contiguous view (capacity is a multiple of the block; a gather over every element, or
        indexing by row and block, took 2 to 4 times the attention's time per decoding step at 3k tokens)."""
        batch, heads, capacity, width = held.shape
        per_row = capacity // self.block
        rows = torch.arange(batch * heads, device=chosen.device).view(batch, heads, 1) * per_row
        index = (rows + chosen.clamp(min=0)[:, None, :]).flatten()
        return held.view(-1, self.block * width).index_select(0, index).view(batch, heads, -1, width)

    def apply_to_rows(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Beam reordering and batch selection: every held tensor, row by row (into RAM)."""
        if self.keys is None:
            return
        self.keys, self.values = function(self.keys), function(self.values)  # (capacity kept: see _blocks)
        self.representatives = function(self.representatives[:, :, :, : self.blocks])
        if self.chosen is not None:
            self.chosen, self.recalled = function(self.chosen), tuple(map(function, self.recalled))


__all__ = ["BlockMemory", "block_representatives", "block_scores", "choose_blocks", "placed", "representative_count"]
