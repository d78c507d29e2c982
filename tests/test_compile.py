"""torch.compile: a forward without graph breaks (compiled decoding with the static cache: test_static_cache.py).

CPU compiles take tens of seconds, so these tests are few and use a one-layer model.
"""

import pytest
import torch

import modeling_lex  # noqa: F401
from tests.helpers import W, perturbed_model, tiny_config

pytestmark = [pytest.mark.usefixtures("fresh_dynamo"), pytest.mark.oldest]


@pytest.mark.slow
def test_fullgraph_compile_equals_eager_at_training_length_and_three_windows():
    """fullgraph=True fails on any graph break (host syncs included); the compiled logits equal eager's."""
    model = perturbed_model(tiny_config(num_hidden_layers=1))
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    torch.manual_seed(0)
    for ids in (torch.randint(1, 97, (2, W)), torch.randint(1, 97, (1, 3 * W))):  # l, and blockwise over 3 w
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)




@pytest.mark.slow
@pytest.mark.parametrize("sinks, prompt_length", [(4, 2048), (0, 2047)])
def test_compiled_decoding_gives_eager_s_tokens_with_one_graph(sinks, prompt_length):
    """lex.compiled_decoding (what `lex generate --compile` runs), on Inductor with its CPU options: 64 greedy tokens
    past a prompt of 2,048 tokens (sliding window 64, 4 sinks at cache positions; and a prompt one token short of a
    block boundary without sinks) are the eager default cache's, and the whole decoding compiled one graph (dynamo's
    own counter: no recompilation after the first step)."""
    from torch._dynamo.utils import counters

    from lex.compiled_decoding import compile_decoding, read_prompt
    from modeling_lex.generation import CACHE_NAME
    from tests.helpers import prompt

    config = tiny_config(position_embedding_type="rope", attention_mode="sliding", attention_window=64,
                         attention_sinks=sinks, attention_sink_positions="cache", max_position_embeddings=64,
                         num_key_value_heads=1)
    model = perturbed_model(config)
    ids = prompt(1, prompt_length)
    options = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)
    with torch.no_grad():
        eager = model.generate(ids, **options)
        cache = read_prompt(model, ids)
        compile_decoding(model)
        compiled = model.generate(ids, **options, **{CACHE_NAME: cache})
    assert torch.equal(compiled, eager)
    assert counters["stats"]["unique_graphs"] == 1
