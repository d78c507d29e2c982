"""The attention plan's tiles (modeling_lex/masking.py) against the rules of visibility.py: every query of a chunked
tile sees exactly the keys its window and the sink rule allow, each once, and the chunk index map."""

import pytest
import torch

from modeling_lex.masking import _chunked_tile
from modeling_lex.positions import position_method
from modeling_lex.stream import Stream
from modeling_lex.visibility import chunk_map, seen_as_sink, window_visible
from tests.helpers import tiny_config


def seen_at_all(config, q_index: torch.Tensor, k_index: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Whether the query sees the key at all: through its window, or as one of its document's sinks."""
    return window_visible(config, q_index, k_index, start) | seen_as_sink(config, q_index, k_index, start)


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_each_chunk_holds_exactly_the_keys_visible_allows(mode, sinks):
    """Packed documents and left padding, a cache holding a past, a forward of several chunks: for every query the
    keys its chunk shows unmasked are exactly those `seen_at_all` allows, each once (sink columns included)."""
    config = tiny_config(attention_mode=mode, attention_sinks=sinks)
    history = Stream(config)
    history.commit(history.begin(None, torch.ones(2, 21, dtype=torch.bool), False))  # a cached past of 21 tokens
    valid = torch.ones(2, 53, dtype=torch.bool)
    valid[1, :9] = False  # row 1: padding
    positions = torch.cat([torch.arange(30), torch.arange(23)])[None].repeat(2, 1)  # a document restarts at 30
    record = history.begin(positions, valid, False)
    ctx = record.context
    tile = _chunked_tile(config, position_method(config), ctx, torch.float32, record.aligned)
    allowed = tile.mask[:, 0] == 0  # (B*chunks, b, columns)
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
                            if real[row, k] and seen_at_all(config, torch.tensor(q_index), torch.tensor(k), start)]
                if not valid[row, query]:
                    expected = [q_index]  # a padding query sees only itself
                assert sorted(shown) == expected, (row, q_index)


def test_chunk_map_slots():
    query_slots, key_slots, exists = chunk_map(total=10, n_keys=15, block=4, left=4, device=torch.device("cpu"))
    assert query_slots.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 9, 9]]
    assert key_slots[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and exists[0].all()  # 5 cached keys, 4 of them reached
    assert key_slots[2, -3:].tolist() == [14, 14, 14] and exists[2].tolist() == [True] * 6 + [False] * 2
