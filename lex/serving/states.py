"""The server's kept states: read documents a later request may start from, bounded by bytes.

The rule: a request reads its prompt in segments (a conversation message by message, a completion prompt whole:
`reading_plan`), each segment in the forwards the model's own long forward runs for it. A state is kept at the end
of each segment and at the last two points inside a segment where a shorter read would run the same forwards
(window boundaries before the end). A later request starts from the kept state of the longest prefix of its tokens
that ends where its own reading would pass (`reuse_points`), so it runs exactly the forwards a server without the
state would run, and its answer is the same.

States are held in RAM up to `capacity` bytes, least recently used first out; with a `directory`, one pushed out
(and every one held when the server stops) is saved there (`DocumentState.save`, atomic) and found again after a
restart.
"""

import hashlib
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from lex.document_state import DocumentState, identity
from lex_base.errors import LexError


def state_key(tokens: list[int]) -> str:
    """The name of the state that read exactly `tokens`."""
    return hashlib.sha256(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]


def reading_plan(tokenizer, messages: list[dict] | None = None, prompt: str | None = None
                 ) -> tuple[list[int], list[int]]:
    """The prompt's tokens and its segments' ends: a conversation rendered by the checkpoint's chat template, one
    segment per message where the rendering of the messages before it is a prefix of the whole (in tokens), the
    generation prompt with the last; a completion prompt, tokenized as `lex generate` does, one segment."""
    if prompt is not None:
        tokens = tokenizer(prompt).input_ids
        return tokens, [len(tokens)]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens = tokenizer(text, add_special_tokens=False).input_ids
    ends = []
    for count in range(1, len(messages)):
        head = tokenizer.apply_chat_template(messages[:count], tokenize=False)
        if not text.startswith(head):
            continue
        ids = tokenizer(head, add_special_tokens=False).input_ids
        if 0 < len(ids) < len(tokens) and tokens[: len(ids)] == ids and (not ends or len(ids) > ends[-1]):
            ends.append(len(ids))
    return tokens, ends + [len(tokens)]


def reuse_points(model, segments: list[int], last_inside: bool = False) -> list[int]:
    """The points (token counts) where a read that stopped and went on runs the same forwards as this prompt's
    reading: each segment's end, and inside a segment each span end after which the rest of the segment is read
    in the spans it would be read in anyway (`model.reading_spans` asked for both lengths). `last_inside`: of
    those inside a segment at least a window before its end, only the last two: where the server keeps states,
    which a prompt that shares all but the segment's last words can start from (with a block memory the end of a
    segment is read in pieces placed by its length, so the last point a prompt may start from moves with it)."""
    points, start = [], 0
    for end in segments:
        spans = model.reading_spans(end - start)
        inside = [start + stop for _, stop in spans[:-1]
                  if [(a + stop, b + stop) for a, b in model.reading_spans(end - start - stop)]
                  == [(a, b) for a, b in spans if a >= stop]]
        if last_inside:
            inside = [point for point in inside if point <= end - model.config.attention_window][-2:]
        points += inside
        points.append(end)
        start = end
    return points


class StateStore:
    """Kept states by the tokens they read (see the module docstring). `capacity` 0 keeps none."""

    def __init__(self, model, capacity: int, directory: Path | None = None) -> None:
        self.model, self.capacity, self.directory = model, capacity, directory
        self.source = identity(model) if capacity else None  # what a kept state records of its model
        self.held: OrderedDict[str, DocumentState] = OrderedDict()
        self.bytes = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def find(self, tokens: list[int], segments: list[int]) -> DocumentState | None:
        """A copy of the kept state of the longest prefix of `tokens` a request may start from, or None."""
        if not self.enabled:
            return None
        for point in reversed(reuse_points(self.model, segments)):
            key = state_key(tokens[:point])
            state = self.held.get(key)
            if state is None:
                state = self._load(key, tokens[:point])
            else:
                self.held.move_to_end(key)
            if state is not None and (point < len(tokens) or state.logits is not None):
                return state.copy()
        return None

    def keep(self, tokens: list[int], cache, logits: torch.Tensor | None) -> None:
        """Keep a copy of `cache`, which has read `tokens` (and gave `logits` after the last), most recent first."""
        if not self.enabled:
            return
        key = state_key(tokens)
        if key in self.held:
            self.held.move_to_end(key)
            return
        state = DocumentState(cache, torch.tensor(tokens, dtype=torch.long), logits, self.source).copy()
        self.held[key] = state
        self.bytes += state.nbytes
        while self.bytes > self.capacity and self.held:
            old_key, old = self.held.popitem(last=False)
            self.bytes -= old.nbytes
            self._spill(old_key, old)

    def close(self) -> None:
        """The server stops: every state held in RAM is saved in the directory (if any)."""
        while self.held:
            key, state = self.held.popitem(last=False)
            self._spill(key, state)
        self.bytes = 0

    def _spill(self, key: str, state: DocumentState) -> None:
        if self.directory is None or (self.directory / key).exists():
            return
        try:
            state.save(self.directory / key)
        except OSError as error:  # a full disk: the state is dropped, the server goes on
            print(f"lex serve: could not save a kept state in {self.directory}: {error}", file=sys.stderr)

    def _load(self, key: str, tokens: list[int]) -> DocumentState | None:
        folder = None if self.directory is None else self.directory / key
        if folder is None or not folder.is_dir():
            return None
        try:
            state = DocumentState.load(folder, self.model)
        except LexError as error:  # another model's, or damaged: left as it is, read from scratch
            print(f"lex serve: {folder} is not a state this model can start from ({error})", file=sys.stderr)
            return None
        if state.tokens.tolist() != tokens:
            return None
        self.held[key] = state
        self.bytes += state.nbytes
        return state


__all__ = ["StateStore", "reading_plan", "reuse_points", "state_key"]
