"""The block memory past the window (`attention_memory_blocks` = k > 0): one layer's evicted keys and values, which
of their blocks a forward reads, and the evidence a forward gathers from layer to layer.

The rule is specified in docs/concepts/retrieval-rule.md (the store, which queries choose, the score, the evidence
across layers and forwards, choosing k blocks, where they sit, how an input is split into forwards); this module is
that specification in code, and tests/reference.py a float64 naive one. Why the rule is what it is lives in
benchmarks/journal/, not here.

In short: keys and values that leave a LexCache's window part are appended here in stream order, without positions
(RoPE keys rotated back to position 0: `AttentionPlan.memory_unrotate`), in blocks of b =
`attention_memory_block_size`, each complete block with `ReadingPolicy.representatives` representative keys (its
keys of largest norm). Each layer with a memory (every layer but Gemma's local ones) scores the candidate blocks
(`MemoryRead.candidates`) for the forward's choosing queries (`choosing_queries`), adds the score to the forward's
evidence (the layers below it, and what the last forward that chose found) and reads the blocks `choose_blocks`
picks by it, in the slots `placed` orders. What the forward may read and its evidence are shared by its layers
through the cache's `OpenStep`, opened when the forward's step opens; attention asks the layer's memory for its
blocks (`recall`), and a choice, like everything a forward reads, is held only when the forward commits (`commit`;
`discard` if it raised).

The store grows with the document by its keys' and values' bytes (the model's dtype) plus the representatives (a
quarter of each block's keys); attention per token stays O(S + k*b + w), and choosing reads the representatives of
every candidate block: once per forward of more than one token, and while decoding once per completed block. With
`directory` set, the keys and values live in memory-mapped files there (unlinked at once: their space is the
process's until it drops them; the kernel writes their pages out and reads them back, so the store may outgrow
RAM); the representatives, which every choice reads whole, stay in RAM.
"""

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from .kernels import apply_rotary
from .reading import MemoryRead, ReadingPolicy


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


def block_representatives(keys: torch.Tensor, block: int, count: int) -> torch.Tensor:
    """(B, H, n*block, d) keys -> (B, H, count, n, d): each block's `count` keys of largest norm, the i-th of every
    block in one row i (so that a block's best logit is the elementwise max of `count` rows of logits,
    `block_scores`)."""
    blocks = keys.unflatten(2, (-1, block))
    top = blocks.norm(dim=-1).topk(count, dim=-1).indices
    return blocks.gather(3, top[..., None].expand(*top.shape, keys.shape[-1])).transpose(2, 3)


SCORED_LOGITS_AT_ONCE = 1 << 21  # logits of one slice of blocks (8 MB in float32): (B, Hkv, r, Hq / Hkv * m, n)


def block_scores(query: torch.Tensor, representatives: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """queries (B, Hq, m, d), scaled as attention scales them, against representatives (B, Hkv, r, n, d) of blocks
    of which `candidates` (B, n) may be read -> (B, n), 0 where no candidate: over query heads and queries, the
    sum of the squared share of each one's softmax over the candidates that the block's best representative
    takes. The representatives are scored in slices of blocks whose logits are at most `SCORED_LOGITS_AT_ONCE`, so
    that the temporaries stay of one size however long the document, while a decoding step's one query scores every
    block at once; a block's best logit is the elementwise max of its r rows of logits."""
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
    stream order: by one top-k and linear passes, no sort."""
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


def choose_blocks(scores: torch.Tensor, slots: int, centres: int | None = None) -> torch.Tensor:
    """Which blocks a row reads (one layer, its heads together): scores (..., n), -inf where a block is no candidate ->
    block indices (..., slots) in the order the slots read them (`placed`), -1 (first) where fewer candidates than
    slots.

    The best `centres` blocks (None: floor(slots / `ReadingPolicy.centre_divisor`)), each with the candidates beside
    it, so that a passage cut by a block boundary is read whole and in its context; the slots left, the best of the
    rest (of equal scores, always the later block)."""
    n = scores.shape[-1]
    if centres is None:
        centres = slots // ReadingPolicy.centre_divisor
    centres = _best(scores, min(centres, n))
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
    the window); of equal scores the earlier run first: the slots nearest the window are the ones a model reads
    best, so the best run sits there."""
    starts = torch.ones_like(chosen, dtype=torch.bool)
    starts[..., 1:] = (chosen[..., 1:] != chosen[..., :-1] + 1) | (chosen[..., :-1] < 0)
    run = starts.long().cumsum(-1) - 1  # each slot's run
    value = torch.where(chosen >= 0, scores.gather(-1, chosen.clamp(min=0)), -torch.inf)
    best = torch.full_like(value, -torch.inf).scatter_reduce(-1, run, value, "amax")
    return chosen.gather(-1, best.gather(-1, run).sort(dim=-1, stable=True).indices)


def choosing_queries(query: torch.Tensor, piece: int, block: int) -> torch.Tensor:
    """The queries (B, Hq, T, d) -> (B, Hq, m, d) that choose a forward's blocks: all of a forward of at most
    `piece` tokens (p, `ReadingPolicy.piece`), else `block` (b) spread over it (every ceil(T / b)-th, ending at
    its last)."""
    length = query.shape[2]
    chooser = length if length <= piece else block
    step = -(-length // chooser)
    return query[:, :, (length - 1) % step :: step]


@dataclass(frozen=True)
class Choice:
    """The blocks one layer's memory read at a choice, as it read them: the same until the next choice."""

    blocks: torch.Tensor  # (B, k) block indices in the order the slots read them, -1 where a slot is empty
    among: int  # complete blocks there were then
    keys: torch.Tensor  # (B, H, k * b, d), in the memory's frame (RoPE) or raw
    values: torch.Tensor

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> "Choice":
        """The same choice with `function` applied to each tensor, row by row (beams, batch selection)."""
        return Choice(function(self.blocks), self.among, function(self.keys), function(self.values))


class Evicted(NamedTuple):
    """The keys and values (B, H, n, d) one layer's window part dropped in a forward, and what undoes their rotation
    (`AttentionPlan.memory_unrotate`; None: held raw)."""

    keys: torch.Tensor
    values: torch.Tensor
    unrotate: torch.Tensor | None


class OpenStep:
    """The forward open now, shared by every layer's memory of one cache: what it may read of the block memory
    (`read`; None between forwards and in a forward that reads nothing of it) and the evidence its layers gather,
    one after the other: the block scores (`MemoryRead.candidates`' blocks) start from what the last forward that
    chose found (`carried`, one layer's worth), and each layer that scores adds its own (`add`), so a layer chooses
    by its scores and those of the layers below it. The cache opens it when a forward's step opens and closes it
    when the step ends, for every layer's memory at once."""

    read: MemoryRead | None = None
    carried: torch.Tensor  # (B, blocks): what the last forward that chose found (set by `open`)
    total: torch.Tensor  # (B, blocks): the evidence so far
    layers_scored: int

    def open(self, read: MemoryRead | None, found: torch.Tensor | None) -> None:
        """A forward that reads the memory (`read`; None: it reads nothing) starts its evidence from what the last
        forward that chose `found` ((B, blocks then), one layer's worth; blocks completed since then start at 0)."""
        self.read = read
        if read is None:
            return
        self.carried = torch.zeros(read.candidates.shape, device=read.candidates.device)
        if found is not None:
            self.carried[:, : found.shape[1]] = found
        self.total, self.layers_scored = self.carried.clone(), 0

    def add(self, scores: torch.Tensor) -> torch.Tensor:
        """A layer's scores joined to the evidence; the evidence it chooses by."""
        self.total += scores
        self.layers_scored += 1
        return self.total

    def found(self) -> torch.Tensor | None:
        """What this forward found, one layer's worth (what the next forward starts from); None where no layer
        scored (each read the last choice's blocks)."""
        return (self.total - self.carried) / self.layers_scored if self.layers_scored else None

    def close(self, memories: list["BlockMemory | None"], evicted: list[Evicted | None] | None
              ) -> torch.Tensor | None:
        """The step ended. With what each layer `evicted` (the forward completed), each layer's memory holds its
        evicted keys and values (rotated back to position 0, all layers in one product) and the choice it read;
        with None (the forward raised), every memory drops what it read. Returns what a forward that chose found
        (`found`), else None."""
        read, self.read = self.read, None
        if evicted is None:
            for memory in memories:
                if memory is not None:
                    memory.discard()
            return None
        held = [(memory, out) for memory, out in zip(memories, evicted) if memory is not None and out is not None]
        turned = [out for _, out in held if out.unrotate is not None]
        if turned:
            keys = apply_rotary(torch.stack([out.keys for out in turned]), turned[0].unrotate).unbind(0)
            unrotated = dict(zip(map(id, turned), keys))
            held = [(memory, out._replace(keys=unrotated.get(id(out), out.keys))) for memory, out in held]
        for memory, out in held:
            memory.commit((out.keys, out.values))
        return None if read is None else self.found()


class BlockMemory:
    """One layer's evicted keys and values (raw, stream order), their blocks' representatives and the last choice.
    What it holds changes at `commit` only."""

    def __init__(self, policy: ReadingPolicy, scaling: float, open_step: OpenStep, directory: str | None = None
                 ) -> None:
        """The policy's blocks and constants (`memory_block_size`, `piece`, `representatives`, `centre_blocks`; the
        slots a forward reads come with it, `MemoryRead`); queries scaled by `scaling` as attention scales them;
        `open_step`: the forward open now, shared with the cache's other layers."""
        self.policy, self.scaling, self.open_step, self.directory = policy, scaling, open_step, directory
        self.block = policy.memory_block_size
        self.keys = self.values = self.representatives = None
        self.length = 0  # tokens held (E)
        self.reserved = 0  # tokens the store makes room for at its next growth (`reserve`)
        self.chosen: Choice | None = None  # what the last forward that chose read
        self.pending: Choice | None = None  # what the forward open now read, held from `commit` on

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
        """Make room for `tokens` held tokens at the next growth, not by doublings, so a prompt read in many forwards
        copies its store once. Pages not yet written take no memory."""
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
            shape = (*keys.shape[:2], self.policy.representatives, 1, keys.shape[3])
            if self.representatives is None or self.representatives.shape[3] < self.blocks:
                self.representatives = _grown(self.representatives, keys.new_empty(shape), complete,
                                              max(self.blocks, self.reserved // self.block), 3, None,
                                              FIRST_TOKENS // self.block)
            span = self.keys[:, :, complete * self.block : self.blocks * self.block]
            self.representatives[:, :, :, complete : self.blocks] = block_representatives(
                span, self.block, self.policy.representatives)

    def recall(self, query: torch.Tensor, frame: torch.Tensor | None = None, group: ProcessGroup | None = None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The blocks this layer's queries (B, Hq, T, d, before positions) read in the forward open now (`choose`),
        keys and values (B, H, k*block, d); None where the forward reads nothing of the memory. The choice is
        staged: held from `commit` on, dropped by `discard`. `group`: the tensor-parallel group whose ranks hold
        the layer's other heads (see `choose`)."""
        step = self.open_step
        if step.read is None:
            return None
        self.pending = self.choose(query, step.read, step, frame, group)
        return self.pending.keys, self.pending.values

    def choose(self, query: torch.Tensor, readable: MemoryRead, evidence: OpenStep,
               frame: torch.Tensor | None = None, group: ProcessGroup | None = None) -> Choice:
        """The n slots' keys and values (B, H, n*block, d) that `readable` says a forward reads (n <= k: the slots
        some row fills), for a layer's queries (B, Hq, T, d) before positions: the keys rotated by `frame` to their
        places in the memory's frame (RoPE, `AttentionPlan.memory_frame`), else raw; a row's empty slots (first) hold
        block 0, masked by the plan. Its `choosing_queries` score the blocks; this
        layer's scores join the forward's `evidence`, which chooses. A forward of one token among the same complete
        blocks as the last choice (a decoding step before the next block completes) reads the blocks chosen then,
        as they were read then (`chosen`): gathered and rotated once per choice, so a decoding step neither
        gathers, rotates nor copies them. Returns the choice read; a new one is held from `commit` on. Nothing held
        changes, and the tensors returned are read, never written.

        Under tensor parallel (`group`) this rank holds some of the layer's heads, and a block's score is a sum over
        all of them: the scores (B, blocks) are summed over the group's ranks before choosing (one all_reduce a
        layer and choice), so every rank chooses what one process would."""
        blocks = readable.candidates.shape[1]
        chosen = self.chosen
        if query.shape[2] > 1 or chosen is None or blocks != chosen.among:
            choosing = choosing_queries(query.detach(), self.policy.piece, self.block) * self.scaling
            scores = block_scores(choosing, self.representatives[:, :, :, :blocks], readable.candidates)
            if group is not None:
                dist.all_reduce(scores, group=group)
            total = evidence.add(scores)
            slots = readable.token_valid.shape[1] // self.block
            picked = choose_blocks(torch.where(readable.candidates, total, -torch.inf), slots,
                                   self.policy.centre_blocks)
            keys = self._blocks(self.keys, picked)
            chosen = Choice(picked, blocks, keys if frame is None else apply_rotary(keys, frame),
                            self._blocks(self.values, picked))
        return chosen

    def commit(self, evicted: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The forward completed: the choice it read, if any, is the one later steps read, and the keys and values
        it `evicted` from the window part (B, H, n, d), if any, are held."""
        if self.pending is not None:
            self.chosen = self.pending
        self.pending = None
        if evicted is not None:
            self.append(*evicted)

    def discard(self) -> None:
        """The forward raised: what it read is dropped; the memory holds what it held."""
        self.pending = None

    def _blocks(self, held: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """held (B, H, capacity, d) at blocks chosen (B, k), -1 read as block 0 -> (B, H, k*block, d): whole blocks
        as rows of one contiguous view (capacity is a multiple of the block), one `index_select` of whole rows."""
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
            self.chosen = self.chosen.map(function)


__all__ = [
    "BlockMemory", "Choice", "Evicted", "OpenStep", "block_representatives", "block_scores", "choose_blocks",
    "choosing_queries", "placed",
]
