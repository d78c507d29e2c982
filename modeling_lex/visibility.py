"""Who sees whom: the window rule of each attention mode, the one attention-sink rule, and the chunk index map.

Everything here is a function of stream indices (token i of a row has stream index i, see stream.py) and of the
stream index where each query's document starts, so the same rules serve the long forward, every cache, every
decoding step and the attention maps. The masks (masking.py) and the stream's bookkeeping (stream.py) ask these
functions; neither writes a rule of its own.

- The window: full attention sees every earlier key of the document; sliding, the last w keys; blockwise (BCA),
  the query's block and the one before it, blocks of b = w/2 (`LexConfig.bca_block_length`) counted from the
  document's first token.
- Attention sinks (`attention_sinks` = S, blockwise and sliding): the first S tokens of each document stay
  visible to every later query of that document (StreamingLLM). A query sees a sink *as a sink* only where its
  window does not already show that key, so no key counts twice. Where it sees them from is the config's
  `attention_sink_positions`: "true", at their own positions; "cache", StreamingLLM's positions within the cache
  (`sink_frame`).
- The block memory (`attention_memory_blocks` = k, blocks of b = `attention_memory_block_size`): the blocks a
  forward reads of the keys its window has evicted (memory.py) sit in the same frame, in the k * b places just
  before the window; the sinks move before them (`memory_frame`, `sink_frame`).
- The chunk index map: the long forward cuts its queries into chunks of one block and pairs each chunk with the
  keys it can reach.
"""

import torch


def sink_count(config) -> int:
    """S: how many first tokens of each document every later query sees (none in full mode: it sees everything)."""
    return 0 if config.attention_mode == "full" else config.attention_sinks


def window_visible(config, q_index: torch.Tensor, k_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Whether the query at stream index q_index sees the key at k_index through its window (shapes broadcast).

    Causal, inside the query's document (which starts at `start`), and inside the mode's window: sliding, the
    last w keys; blockwise, the query's block and the one before it, blocks counted from `start`.
    """
    allowed = (k_index <= q_index) & (k_index >= start)
    if config.attention_mode == "sliding":
        allowed = allowed & (k_index > q_index - config.attention_window)  # (no (T, K) difference of indices)
    elif config.attention_mode == "blockwise":
        block = config.bca_block_length
        q_block = torch.div(q_index - start, block, rounding_mode="floor")
        k_block = torch.div(k_index - start, block, rounding_mode="floor")
        allowed = allowed & (k_block >= q_block - 1)
    return allowed


def seen_as_sink(config, q_index: torch.Tensor, k_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The sink rule: whether the query sees the key as an attention sink, i.e. the key is one of the first S
    tokens of the query's document, before the query, and not shown by the query's window."""
    first = (k_index >= start) & (k_index < start + sink_count(config)) & (k_index <= q_index)
    return first & ~window_visible(config, q_index, k_index, start)


def window_first(config, q_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Stream index of the first key the query's window shows (shapes broadcast)."""
    if config.attention_mode == "sliding":
        first = q_index - config.attention_window + 1
    elif config.attention_mode == "blockwise":
        block = config.bca_block_length
        first = start + (torch.div(q_index - start, block, rounding_mode="floor") - 1) * block
    else:
        first = start
    return torch.maximum(first, start)


def memory_tokens(config) -> int:
    """k * b: the places of the block memory's slots in the frame (0 without a memory)."""
    return 0 if config.attention_mode == "full" else config.attention_memory_blocks * config.attention_memory_block_size


def memory_piece(config) -> int:
    """p = max(b, w / 16) (b: `attention_memory_block_size`): the length of the pieces a prompt's last w tokens are
    read in, and of the forwards every query of which chooses the blocks it reads (a longer forward chooses with b
    of its queries; memory.py)."""
    return max(config.attention_memory_block_size, config.attention_window // 16)


def memory_frame(config, q_index: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a query sees the block memory from: in a frame where its window starts at 0, the memory's k * b places
    just before it (-k * b ... -1) and the query at its offset in its window. Returns the query's place (the shape
    of q_index and start broadcast) and the memory's places (k * b,)."""
    return q_index - window_first(config, q_index, start), memory_places(memory_tokens(config), q_index.device)


def memory_places(count: int, device: torch.device) -> torch.Tensor:
    """The block memory's `count` = k * b places in a query's frame: -k * b ... -1, just before its window."""
    return torch.arange(-count, 0, device=device)


def sink_frame(config, q_index: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sink position rule: where a query sees its sinks from (`attention_sink_positions`).

    "true": at their own positions (None: no frame of their own). "cache" (StreamingLLM): in a frame where the
    query's window starts at 0, sink j sits at j - S, just before it (before the block memory's k * b places, if
    any: at j - S - k * b), and the query at its offset in its window: returns the query's place (the shape of
    q_index and start broadcast) and the sinks' places (S,), so sink j is seen at distance offset + S - j (+ k * b),
    never more than S + k * b + w.
    """
    if config.attention_sink_positions == "true":
        return None
    sinks = sink_count(config)
    query, memory = memory_frame(config, q_index, start)
    return query, torch.arange(-sinks, 0, device=q_index.device) - memory.shape[0]


def sink_indices(start: torch.Tensor, sinks: int) -> torch.Tensor:
    """Stream indices of the S sinks of documents starting at `start`: `start.shape + (S,)`."""
    return start[..., None] + torch.arange(sinks, device=start.device)


def locate_in_window(index: torch.Tensor, key_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where stream indices `index` lie among the window part's keys (consecutive stream indices `key_index`):
    their columns (clamped into range) and whether they lie there at all, or before it."""
    column = index - key_index[0]
    return column.clamp(0, key_index.shape[0] - 1), column >= 0


def chunk_map(total: int, n_keys: int, block: int, left: int, device: torch.device):
    """The index map of a chunked tile: queries in chunks of one block, each against the `left + block` keys
    before and beside it.

    Of the window part's `n_keys` keys, the last `total` are the queries' own. Returns the query slots (chunks,
    block) (the tail of the last chunk repeats the last query), the key slots (chunks, left + block) clamped into
    range, and whether each key slot exists: slot s of chunk j is key n_keys - total - left + j*block + s.
    """
    n_chunks = -(-total // block)
    first = n_keys - total - left
    chunk_starts = first + torch.arange(n_chunks, device=device)[:, None] * block
    key_slots = chunk_starts + torch.arange(left + block, device=device)
    exists = (key_slots >= 0) & (key_slots < n_keys)
    query_slots = torch.arange(n_chunks * block, device=device).clamp(max=total - 1).view(n_chunks, block)
    return query_slots, key_slots.clamp(0, n_keys - 1), exists


__all__ = [
    "chunk_map", "locate_in_window", "memory_frame", "memory_places", "memory_tokens", "seen_as_sink", "sink_count",
    "sink_frame",
    "sink_indices", "window_first", "window_visible",
]
