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


