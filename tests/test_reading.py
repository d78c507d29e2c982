"""The reading policy and the attention plan (modeling_lex/reading.py): every query of a chunked tile sees exactly the
keys the policy's window and sink rules allow, each once; the chunk index map; the policy made from a config, its
local layers' policy and its refusals."""

import pytest
import torch

from modeling_lex.positions import position_method
from modeling_lex.reading import ReadingPolicy, _chunked_tile, chunk_map
from modeling_lex.stream import Stream
from tests.helpers import tiny_config


def seen_at_all(policy, q_index: torch.Tensor, k_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Whether the query sees the key at all: through its window, or as one of its document's sinks."""
    return policy.visible(q_index, k_index, start) | policy.seen_as_sink(q_index, k_index, start)


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_each_chunk_holds_exactly_the_keys_visible_allows(mode, sinks):
    """Packed documents and left padding, a cache holding a past, a forward of several chunks: for every query the
    keys its chunk shows unmasked are exactly those `seen_at_all` allows, each once (sink columns included)."""
    config = tiny_config(attention_mode=mode, attention_sinks=sinks)
    policy = ReadingPolicy.of(config)
    history = Stream(policy)
    history.commit(history.begin(None, torch.ones(2, 21, dtype=torch.bool), False))  # a cached past of 21 tokens
    valid = torch.ones(2, 53, dtype=torch.bool)
    valid[1, :9] = False  # row 1: padding
    positions = torch.cat([torch.arange(30), torch.arange(23)])[None].repeat(2, 1)  # a document restarts at 30
    record = history.begin(positions, valid, False)
    ctx = record.context
    tile = _chunked_tile(policy, position_method(config), ctx, torch.float32, ctx.aligned)
    allowed = tile.bias[:, 0] == 0  # (B*chunks, b, columns)
    chunks = tile.query_slots.shape[0]
    columns = tile.key_columns.expand(2, -1, -1) if tile.key_columns.dim() == 2 else tile.key_columns
    index_of_column = torch.cat([ctx.sink_index, ctx.key_index.expand(2, -1)], dim=1)  # keys the cache returns
    real = torch.cat([torch.ones(2, 21, dtype=torch.bool), valid], dim=1)  # every token of the stream
    for row in range(2):
        for chunk in range(chunks):
            for slot, query in enumerate(tile.query_slots[chunk].tolist()):
                if slot > 0 and query == tile.query_slots[chunk, slot - 1]:
                    continue  # the padded tail repeats the last query
                q_index = int(ctx.query_index[query])
                mask = allowed[row * chunks + chunk, slot]
                shown = [int(index_of_column[row, c]) for c, ok in zip(columns[row, chunk], mask) if ok]
                start = ctx.document_start[row, query]
                expected = [k for k in range(q_index + 1)
                            if real[row, k] and seen_at_all(policy, torch.tensor(q_index), torch.tensor(k), start)]
                if not valid[row, query]:
                    expected = [q_index]  # a padding query sees only itself
                assert sorted(shown) == expected, (row, q_index)


def test_chunk_map_slots():
    query_slots, key_slots, exists = chunk_map(total=10, n_keys=15, block=4, left=4, device=torch.device("cpu"))
    assert query_slots.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 9, 9]]
    assert key_slots[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and exists[0].all()  # 5 cached keys, 4 of them reached
    assert key_slots[2, -3:].tolist() == [14, 14, 14] and exists[2].tolist() == [True] * 6 + [False] * 2


def test_a_policy_is_the_config_s_reading_fields_and_refuses_bad_values_by_name():
    """`ReadingPolicy.of(config)` reads the config's reading fields as they are now (a change at run time reads so,
    no copy of the config); full attention has no sinks and no memory; a local layer's policy slides over its own
    window without sinks or a memory; a bad value is refused naming the field and what is allowed."""
    config = tiny_config(attention_mode="sliding", attention_sinks=4, attention_sink_positions="cache",
                         attention_memory_blocks=3, attention_memory_block_size=5)
    policy = ReadingPolicy.of(config)
    assert (policy.mode, policy.window, policy.sinks, policy.memory_tokens, policy.piece) == ("sliding", 16, 4, 15, 5)
    assert (policy.representatives, policy.centre_blocks, policy.block) == (1, 1, 8)
    config.attention_window = 32
    assert ReadingPolicy.of(config).window == 32 and ReadingPolicy.of(config).piece == 5
    full = ReadingPolicy("full", 16, 4, "cache", memory_blocks=3)
    assert (full.sinks, full.memory_tokens) == (0, 0)
    local = ReadingPolicy("blockwise", 16, 4, "cache", memory_blocks=3, local_window=8).local()
    assert (local.mode, local.window, local.sinks, local.memory_tokens) == ("sliding", 8, 0, 0)
    with pytest.raises(ValueError, match="ReadingPolicy.mode='windowed' .allowed: blockwise, sliding, full."):
        ReadingPolicy("windowed", 16, 0, "cache")
    with pytest.raises(ValueError, match="ReadingPolicy.window=15 must be an even integer >= 4"):
        ReadingPolicy("sliding", 15, 0, "cache")
    with pytest.raises(ValueError, match="ReadingPolicy.sink_positions='near' .allowed: true, cache."):
        ReadingPolicy("sliding", 16, 0, "near")


@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_a_cache_keeps_what_the_policy_says_a_later_query_sees(mode):
    """`keep_from`, the cache's keep rule, against the window rule: after every forward of a stream read in uneven
    pieces, the first key the cache holds is the first any later query can see (the window rule's first key of the
    next query, which is the least over later queries), and with local layers the local window's too."""
    for local_window in (None, 6):
        policy = ReadingPolicy(mode, 16, 0, "cache", local_window=local_window)
        stream, seen = Stream(policy), 0
        for count in (5, 16, 3, 9, 1, 1, 17, 8):
            stream.commit(stream.begin(None, torch.ones(1, count, dtype=torch.bool), False))
            seen += count
            first = int(policy.window_first(torch.tensor(seen), torch.tensor(0)))
            if local_window is not None:
                first = min(first, seen - local_window + 1)
            assert int(stream.index[0]) == max(first, 0), (count, seen)
