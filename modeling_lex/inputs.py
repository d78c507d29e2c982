"""The caller's inputs read into one forward's record: the one place a forward's `ForwardRecord` (record.py) comes
from, with every check of the caller's mask, position ids and cache. Nothing here changes a cache: a LEX cache's
stream makes the record as it stands, and the cache applies it when the forward's `cache.forward(record)` step ends."""

from dataclasses import replace

import torch
from transformers.cache_utils import Cache

from .cache import LEX_CACHES
from .record import ForwardRecord
from .stream import Stream


def begin_forward(
    config,
    batch: int,
    length: int,
    device: torch.device,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Cache | None,
) -> ForwardRecord:
    """The one place a forward's record comes from, the caller's inputs checked: a LEX cache's own stream (which it
    leaves as it is: `cache.forward(record)` applies it), or a stream made for this forward (no cache, or a
    transformers cache that holds every past key contiguously), or a caller's 4D mask.

    `attention_mask` is 2D, over the new tokens or over past and new ones (padding: 0), or 4D (B, 1, T, T).
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return _custom_mask_record(config, batch, length, device, attention_mask, position_ids, cache)
    lex_cache = isinstance(cache, LEX_CACHES)
    compiling = torch.compiler.is_compiling()
    seen = 0 if cache is None or lex_cache else cache.get_seq_length()
    if attention_mask is not None:
        past = attention_mask.shape[-1] - length
        known = int(cache.stream.seen) if lex_cache and not compiling else seen
        if attention_mask.dim() == 2 and not compiling and known == 0 and (attention_mask.shape[0] != batch or past):
            raise ValueError(  # generate()'s first forward: the prompt
                f"attention_mask has shape {tuple(attention_mask.shape)} but the prompt has {(batch, length)}; "
                "a forward without cached tokens needs one mask entry per input token"
            )
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or (
            not compiling and past not in (0, known)
        ):
            raise ValueError(
                f"attention_mask must have shape ({batch}, {length}) or ({batch}, {known + length}) "
                f"(new tokens, or past and new), got {tuple(attention_mask.shape)}"
            )
        mask = attention_mask.to(device=device, dtype=torch.bool)
    else:
        mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    caller_plain = _plain_input(mask if attention_mask is not None else None, position_ids, length, compiling)
    if lex_cache:
        return cache.stream.begin(position_ids, mask[:, -length:], caller_plain)
    # A stream for this forward: the past a foreign cache holds (contiguous, real unless the mask says padding),
    # then the new tokens.
    stream = Stream(config, unbounded=True)
    if position_ids is None and mask.shape[1] == seen + length:
        position_ids = ((mask.long().cumsum(-1) - 1).masked_fill(~mask, 1))[:, -length:]
    if seen:
        first = position_ids[:, :1] if position_ids is not None else torch.full((batch, 1), seen, device=device)
        past_valid = mask[:, :seen] if mask.shape[1] == seen + length else mask.new_ones(batch, seen)
        stream.commit(stream.begin(first.to(device) - seen + torch.arange(seen, device=device), past_valid, False))
    return stream.begin(position_ids, mask[:, -length:], caller_plain and seen == 0)


def _plain_input(mask: torch.Tensor | None, position_ids: torch.Tensor | None, length: int, compiling: bool) -> bool:
    """Whether the caller's mask and position ids say no more than their absence would: no padding, and positions
    counting from 0. generate() passes both on every forward; read on the host as Llama's mask creation reads its
    padding mask (`_ignore_causal_mask_sdpa`), so that a plain prompt runs plain causal attention (SDPA's causal
    kernel with grouped key/value heads, no mask). Compiled: only their absence counts (no host read)."""
    if compiling:
        return mask is None and position_ids is None
    if mask is not None and not bool(mask.all()):
        return False
    if position_ids is None:
        return True
    return bool((position_ids == torch.arange(length, device=position_ids.device)).all())


def _custom_mask_record(
    config, batch: int, length: int, device: torch.device, attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None, cache: Cache | None,
) -> ForwardRecord:
    """A caller's own (B, 1, T, T) mask (e.g. a shared prefix with branches): it says which keys each query sees,
    on top of causality and the window; documents are not inferred from position ids then."""
    if cache is not None and cache.get_seq_length():
        raise ValueError("a 4D attention_mask is supported on a forward without cached tokens (an empty or no cache)")
    if attention_mask.shape != (batch, 1, length, length) and attention_mask.shape != (1, 1, length, length):
        raise ValueError(
            f"a 4D attention_mask must have shape ({batch}, 1, {length}, {length}), got {tuple(attention_mask.shape)}"
        )
    allowed = attention_mask.to(device).bool() if attention_mask.dtype in (torch.bool, torch.long, torch.int) else (
        attention_mask.to(device) == 0  # additive: 0 where allowed, the dtype's minimum elsewhere
    )
    if position_ids is None:
        position_ids = torch.arange(length, device=device)
    position_ids = position_ids.to(device).expand(batch, length)
    valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    stream = cache.stream if isinstance(cache, LEX_CACHES) else Stream(config, unbounded=True)
    record = stream.begin(position_ids, valid, False)
    context = replace(record.context, document_start=torch.zeros_like(record.context.document_start),
                      allowed=allowed.expand(batch, -1, -1, -1))  # one document: the mask says the rest
    return replace(record, context=context, plain=False, aligned=False)


__all__ = ["begin_forward"]
