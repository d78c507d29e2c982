"""The block memory past the window (`attention_memory_blocks`): evicted keys kept in blocks, the top k of them read
by every forward, placed between the sinks and the window.

Reference: `reference.memory_forward`, the retrieval rule written out naively in float64 (same blocks chosen, same
logits) for every forward split a user meets: token by token, prompt chunks of w, a long forward, generate(). The
real checkpoint's recall of a key hidden at 4·l is tested in test_real_checkpoint.py (slow).
"""

import json
import math
from itertools import accumulate

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError

import modeling_lex  # noqa: F401
from modeling_lex import LexCache, LexForCausalLM, LexStaticCache, memory
from modeling_lex.memory import choose_blocks
from modeling_lex.generation import CACHE_NAME  # the installed transformers' name of the cache
from convert.hf import lex_from_hf
from tests import reference
from lex.cli import main as lex
from tests.helpers import GEMMA3_LAYERS, PAD, W, gemma3_source, greedy, perturbed_model, prompt, tiny_config, \
    word_tokenizer

pytestmark = pytest.mark.oldest  # also run on the oldest transformers we declare

BLOCKS, BLOCK = 3, 5  # one block and its two neighbours; a block of more keys than its 1 representative (b // 4)


def memory_config(**overrides):
    values = dict(attention_memory_blocks=BLOCKS, attention_memory_block_size=BLOCK, attention_sink_positions="cache",
                  num_attention_heads=4, num_key_value_heads=2, norm_type="rmsnorm", mlp_type="gated",
                  hidden_act="silu")
    return tiny_config(**{**values, **overrides})


def distinct_prompt(length: int, seed: int) -> torch.Tensor:
    """One row of `length` different tokens: no two blocks share a first-layer key, so no two blocks tie there (the
    reference's ties are exact; the model's, between RoPE keys rotated back from other positions, are not, and the
    block read with a tied block as its neighbour differs)."""
    return torch.randperm(96, generator=torch.Generator().manual_seed(seed))[None, :length] + 1


def as_read(calls: list[int], block: int = BLOCK, window: int = W) -> list[int]:
    """The forwards the model runs for calls of these token counts with a block memory of blocks of `block`
    (LexModel._read_in_spans): of a call of n > 1 tokens, w at a time up to max(w, n - 1 - w), the rest
    but the last token in pieces of p = max(b, w // 16) with its last p // 4 tokens cut off into a forward of their
    own, then the last token alone."""
    piece = max(block, window // 16)
    tail = max(1, piece // 4)
    forwards = []
    for count in calls:
        if count > 1:
            pieces_from = min(max(window, count - 1 - window), count - 1)
            forwards += [min(window, pieces_from - start) for start in range(0, pieces_from, window)]
            ends = set(accumulate(min(piece, count - 1 - start) for start in range(pieces_from, count - 1, piece)))
            if ends and max(ends) > tail:  # the last `tail` tokens cut off whichever piece holds them
                ends.add(max(ends) - tail)
            ends = sorted(ends)
            forwards += [stop - start for start, stop in zip([0] + ends[:-1], ends)]
        forwards.append(1)
    return forwards


def read(model, ids: torch.Tensor, forwards: list[int], cache: LexCache) -> torch.Tensor:
    """Logits of one row read through `cache` as `forwards` (token counts)."""
    logits, start = [], 0
    with torch.no_grad():
        for count in forwards:
            logits.append(model(ids[:, start : start + count], cache=cache).logits[0])
            start += count
    return torch.cat(logits)


def assert_reference(model, ids: torch.Tensor, forwards: list[int], logits: torch.Tensor) -> None:
    margins = []
    expected = reference.memory_forward(model.state_dict(), model.config, ids[0], forwards, margins)
    assert margins, "no forward chose among more blocks than it reads: the retrieval was never tested"
    torch.testing.assert_close(logits.double(), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("method", ["rope", "xpos", "alibi"])
@pytest.mark.parametrize("mode", ["sliding", "blockwise"])
@pytest.mark.parametrize("sinks", [0, 4])
def test_cached_reading_matches_the_reference(method, mode, sinks, monkeypatch):
    """Prompt chunks (one across a block boundary; each call's last token read alone), then decoding: the blocks
    each layer reads and the logits are the reference's (where a block's neighbours are read in place of a better
    block); the cache's memory holds every evicted token."""
    config = memory_config(position_embedding_type=method, attention_mode=mode, attention_sinks=sinks)
    model = perturbed_model(config)
    ids = distinct_prompt(60, seed=1)
    calls = [W, W - 3, 5, 1, 7] + [1] * 18
    cache = LexCache(config)
    beside = []  # per forward and layer: were blocks read that the best k alone would not read?

    def choose(scores: torch.Tensor, slots: int, centres: int) -> torch.Tensor:
        chosen = choose_blocks(scores, slots, centres)
        best = scores.topk(min(slots, scores.shape[-1])).indices.sort(dim=-1).values
        beside.append(not torch.equal(chosen[:, -best.shape[-1]:], best))
        return chosen

    monkeypatch.setattr(memory, "choose_blocks", choose)
    logits = read(model, ids, calls, cache)
    assert any(beside)
    assert as_read(calls)[:4] == [W - 1, 1, W - 4, 1]
    assert_reference(model, ids, as_read(calls), logits)
    assert cache.layers[0].memory.length == cache.seen - cache.held > BLOCKS * BLOCK


@pytest.mark.parametrize("sinks", [0, 4])
def test_decoding_steps_with_attention_maps_read_the_memory_of_the_reference(sinks):
    """A decoding step that returns its attention maps meets the block memory through the eager backend, the
    recalled keys turned to its query (without maps it meets them where the memory holds them): either way, the
    logits are the reference's."""
    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=sinks)
    model = perturbed_model(config, seed=5)
    model.set_attn_implementation("eager")
    calls = [W, W - 3, 5] + [1] * 14
    ids = distinct_prompt(sum(calls), seed=5)
    logits, start, maps = [], 0, 0
    cache = LexCache(config)
    with torch.no_grad():
        for count in calls:
            out = model(ids[:, start : start + count], cache=cache, output_attentions=count == 1 and start % 2 == 0)
            maps += out.attentions is not None
            logits.append(out.logits[0])
            start += count
    assert maps >= 7
    assert_reference(model, ids, as_read(calls), torch.cat(logits))


def test_blocks_scored_in_slices_match_the_reference(monkeypatch):
    """The representatives scored in slices of at most 8 logits: 2 blocks at a time for a decoding step's one query
    (1 row x 4 query heads x 1 representative a block; the last slice short), one at a time for a prompt's queries.
    The same choices and logits as the reference, which scores every block at once."""
    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=4)
    model = perturbed_model(config, seed=3)
    calls = [W, W - 3, 5] + [1] * 12
    ids = distinct_prompt(sum(calls), seed=3)
    products = []  # the blocks of each slice a forward of one query scored
    monkeypatch.setattr(memory, "SCORED_LOGITS_AT_ONCE", 8)
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: products.append(
        (a.shape[-2], b.shape[-1])) or torch.matmul(a, b))
    logits = read(model, ids, calls, LexCache(config))
    monkeypatch.undo()
    decoding = [blocks for rows, blocks in products if rows == 2]  # (2 query heads of each key/value head)
    assert decoding and max(decoding) == 2 and 1 in decoding  # several slices of 2, some short
    assert {blocks for rows, blocks in products if rows > 2} == {1}
    assert_reference(model, ids, as_read(calls), logits)


@pytest.mark.parametrize("method", ["rope", "xpos"])
def test_a_block_scores_by_its_best_representative(method):
    """Blocks of 8 keys have 2 representatives each (b // 4; the blocks of 5 above have 1): a block's logit is the
    best of theirs, as the reference takes it, through prompt chunks and decoding."""
    config = memory_config(position_embedding_type=method, attention_mode="sliding", attention_sinks=4,
                           attention_memory_block_size=8)
    model = perturbed_model(config, seed=5)
    calls = [W, W - 3, 5, 1, 7] + [1] * 30  # (calls of at most w + 1 tokens: no pieces of b)
    ids = distinct_prompt(sum(calls), seed=5)
    logits = read(model, ids, calls, LexCache(config))
    assert LexCache(config).policy.representatives == 2
    assert_reference(model, ids, as_read(calls), logits)


@pytest.mark.parametrize("method", ["rope", "xpos"])
def test_decoding_from_the_first_token_matches_the_reference(method):
    """Token by token from the start, so blocks complete one at a time and a forward has fewer candidate blocks than
    slots (the first slots empty) before it has more."""
    config = memory_config(position_embedding_type=method, attention_mode="sliding", attention_sinks=4,
                           attention_memory_blocks=4)
    model = perturbed_model(config, seed=11)
    ids = distinct_prompt(48, seed=11)
    assert_reference(model, ids, [1] * 48, read(model, ids, [1] * 48, LexCache(config)))


def test_choose_blocks():
    """The rule by hand: the best k // 3 blocks with the candidates beside them, then the best of the rest; of equal
    scores the later; each row alone; empty slots first; each run of consecutive blocks in stream order, the runs by
    their best score, the best last (of equal scores, the earlier run first)."""
    low = -torch.inf
    scores = torch.tensor([[5.0, 1, 0, 9, 2, 3], [0, 0, 8, 0, 0, 7]])
    assert choose_blocks(scores, 4).tolist() == [[0, 2, 3, 4], [5, 1, 2, 3]]  # the best 4: 0, 3, 4, 5
    assert choose_blocks(torch.tensor([9.0, 0, 0, 0, 5, 0, 0, 3]), 3).tolist() == [4, 0, 1]
    assert choose_blocks(torch.tensor([5.0, 0, 0, 5]), 2).tolist() == [0, 3]
    assert choose_blocks(torch.tensor([2.0, low, low]), 3).tolist() == [-1, -1, 0]
    assert choose_blocks(scores, 3).tolist() == [[2, 3, 4], [1, 2, 3]]
    assert choose_blocks(torch.tensor([1.0, 7, 1]), 2).tolist() == [1, 2]
    assert choose_blocks(torch.tensor([4.0, 1, 1, 4, 0, 0, 0]), 3).tolist() == [2, 3, 4]
    assert choose_blocks(torch.tensor([low, low, 4, 6]), 4).tolist() == [-1, -1, 2, 3]
    assert choose_blocks(torch.tensor([low, 6, 4, 1]), 3).tolist() == [1, 2, 3]  # block 0 is no candidate
    assert choose_blocks(torch.tensor([3.0, 1, 2]), 1).tolist() == [0]


@pytest.mark.parametrize("slots", [1, 2, 3, 16, 64])
def test_choose_blocks_among_many_ties(slots):
    """Thousands of blocks whose scores take a few values (and some no candidates): the choice is the rule's,
    whatever the number of tied blocks at the cut (the later of them), as the reference chooses."""
    generator = torch.Generator().manual_seed(slots)
    for n, values in [(3000, 4), (500, 2), (slots + 2, 3), (8192, 1000)]:
        scores = torch.randint(values, (2, n), generator=generator).float()
        scores[torch.rand(2, n, generator=generator) < 0.2] = -math.inf
        scores[1, : n // 2] = -math.inf  # the second row: fewer candidates
        for row in range(2):
            candidates = {j: s for j, s in enumerate(scores[row].tolist()) if s > -math.inf}
            read = reference.chosen_blocks(candidates, slots)
            assert choose_blocks(scores, slots)[row].tolist() == [-1] * (slots - len(read)) + read


def test_blocks_of_equal_scores():
    """A document that repeats one block's tokens, read by one layer: the blocks score exactly the same, and the
    reading still equals the reference's. (Which of equal blocks is read shows only where they hold other keys:
    `test_choose_blocks` checks the rule, the later block. In a second layer the repeated document's states are
    nearly periodic, and float32 breaks near-ties otherwise than float64.)"""
    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=0,
                           num_hidden_layers=1)
    model = perturbed_model(config, seed=12)
    ids = prompt(1, BLOCK, seed=12).repeat(1, 12)
    margins = []
    logits = read(model, ids, [1] * ids.shape[1], LexCache(config))
    expected = reference.memory_forward(model.state_dict(), config, ids[0], [1] * ids.shape[1], margins)
    assert min(margins) == 0.0  # exact ties were met
    torch.testing.assert_close(logits.double(), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("block", [BLOCK, 8])
@pytest.mark.parametrize("sinks", [0, 4])
def test_long_forward_reads_through_the_memory(sinks, block):
    """A forward longer than w without a cache reads as a cached call does (w tokens at a time, the last w in
    pieces, the last tokens of those alone) through a LexCache with the memory, which it returns (use_cache), or
    not."""
    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=sinks,
                           attention_memory_block_size=block)
    model = perturbed_model(config)
    chunks = {BLOCK: 2, 8: 4}[block]  # blocks of 8: enough evicted blocks for the retrieval to choose among
    ids = prompt(1, (chunks + 1) * W + 5, seed=2)
    with torch.no_grad():
        out = model(ids)
        plain = model(ids, use_cache=False)
    pieces = {BLOCK: [BLOCK] * 3 + [1], 8: [8, 6, 2]}[block]  # b = 8: its last 2 tokens alone
    assert as_read([ids.shape[1]], block) == [W] * chunks + [4] + pieces + [1]
    assert_reference(model, ids, as_read([ids.shape[1]], block), out.logits[0])
    assert isinstance(getattr(out, CACHE_NAME), LexCache) and getattr(out, CACHE_NAME).memory_bytes > 0
    assert getattr(plain, CACHE_NAME) is None
    torch.testing.assert_close(plain.logits, out.logits)


def test_every_query_of_a_piece_chooses(monkeypatch):
    """w = 64, blocks of 2: every query of a forward of at most p = max(b, w // 16) = 4 tokens (a piece of the
    prompt's end) chooses, b = 2 of a longer one; the blocks and logits are the reference's."""
    window, block = 64, 2
    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=4,
                           attention_window=window, attention_memory_block_size=block)
    model = perturbed_model(config, seed=4)
    ids = prompt(1, 4 * window + 9, seed=4)
    choosing = []  # per forward and layer that chose: (its tokens, the queries that scored the blocks)
    scores = memory.block_scores
    monkeypatch.setattr(memory, "block_scores", lambda query, reps, candidates: choosing.append(query.shape[2]) or
                        scores(query, reps, candidates))
    with torch.no_grad():
        logits = model(ids).logits[0]
    forwards = as_read([ids.shape[1]], block, window)
    assert forwards == [window] * 3 + [8] + [4] * 15 + [3, 1, 1]
    assert choosing[:2] == [2, 2]  # the third forward of w (the first with blocks to choose from), both layers
    assert max(choosing) == 4 and choosing.count(4) >= 2 * 15
    assert_reference(model, ids, forwards, logits)


@pytest.mark.parametrize("block", [16, 64, 128])
def test_the_last_window_is_read_in_sixteen_pieces_or_blocks(block):
    """With w = 1024 the last w tokens before the last are read in pieces of max(b, 64), the last quarter-piece of
    them alone: 16 + 1 forwards for blocks of 16 or 64, 8 + 1 for blocks of 128."""
    model = LexForCausalLM(memory_config(attention_window=1024, attention_memory_block_size=block,
                                         attention_mode="sliding", attention_sinks=4))
    widths = [stop - start for start, stop in model.reading_spans(5000)]
    piece = max(block, 64)
    assert widths[:4] == [1024, 1024, 1024, 5000 - 1 - 1024 - 3 * 1024]
    assert widths[4:] == [piece] * (1024 // piece - 1) + [piece - piece // 4, piece // 4, 1]


def test_base_model_reads_a_long_input_as_the_reference():
    """LexModel reads an input longer than w through the block memory itself, as the head does (the head adds the
    logits only): its hidden states through the LM head are the reference's logits, forward by forward."""
    config = memory_config(attention_mode="sliding", attention_sinks=4)
    model = perturbed_model(config, seed=4)
    ids = distinct_prompt(3 * W + 5, seed=4)
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
    assert hidden.shape[1] == ids.shape[1]
    assert_reference(model, ids, as_read([ids.shape[1]]), model.lm_head(hidden)[0])


def test_base_model_refuses_a_long_input_in_one_forward():
    """Hidden states of every layer come from one forward over the whole input, which the memory does not read."""
    config = memory_config(attention_mode="sliding")
    with pytest.raises(ValueError, match="attention_memory_blocks=3"):
        LexForCausalLM(config).model(prompt(1, W + 1), output_hidden_states=True)


@pytest.mark.parametrize("method", ["rope", "xpos"])
def test_greedy_generate_matches_the_reference(method):
    """generate(): the prompt as the model's long forward reads it (chunks of w, the last w in pieces of b, the last
    token alone), then one token a forward; each new token is the reference's argmax."""
    config = memory_config(position_embedding_type=method, attention_mode="blockwise", attention_sinks=4)
    model = perturbed_model(config, seed=3)
    ids = prompt(1, 2 * W + 9, seed=3)
    out = greedy(model, ids, max_new_tokens=12)
    tokens = out.sequences
    forwards = as_read([ids.shape[1]]) + [1] * 11
    expected = reference.memory_forward(model.state_dict(), config, tokens[0, :-1], forwards)
    generated = torch.stack(out.logits, dim=1)[0]
    torch.testing.assert_close(generated.double(), expected[ids.shape[1] - 1 :], atol=2e-5, rtol=0)
    assert torch.equal(tokens[0, ids.shape[1] :], expected[ids.shape[1] - 1 :].argmax(-1))


def test_left_padded_rows_read_as_alone():
    """A row left-padded by w tokens (a multiple of the block size) reads the same blocks at the same places as
    alone. (Blocks are cut at stream indices and a long prompt is read w tokens a forward, each forward retrieving
    for b of its queries: other padding shifts both, and the row reads other blocks.)"""
    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=4,
                           attention_memory_block_size=4)
    model = perturbed_model(config, seed=4)
    long, short = distinct_prompt(4 * W, seed=5), distinct_prompt(3 * W, seed=6)  # no exact ties (batched or not)
    batch = torch.cat([long, torch.cat([torch.full((1, W), PAD), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :W] = 0
    together = greedy(model, batch, attention_mask=mask, max_new_tokens=8)
    for row, alone in enumerate((long, short)):
        single = greedy(model, alone, max_new_tokens=8)
        assert torch.equal(together.sequences[row, -8:], single.sequences[0, -8:])
        for step, logits in enumerate(single.logits):
            torch.testing.assert_close(together.logits[step][row], logits[0], atol=1e-5, rtol=0)


def test_sampling_beams_and_a_returned_cache():
    """Sampling, beam search (the memory's rows follow their beams) and continuing from a returned cache run and
    read the memory."""
    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=4)
    model = perturbed_model(config, seed=7)
    ids = prompt(2, 2 * W, seed=7)
    torch.manual_seed(0)
    sampled = model.generate(ids, do_sample=True, max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True)
    assert getattr(sampled, CACHE_NAME).memory_bytes > 0
    beams = model.generate(ids, num_beams=3, max_new_tokens=6, pad_token_id=PAD, return_dict_in_generate=True)
    assert beams.sequences.shape == (2, 2 * W + 6) and getattr(beams, CACHE_NAME).memory_bytes > 0
    first = greedy(model, ids, max_new_tokens=4)
    returned = {CACHE_NAME: getattr(first, CACHE_NAME)}
    more = model.generate(first.sequences, **returned, do_sample=False, max_new_tokens=4, pad_token_id=PAD)
    assert more.shape == (2, 2 * W + 8)


def test_reordered_rows_keep_their_chosen_blocks(monkeypatch):
    """A decoding step between two block completions reads the blocks chosen before it; after a beam reorder (rows
    swapped) each row reads those its own prompt chose, and the step that chooses when the next block completes
    starts from its own row's carried evidence: the swapped cache's steps give the swapped logits."""
    import copy

    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=4)
    model = perturbed_model(config, seed=9)
    ids = torch.cat([distinct_prompt(4 * W + 2, seed=9), distinct_prompt(4 * W + 2, seed=10)])
    cache = LexCache(config)
    with torch.no_grad():
        model(ids, cache=cache)  # (the prompt's last token, read alone, chooses)
        chosen = [layer.memory.chosen.blocks for layer in cache.layers]
        assert any(not torch.equal(rows[0], rows[1]) for rows in chosen)  # the rows chose differently
        swapped = copy.deepcopy(cache)
        swapped.reorder_cache(torch.tensor([1, 0]))
        scored = []
        monkeypatch.setattr(memory, "block_scores", lambda *args: scored.append(1))
        step = ids[:, -1:]
        expected = model(step, cache=cache).logits[[1, 0]]
        assert not scored  # no block completed since: the step read the blocks chosen before it
        torch.testing.assert_close(model(step[[1, 0]], cache=swapped).logits, expected, atol=1e-6, rtol=0)
        monkeypatch.undo()
        carried = cache.memory_evidence
        assert not torch.equal(*carried)  # the rows carry different evidence, and each its own after the reorder
        assert torch.equal(swapped.memory_evidence, carried[[1, 0]])
        among = cache.layers[0].memory.chosen.among
        for _ in range(BLOCK):  # sliding: a block completes within b steps, and that step chooses
            expected = model(step, cache=cache).logits[[1, 0]]
            torch.testing.assert_close(model(step[[1, 0]], cache=swapped).logits, expected, atol=1e-6, rtol=0)
        assert cache.layers[0].memory.chosen.among > among  # a step chose


def test_a_forward_that_raises_leaves_the_choice_as_it_was():
    """A decoding step that raises after the second layer's attention, with another token than the one that follows:
    the layers that chose before the fault hold no choice of it (it is kept when the forward commits), so every next
    step reads as a cache that never saw the fault."""
    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=4)
    model = perturbed_model(config, seed=12)
    ids = distinct_prompt(4 * W + 12, seed=12)
    faulty, clean = LexCache(config), LexCache(config)

    def boom(*_):
        raise RuntimeError("boom")

    with torch.no_grad():
        for cache in (faulty, clean):
            model(ids[:, : 4 * W], cache=cache)
        for step in range(4 * W, ids.shape[1]):  # steps that choose (a block completed) and steps that reuse
            handle = model.model.layers[1].register_forward_hook(boom)
            with pytest.raises(RuntimeError, match="boom"):
                model(ids[:, step - 1 : step], cache=faulty)  # (another token, another query)
            handle.remove()
            torch.testing.assert_close(model(ids[:, step : step + 1], cache=faulty).logits,
                                       model(ids[:, step : step + 1], cache=clean).logits, atol=0, rtol=0)


def test_memory_mapped_store(tmp_path):
    """`LexCache(config, memory_directory=...)`: the keys and values in memory-mapped files there (unlinked at
    once), the representatives, which every choice reads whole, in RAM; the same logits and bytes as in RAM."""
    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=4)
    model = perturbed_model(config, seed=8)
    ids = prompt(1, 3 * W, seed=8)
    in_ram, on_disk = LexCache(config), LexCache(config, memory_directory=str(tmp_path))
    forwards = [W, W, W]
    torch.testing.assert_close(read(model, ids, forwards, on_disk), read(model, ids, forwards, in_ram))
    assert on_disk.memory_bytes == in_ram.memory_bytes > 0
    assert not list(tmp_path.iterdir())
    layer = on_disk.layers[0].memory
    assert layer.keys.untyped_storage().filename is not None  # file-backed
    assert layer.values.untyped_storage().filename is not None
    assert layer.representatives.untyped_storage().filename is None
    evicted = on_disk.seen - on_disk.held
    per_token = 2 * config.num_key_value_heads * config.head_dim * 4  # keys and values, float32
    representatives = (evicted // BLOCK) * config.num_key_value_heads * (BLOCK // 4) * config.head_dim * 4
    assert on_disk.memory_bytes == config.num_hidden_layers * (evicted * per_token + representatives)


def test_a_long_prompt_allocates_each_store_once(monkeypatch):
    """A prompt read in one call (here 600 tokens, 36 forwards of w before its pieces) sizes each layer's keys,
    values and representatives once for what it will evict (`LexCache.reserve_memory`), not by doublings that
    copy the store; a later call grows it as before."""
    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=4)
    model = perturbed_model(config, seed=5)
    allocated = []
    real = memory._allocate
    monkeypatch.setattr(memory, "_allocate", lambda like, shape, directory: allocated.append(shape) or
                        real(like, shape, directory))
    cache = LexCache(config)
    with torch.no_grad():
        model(prompt(1, 600, seed=5), cache=cache)
    evicted = cache.seen - cache.held
    assert evicted > 512  # past two doublings from the first 256
    assert len(allocated) == 3 * config.num_hidden_layers
    layer = cache.layers[0].memory
    assert layer.length == evicted and 600 <= layer.keys.shape[2] < 600 + BLOCK
    with torch.no_grad():
        model(prompt(1, 700, seed=6), cache=cache)
    assert len(allocated) == 6 * config.num_hidden_layers


def test_store_size_before_its_first_complete_block():
    """`memory_bytes` counts the evicted tokens' keys and values while no block is complete (no representatives
    yet): what `lex generate`'s progress bar shows after its first forwards."""
    config = memory_config(attention_mode="sliding", attention_memory_block_size=64)
    model = perturbed_model(config, seed=3)
    cache = LexCache(config)
    read(model, prompt(1, W + 4, seed=3), [W, 4], cache)
    evicted = cache.seen - cache.held
    assert 0 < evicted < 64
    per_token = 2 * config.num_key_value_heads * config.head_dim * 4  # keys and values, float32
    assert cache.memory_bytes == config.num_hidden_layers * evicted * per_token


def test_refusals():
    """Full mode, sinks at true positions, the static cache and assisted decoding refuse the memory by name."""
    invalid = StrictDataclassClassValidationError
    with pytest.raises(invalid, match="attention_memory_blocks=3 with attention_mode='full'"):
        memory_config(attention_mode="full")
    with pytest.raises(invalid, match="attention_sink_positions='true'.*allowed: 'cache'"):
        memory_config(attention_sinks=4, attention_sink_positions="true")
    config = memory_config(attention_mode="sliding")
    with pytest.raises(ValueError, match="LexStaticCache with attention_memory_blocks=3"):
        LexStaticCache(config, max_cache_len=64)
    model = perturbed_model(config)
    with pytest.raises(ValueError, match="activate_past_recording with attention_memory_blocks=3"):
        model.generate(prompt(1, 8), assistant_model=perturbed_model(config, seed=1), max_new_tokens=4,
                       pad_token_id=PAD)


@pytest.mark.parametrize("mode", ["sliding", "blockwise"])
@pytest.mark.parametrize("sinks", [0, 4])
def test_a_gemma3_model_reads_the_memory_in_its_global_layers(mode, sinks):
    """A Gemma 3 checkpoint converted with a block memory: its global layers read the window, the sinks and the
    memory, its local layers their own window (8, with their own rope), and only the global layers hold a memory.
    Prompt chunks, then decoding: the reference's logits and blocks; generate() runs past the window."""
    model = lex_from_hf(gemma3_source(), attention_mode=mode, attention_window=W, attention_sinks=sinks,
                        attention_memory_blocks=BLOCKS, attention_memory_block_size=BLOCK)
    assert model.config.local_layers == [kind == "sliding_attention" for kind in GEMMA3_LAYERS]
    ids = distinct_prompt(60, seed=1)
    calls = [W, W - 3, 5, 1, 7] + [1] * 18
    cache = LexCache(model.config)
    logits = read(model, ids, calls, cache)
    assert [layer.memory is not None for layer in cache.layers] == [not local for local in model.config.local_layers]
    assert cache.layers[1].memory.length == cache.seen - cache.held > BLOCKS * BLOCK
    assert_reference(model, ids, as_read(calls), logits)
    out = greedy(model, ids[:, :2 * W], max_new_tokens=W + 4)
    expected = reference.memory_forward(model.state_dict(), model.config, out.sequences[0, :-1],
                                        as_read([2 * W]) + [1] * (W + 3))
    assert torch.equal(out.sequences[0, 2 * W :], expected[2 * W - 1 :].argmax(-1))


def test_lex_commands_read_a_gemma3_folder_with_a_memory(tmp_path, capsys):
    """As a user would: `lex convert-hf` a Gemma 3 folder with `--attention_memory_blocks`, `lex generate` the LEX
    folder, and `lex eval-length` the Gemma 3 folder converted in memory with and without the memory: the tokens
    and the perplexity are the float64 reference's."""
    source = gemma3_source(bos_token_id=None, eos_token_id=None)
    source.save_pretrained(tmp_path / "gemma3")
    tokenizer, words = word_tokenizer()
    tokenizer.save_pretrained(tmp_path / "gemma3")
    reading = ["--attention_mode", "sliding", "--attention_window", str(W), "--attention_sinks", "4",
               "--attention_memory_block_size", str(BLOCK)]
    assert lex(["convert-hf", str(tmp_path / "gemma3"), str(tmp_path / "lex"), *reading,
                "--attention_memory_blocks", str(BLOCKS)]) == 0
    model = LexForCausalLM.from_pretrained(tmp_path / "lex").eval()
    assert model.config.local_layers == [kind == "sliding_attention" for kind in GEMMA3_LAYERS]
    assert model.config.attention_memory_blocks == BLOCKS
    text = " ".join(words[(7 * i) % 96] for i in range(3 * W))
    (tmp_path / "prompt.txt").write_text(text)
    ids = tokenizer(text, return_tensors="pt").input_ids
    capsys.readouterr()
    assert lex(["generate", str(tmp_path / "lex"), "--prompt_file", str(tmp_path / "prompt.txt"),
                "--max_new_tokens", "12"]) == 0
    sequence = ids[0]
    for step in range(12):
        expected = reference.memory_forward(model.state_dict(), model.config, sequence,
                                            as_read([ids.shape[1]]) + [1] * step)
        sequence = torch.cat([sequence, expected[-1:].argmax(-1)])
    assert capsys.readouterr().out.split() == tokenizer.decode(sequence[ids.shape[1] :]).split()

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "doc.txt").write_text(" ".join(words[(5 * i + 3) % 96] for i in range(4 * W)))
    assert lex(["eval-length", str(tmp_path / "gemma3"), "--files", str(tmp_path / "docs" / "doc.txt"), *reading,
                "--attention_modes", "sliding", "--attention_memory_blocks", f"0,{BLOCKS}", "--lengths", str(4 * W),
                "--protocols", "segments", "--output_dir", str(tmp_path / "eval")]) == 0
    rows = {row["attention_memory_blocks"]: row["ppl"]
            for row in json.loads((tmp_path / "eval" / "results.json").read_text())}
    document = torch.tensor(tokenizer((tmp_path / "docs" / "doc.txt").read_text()).input_ids[: 4 * W])
    spans = model.reading_spans(4 * W)
    expected = reference.memory_forward(model.state_dict(), model.config, document, [b - a for a, b in spans])
    nll = torch.nn.functional.cross_entropy(expected[:-1], document[1:])
    assert rows[BLOCKS] == pytest.approx(math.exp(float(nll)), rel=1e-5)
    assert rows[0] != pytest.approx(rows[BLOCKS], rel=1e-3)


@pytest.mark.parametrize("mode, window, allowed", [("sliding", 10, 12), ("blockwise", 16, 22)])
def test_a_memory_whose_global_window_misses_what_local_layers_read_is_refused(mode, window, allowed):
    """The memory takes the keys that leave the global layers' window: a local window reaching past it (12 here)
    would leave the global layers a gap between the memory and the window, so the config is refused by name."""
    with pytest.raises(Exception, match=f"attention_window={window} .*local_attention_window=12.*attention_window >= "
                                        f"{allowed}"):
        lex_from_hf(gemma3_source(local_window=12), attention_mode=mode, attention_window=window,
                    attention_memory_blocks=BLOCKS, attention_memory_block_size=BLOCK)


def test_saved_folder_keeps_the_memory(tmp_path):
    config = memory_config(attention_mode="sliding", attention_sinks=4)
    model = perturbed_model(config)
    model.save_pretrained(tmp_path)
    loaded = LexForCausalLM.from_pretrained(tmp_path)
    assert (loaded.config.attention_memory_blocks, loaded.config.attention_memory_block_size) == (BLOCKS, BLOCK)
    ids = prompt(1, 3 * W, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("position, mode", [("rope", "sliding"), ("xpos", "blockwise")])
def test_each_layer_calls_the_backend_once_and_the_memory_s_keys_reach_it_as_keys(position, mode):
    """Through a backend registered with transformers (`AttentionInterface.register`, then
    `set_attn_implementation`), a prompt of 5 windows (read in several forwards) and decoding steps with sinks and
    the memory: each forward of each layer's attention calls the backend once, and a decoding step's keys are the
    sinks, the window and the memory's k * b slots (its keys, not a side computation)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def counting(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, query.shape[2], key.shape[2]))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("lex_counting", counting)
    slots, block, sinks = 2, 4, 2
    model = perturbed_model(tiny_config(
        position_embedding_type=position, attention_mode=mode, attention_sinks=sinks, attention_sink_positions="cache",
        attention_memory_blocks=slots, attention_memory_block_size=block, num_key_value_heads=1))
    model.set_attn_implementation("lex_counting")
    forwards = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(lambda module, *args: forwards.append(module.layer_idx))
    cache = LexCache(model.config)
    with torch.no_grad():
        out = model.generate(prompt(1, 5 * W), max_new_tokens=4, do_sample=False, **{CACHE_NAME: cache})
    layers = model.config.num_hidden_layers
    assert [layer for layer, _, _ in calls] == forwards
    assert len(forwards) > layers * 5  # (the prompt's forwards, then a decoding step's each)
    assert out.shape[1] == 5 * W + 4 and cache.memory_bytes > 0
    held = cache.stream.sink_slots + cache.held  # what the next step reads besides its own key and the memory
    calls.clear()
    with torch.no_grad():
        model(out[:, -1:], **{CACHE_NAME: cache})
    assert calls == [(layer, 1, held + 1 + slots * block) for layer in range(layers)]


def test_a_step_attends_only_over_the_slots_it_fills(monkeypatch):
    """While fewer blocks than slots lie past the window, a forward's tile holds the window part and the blocks
    read, no empty slot (a document shorter than k blocks past its window is not attended over k); the logits are
    the float64 reference's, which reads all k slots with the empty ones masked."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import modeling_lex.modeling_lex as modeling

    config = memory_config(position_embedding_type="rope", attention_mode="sliding", attention_sinks=0)
    model = perturbed_model(config)
    ids = distinct_prompt(W + 4 * BLOCK + 6, seed=3)
    forwards = as_read([W + 1]) + [1] * (ids.shape[1] - W - 1)
    cache = LexCache(config)
    columns = []  # per forward of one token: (the keys layer 0 attends over, its window part, complete blocks)

    class WatchedInterfaces:
        def get_interface(self, implementation, default):
            backend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, default)

            def watched(module, query, key, value, *args, **kwargs):
                if module.layer_idx == 0 and query.shape[2] == 1:
                    columns.append((key.shape[2], cache.layers[0].get_seq_length() + 1,
                                    cache.layers[0].memory.blocks))
                return backend(module, query, key, value, *args, **kwargs)

            return watched

    monkeypatch.setattr(modeling, "ALL_ATTENTION_FUNCTIONS", WatchedInterfaces())
    logits = read(model, ids, forwards, cache)
    memory_columns = [keys - window for keys, window, _ in columns]
    assert memory_columns == [BLOCK * min(BLOCKS, blocks) for _, _, blocks in columns]
    assert 0 < min(column for column in memory_columns if column) < BLOCKS * BLOCK == max(memory_columns)
    assert_reference(model, ids, forwards, logits)
