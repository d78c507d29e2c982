"""torch.compile: a forward without graph breaks, and compiled decoding with the static bounded cache.

CPU compiles take tens of seconds, so these tests are few and use a one-layer model.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import modeling_lex  # noqa: F401
from tests.helpers import PAD, W, left_padded, perturbed_model, tiny_config

pytestmark = pytest.mark.oldest  # also run on the oldest transformers we declare


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
def test_fullgraph_compile_equals_eager_at_training_length_and_three_windows():
    """fullgraph=True fails on any graph break (host syncs included); the compiled logits equal eager's."""
    model = perturbed_model(tiny_config(num_hidden_layers=1))
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    torch.manual_seed(0)
    for ids in (torch.randint(1, 97, (2, W)), torch.randint(1, 97, (1, 3 * W))):  # l, and blockwise over 3 w
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["blockwise", "sliding", "full"])
def test_static_cache_decoding_compiles_once(mode):
    """With a compiled forward and cache_implementation="static", a second generate() of the same shapes
    compiles no new graph (dynamo's own graph counter), and the tokens are those of the eager default cache."""
    model = perturbed_model(tiny_config(num_hidden_layers=1, attention_mode=mode))
    _, ids, mask = left_padded([5, 2 * W + 3])
    options = dict(attention_mask=mask, max_new_tokens=W + 5, do_sample=False, pad_token_id=PAD)
    eager = model.generate(ids, **options)
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    first = model.generate(ids, cache_implementation="static", **options)
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 2  # the prompt and the decoding step: not one graph per step
    second = model.generate(ids, cache_implementation="static", **options)
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(first, eager) and torch.equal(second, eager)
