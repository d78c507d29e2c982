"""Perplexity by evaluation length, in two protocols, for any causal LM (LEX in every attention mode).

- "segments" (the paper's): the first N tokens of each document cut into non-overlapping segments of the
  target length, each read from a cold start; mean token NLL per length. Longer segments win partly because
  fewer tokens start cold.
- "strided" (HF's "perplexity of fixed-length models"): windows of the target length moved by half a window;
  each token is scored once, with as much context as the length allows. This isolates real use of context.

Used by `lex eval-length`, `lex demo` and the `length_perplexity` evaluate module.
"""

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn
from tqdm.auto import tqdm

from modeling_lex.generation import CACHE_NAME

from .data import DataError

# The two ways to score a length (module docstring): the one source of the choices.
Protocol = Literal["segments", "strided"]
PROTOCOLS: tuple[str, ...] = get_args(Protocol)


@dataclass
class Score:
    nll: float  # summed negative log-likelihood (nats)
    tokens: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")


HEAD_TOKENS = 1024  # at most this many positions (summed over the batch) have vocabulary logits at once


def _scored_states(model, ids: torch.Tensor) -> tuple[Iterator[tuple[int, torch.Tensor]], Callable]:
    """(first position, states) pieces covering `ids`, and the head that turns a slice of states into logits.

    A LEX model (ours, one converted from a Llama checkpoint, or one loaded from an exported folder through remote
    code) reads the window 2w tokens at a time through the cache its first forward makes (the incremental form
    of its forward), so blockwise and sliding attention hold O(w) keys and activations for any length; full
    attention keeps every key, by nature. 2w rather than w: a forward of more than w new tokens runs each query
    against its <= w keys, one of w or fewer against all w + held keys (measured at w = 1024 on one CPU thread:
    0.73 against 0.83 s per 1,024 tokens). With a block memory (`attention_memory_blocks` > 0), as the model's
    own long forward reads (`LexForCausalLM.reading_spans`: w tokens at a time, the last w in pieces of b, the last
    token alone): the blocks are chosen once per forward, so its logits are the model's. Other causal LMs give their
    logits in one forward, as published.
    """
    if model.config.model_type != "lex":
        return iter([(0, model(ids).logits)]), nn.Identity()
    window = model.config.attention_window
    memory = getattr(model.config, "attention_memory_blocks", 0)  # (0 in configs saved before the memory)

    def stream() -> Iterator[tuple[int, torch.Tensor]]:
        cache, length = None, ids.shape[1]
        spans = (model.reading_spans(length) if memory  # as the model's own long forward reads it
                 else [(start, min(start + 2 * window, length)) for start in range(0, length, 2 * window)])
        for start, stop in spans:
            out = model.model(input_ids=ids[:, start:stop], cache=cache, use_cache=True, in_spans=False)
            cache = getattr(out, CACHE_NAME)
            yield start, out.last_hidden_state

    return stream(), model.lm_head


@torch.no_grad()
def _window_nll(model, ids: torch.Tensor, score_from: int, bar: tqdm) -> tuple[float, int]:
    """NLL of tokens score_from+1 .. end of each row of `ids`, predicted from everything before them.

    Logits exist for at most HEAD_TOKENS positions at a time, never for the whole window (n x vocab floats).
    """
    ids = ids.to(model.device)
    batch, length = ids.shape
    pieces, head = _scored_states(model, ids)
    span = max(1, HEAD_TOKENS // batch)
    nll = 0.0
    for start, states in pieces:
        stop = start + states.shape[1]
        for first in range(max(start, score_from), min(stop, length - 1), span):
            last = min(first + span, stop, length - 1)
            logits = head(states[:, first - start : last - start]).float()
            targets = ids[:, first + 1 : last + 1]
            nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        bar.update(batch * (stop - start))
    return nll, batch * (length - 1 - score_from)


def windows(document: torch.Tensor, length: int, protocol: Protocol) -> list[tuple[int, int, int]]:
    """(start, stop, score_from) of each window over one document: the tokens it reads, and that it scores
    the tokens after window position `score_from` (each token of the document at most once)."""
    if protocol == "segments":
        return [(s, s + length, 0) for s in range(0, len(document) - length + 1, length)]
    stride, out, scored_to = max(1, length // 2), [], 0
    for start in range(0, len(document), stride):
        stop = min(start + length, len(document))
        out.append((start, stop, max(scored_to - start - 1, 0)))
        scored_to = stop
        if stop == len(document):
            break
    return out


def perplexity_by_length(
    model, documents: list[torch.Tensor], lengths: list[int], protocol: Protocol, batch_size: int = 8,
    progress: bool = False, document_tokens: int | None = None,
) -> dict[int, Score]:
    """Score every length on the same tokens: each document's first `document_tokens` tokens (default: the
    longest length; more, to compare models that cannot all read the longest length on the same tokens).

    Memory does not grow with the length in blockwise and sliding modes (see `_scored_states`); `progress`
    shows a bar in tokens read. A strided window as long as the document is one pass over it; windows longer
    than w overlap by half and each is read from a cold start, so the strided protocol reads about twice the
    tokens it scores.
    """
    if protocol not in PROTOCOLS:
        raise DataError(f"protocol={protocol!r} is not one of {list(PROTOCOLS)}")
    budget = document_tokens or max(lengths)
    if budget < max(lengths):
        raise DataError(f"document_tokens={budget} is shorter than the longest length, {max(lengths)}")
    documents = [d[:budget] for d in documents if len(d) >= budget]
    if not documents:
        what = "the tokens asked for" if document_tokens else "the longest length asked for"
        raise DataError(f"no evaluation document holds {budget} tokens ({what}); "
                        "give shorter lengths or longer documents")
    plan = []  # (length, score_from, rows of one shape) per forward
    for length in lengths:
        by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
        for document in documents:
            for start, stop, score_from in windows(document, length, protocol):
                by_shape.setdefault((stop - start, score_from), []).append(document[start:stop])
        plan += [(length, score_from, rows[i : i + batch_size])
                 for (_, score_from), rows in by_shape.items() for i in range(0, len(rows), batch_size)]
    results = {length: Score(0.0, 0) for length in lengths}
    total = sum(len(row) for _, _, rows in plan for row in rows)
    with tqdm(total=total, desc=f"{protocol} {','.join(map(str, lengths))}", unit="token", unit_scale=True,
              disable=not progress) as bar:
        for length, score_from, rows in plan:
            nll, count = _window_nll(model, torch.stack(rows), score_from, bar)
            results[length] = Score(results[length].nll + nll, results[length].tokens + count)
    return results


def score_rows(
    model, documents: list[torch.Tensor], lengths: list[int], protocols: tuple[Protocol, ...] = PROTOCOLS,
    batch_size: int = 8, progress: bool = False, labels: dict | None = None, document_tokens: int | None = None,
) -> Iterator[tuple[str, list[dict]]]:
    """(protocol, rows) of one loaded model: rows of {**labels, protocol, length, training_length, ppl, tokens}
    (labels: the model's name, attention mode and sinks)."""
    for protocol in protocols:
        scores = perplexity_by_length(model, documents, lengths, protocol, batch_size, progress, document_tokens)
        yield protocol, [{**(labels or {}), "protocol": protocol, "length": length,
                          "training_length": model.config.max_position_embeddings, "ppl": s.ppl, "tokens": s.tokens}
                         for length, s in scores.items()]
