"""LexRows: requests decoded together, each row through its own LexCache, equal a lone generate() of each."""

import pytest
import torch

from modeling_lex import LexCache, LexRows
from tests.helpers import perturbed_model, prompt, tiny_config

READINGS = {
    "sliding+sinks": dict(attention_mode="sliding", attention_window=8, attention_sinks=2),
    "blockwise+sinks": dict(attention_mode="blockwise", attention_window=8, attention_sinks=2),
    "sliding+sinks+memory": dict(attention_mode="sliding", attention_window=8, attention_sinks=2,
                                 attention_memory_blocks=2, attention_memory_block_size=4,
                                 attention_sink_positions="cache"),
    "full": dict(attention_mode="full"),
}


def read_alone(model, ids: torch.Tensor) -> tuple[LexCache, int]:
    """A prompt read into its own cache as generate()'s first forward reads it; its greedy next token."""
    cache = LexCache(model.config)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, logits_to_keep=1).logits
    return cache, int(logits[0, -1].argmax())


@pytest.mark.oldest
@pytest.mark.parametrize("reading", READINGS)
@torch.no_grad()
def test_rows_decoded_together_equal_lone_generate(reading):
    """Prompts around the window and block boundaries (3 ... 40 tokens, w = 8), rows joining and leaving: every
    row's greedy tokens equal a lone generate() of its prompt."""
    model = perturbed_model(tiny_config(**READINGS[reading]))
    lengths = [3, 7, 8, 9, 17, 40]
    prompts = [prompt(1, n, seed=n) for n in lengths]
    new = 12
    lone = [model.generate(p, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, p.shape[1]:].tolist()
            for p in prompts]
    rows, tokens = [], []
    for step in range(new + len(prompts)):
        if step < len(prompts):  # one request joins at each step
            cache, first = read_alone(model, prompts[step])
            rows.append((step, cache))
            tokens.append([first])
        live = [(index, cache) for index, cache in rows if len(tokens[index]) < new]
        if not live:
            break
        ids = torch.tensor([[tokens[index][-1]] for index, _ in live])
        logits = model(input_ids=ids, cache=LexRows([cache for _, cache in live])).logits
        for (index, _), row in zip(live, logits[:, -1]):
            tokens[index].append(int(row.argmax()))
    assert tokens == lone


@torch.no_grad()
def test_a_raising_rows_step_leaves_every_cache_as_it_was(monkeypatch):
    """A batched step that raises in one layer: every row's cache continues afterwards as if it had not run."""
    model = perturbed_model(tiny_config(**READINGS["sliding+sinks+memory"]))
    prompts = [prompt(1, n, seed=n) for n in (9, 30)]
    reads = [read_alone(model, p) for p in prompts]
    expected = [model.generate(p, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, p.shape[1]:].tolist()
                for p in prompts]
    layer = model.model.layers[1].mlp
    original = layer.forward
    monkeypatch.setattr(layer, "forward", lambda x: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        model(input_ids=torch.tensor([[first] for _, first in reads]), cache=LexRows([c for c, _ in reads]))
    monkeypatch.setattr(layer, "forward", original)
    tokens = [[first] for _, first in reads]
    for _ in range(5):
        ids = torch.tensor([[t[-1]] for t in tokens])
        logits = model(input_ids=ids, cache=LexRows([c for c, _ in reads])).logits[:, -1]
        for t, row in zip(tokens, logits):
            t.append(int(row.argmax()))
    assert tokens == expected


def test_rows_refuse_what_they_cannot_continue():
    model = perturbed_model(tiny_config(**READINGS["sliding+sinks"]))
    with pytest.raises(ValueError, match="LexRows takes LexCaches of one row"):
        LexRows([LexCache(model.config)])
    cache, _ = read_alone(model, prompt(1, 5))
    with pytest.raises(ValueError, match="input_ids of as many rows"):
        model(input_ids=torch.tensor([[1], [2]]), cache=LexRows([cache]))
