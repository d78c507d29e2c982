"""Compiled decoding: a decoding step with no Python per layer, on the bounded static cache.

Decoding a small model on a CPU spends much of each step in the framework (a module call, a cache update and the
attention backend per layer); compiled, the whole step is one graph. The rule is transformers' documented compiled
decoding (`cache_implementation="static"` and a `torch.compile`d forward) with two choices of its own:

- the prompt is read before the step is compiled, uncompiled, through a `LexCache` (all but its last token, in
  the forwards the model's long forward runs), which a `LexStaticCache` then holds: a prompt of any length
  costs no graph of its own, and every step generate() runs afterwards has the same shapes, so the step
  compiles once (`fullgraph=True`, `dynamic=False`);
- on a CPU, Inductor calls the step's kernels from generated C++ (`cpp_wrapper`) and folds the weights into the
  graph as constants (`freezing`), which removes the per-kernel Python calls that dominate a small model's step.

The block memory chooses blocks on the host as the document grows, which no fixed graph holds: a static cache
refuses it by name (`LexStaticCache`), and so does this module's caller.
"""

import torch

from modeling_lex import LexCache, LexStaticCache

CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True, "freezing": True}


@torch.no_grad()
def read_prompt(model, input_ids: torch.Tensor, max_cache_len: int | None = None) -> LexStaticCache:
    """A LexStaticCache that has read all but the last token of `input_ids` (uncompiled); `max_cache_len`: its slots
    in full attention (the prompt and every token to be generated). In sliding and full mode the prompt is read
    through a LexCache, whose first forward reads plainly causal, with no empty slots in front of it; in blockwise
    mode, where a LexCache holds only the blocks its next queries see, fewer keys than the slots, straight into
    the static cache."""
    cache = LexStaticCache(model.config, max_cache_len=max_cache_len)  # (a block memory is refused before reading)
    if input_ids.shape[1] < 2:
        return cache
    read = cache if cache.policy.mode == "blockwise" else LexCache(model.config)
    model.model(input_ids=input_ids[:, :-1], cache=read, use_cache=True)
    return cache if read is cache else cache.load(read)


def compile_decoding(model) -> None:
    """Replace `model.forward` by its compiled step, as transformers documents compiled decoding; the first call
    compiles (tens of seconds on a CPU), later calls of the same shapes reuse the graph."""
    options = CPU_INDUCTOR_OPTIONS if model.device.type == "cpu" else None
    model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False, options=options)


__all__ = ["CPU_INDUCTOR_OPTIONS", "compile_decoding", "read_prompt"]
