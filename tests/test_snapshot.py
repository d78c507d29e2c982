"""The reading path computes what it computed before it was rebuilt: every model of tests/snapshot.py (each position
method, blockwise and sliding, 0 and 4 sinks, with and without a block memory; a left-padded batch read through a
LexCache, then decoded across a block boundary) gives the saved logits within 1e-5, the same tokens and the same
chosen blocks. The float64 references (tests/reference.py) check the rules; this checks that no number moved."""

import pytest
import torch

from tests import snapshot

pytestmark = pytest.mark.oldest  # also run on the oldest transformers we declare


@pytest.fixture(scope="module")
def saved() -> dict[str, torch.Tensor]:
    return snapshot.load()


@pytest.mark.parametrize("name,overrides", snapshot.cases(), ids=[name for name, _ in snapshot.cases()])
def test_the_numbers_are_those_saved_before_the_redesign(name, overrides, saved):
    now = snapshot.compute(overrides)
    expected = {key.split(".", 1)[1]: value for key, value in saved.items() if key.split(".", 1)[0] == name}
    assert set(now) == set(expected), f"{name}: computed {sorted(now)}, saved {sorted(expected)}"
    if "memory" in name:
        assert any(key.startswith("blocks.") for key in now), "the memory chose no block: nothing was compared"
    for field, value in now.items():
        if field.startswith("blocks.") or field == "tokens":
            assert torch.equal(value, expected[field]), f"{name}: {field} {value.tolist()} != {expected[field].tolist()}"
        else:
            torch.testing.assert_close(value, expected[field], atol=1e-5, rtol=0, msg=f"{name}: {field}")
