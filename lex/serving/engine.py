"""The serving engine: one thread that reads prompts and decodes every request in flight together.

The rule it follows (continuous batching over LEX's bounded caches):
- Each request has its own LexCache of one row. Its prompt is read alone, one forward at a time in the forwards
  the model's own long forward runs (`DocumentState.read_steps`), so a 50-token question is never padded to a
  30k-token document and a prompt is read exactly as a lone generate() reads it.
- Each turn of the loop reads prompt forwards, oldest waiting prompt first, until the turn has read w tokens
  (the window: a token budget per turn, as serving engines' chunked prefill has; one forward at least, and a
  forward is never split), and then runs one decoding step of every request that has read its prompt, as one
  batch (`LexRows`: the dense layers on the whole batch, each row's attention through its own cache). A request
  that arrives while others decode joins the batch at the first step after its prompt is read; one that
  finishes or whose client has gone leaves it at the next step. While a long prompt is read, the requests already
  decoding keep decoding, one token each per w prompt tokens read; the pieces in which the block memory reads the
  last window of a prompt (reading.py) share a turn, so requests that arrive together start decoding together.
- A batched step that raises leaves every row's cache as it was (each cache's step discards); the rows are then
  stepped one at a time, so the request whose forward raises fails alone and the others go on exactly.
- Kept states (`StateStore`, lex/serving/states.py): a request whose prompt begins with a kept state's tokens,
  at a point where its own reading would pass (`reading_plan`), starts from a copy of that state and reads the rest.
"""

import dataclasses
import queue
import secrets
import sys
import threading
import time
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from lex.document_state import DocumentState, read_steps
from modeling_lex import LexCache, LexRows

from .states import StateStore, reuse_points


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a request's tokens are chosen: greedy at temperature 0, else sampled with its own seeded generator."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclasses.dataclass
class Event:
    """What the engine tells a request's caller: new text, then the end (`finish_reason`) or an error."""

    text: str = ""
    finish_reason: str | None = None  # "stop" or "length" at the end
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a kept state had read


class Request:
    """One request in flight: its prompt's tokens and segments (`reading_plan`), how to sample, and where its
    events go (`emit`, called on the engine's thread)."""

    def __init__(self, request_id: str, prompt: list[int], segments: list[int], sampling: Sampling,
                 emit: Callable[[Event], None]) -> None:
        self.id, self.prompt, self.segments, self.sampling, self.emit = request_id, prompt, segments, sampling, emit
        self.cancelled = threading.Event()  # the client has gone: the row leaves at the next step
        self.cache: LexCache | None = None
        self.reader = None  # the prompt's remaining forwards (a generator), while it is read
        self.generated: list[int] = []
        self.text = ""  # the generated tokens' text, whole characters (`Engine._detokenize`)
        self.decoded = (0, 0)  # where the last decoding of new tokens began, and the tokens text holds
        self.sent = 0  # characters of the text already emitted
        self.cached_tokens = 0
        self.started = 0.0  # when the engine took it (perf_counter), for the progress line
        self.generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None
                                                       else secrets.randbits(63))
        self.warpers = LogitsProcessorList(
            ([TemperatureLogitsWarper(sampling.temperature)] if sampling.temperature > 0 else [])
            + ([TopPLogitsWarper(sampling.top_p)] if sampling.temperature > 0 and sampling.top_p < 1 else []))


class Engine:
    """Owns the model, the tokenizer and the loop's thread; `submit` hands it a request (from any thread)."""

    def __init__(self, model, tokenizer, max_batch_size: int = 16, states: StateStore | None = None,
                 progress: bool = True) -> None:
        self.model, self.tokenizer, self.max_batch_size = model, tokenizer, max_batch_size
        self.states = states or StateStore(model, 0)
        self.progress = progress
        eos = model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.incoming: queue.Queue[Request] = queue.Queue()
        self.reading: list[Request] = []
        self.decoding: list[Request] = []
        self.running = True
        self.largest_batch = 0  # the most requests one decoding step has served (GET /health)
        self.decoded_tokens, self.decoding_seconds = 0, 0.0  # by decoding steps, and the time they took
        self.decoding_steps = 0  # batched decoding steps run (decoded_tokens / decoding_steps: the mean batch)
        self.thread = threading.Thread(target=self._loop, name="lex-serve-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Finish nothing more: the loop ends after its current forward (the server calls this once the requests
        in flight have finished)."""
        self.running = False
        self.incoming.put(None)
        self.thread.join()

    def submit(self, request: Request) -> None:
        self.incoming.put(request)

    # ---------------------------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        with torch.inference_mode():
            while self.running:
                self._admit(block=not self.reading and not self.decoding)
                self._drop_cancelled()
                self._read_prompts(self.model.config.attention_window)
                if self.decoding:
                    self._decode_step(self.decoding[: self.max_batch_size])

    def _admit(self, block: bool) -> None:
        try:
            request = self.incoming.get(timeout=0.5) if block else self.incoming.get_nowait()
        except queue.Empty:
            return
        while request is not None:
            self._start(request)
            try:
                request = self.incoming.get_nowait()
            except queue.Empty:
                return

    def _start(self, request: Request) -> None:
        """The request's cache: a copy of the kept state that read the longest prefix of its plan, or a new one."""
        try:
            state = self.states.find(request.prompt, request.segments)
            if state is None:
                cache, done, logits = LexCache(self.model.config), 0, None
            else:
                cache, done, logits = state.cache, len(state.tokens), state.logits
            request.cache, request.cached_tokens = cache, done
            request.reader = self._reader(request, done, logits)
            request.started = time.perf_counter()
            self.reading.append(request)
        except Exception as error:  # noqa: BLE001  (a request that cannot start fails alone)
            request.emit(Event(error=f"{type(error).__name__}: {error}"))

    def _reader(self, request: Request, done: int, logits: torch.Tensor | None):
        """The forwards that read the rest of the prompt after its first `done` tokens (whose last `logits` a kept
        state holds), segment by segment, keeping a state where `StateStore` keeps them; yields None after each
        forward but the last, then the last token's logits."""
        keep = set(reuse_points(self.model, request.segments, last_inside=True)) if self.states.enabled else set()
        for stop in request.segments:
            if stop <= done:
                continue
            ids = torch.tensor([request.prompt[done:stop]], device=self.model.device)
            for logits in read_steps(self.model, request.cache, ids):
                if request.cache.seen in keep:
                    self.states.keep(request.prompt[: request.cache.seen], request.cache, logits)
                if request.cache.seen < len(request.prompt):
                    yield None
            done = stop
        yield logits

    def _drop_cancelled(self) -> None:
        for group in (self.reading, self.decoding):
            group[:] = [request for request in group if not request.cancelled.is_set()]

    def _read_prompts(self, budget: int) -> None:
        """Prompt forwards, oldest waiting prompt first, until `budget` tokens are read (at least one forward)."""
        read = 0
        while self.reading and read < budget:
            request = self.reading[0]
            before = request.cache.seen
            self._read_one_forward(request)
            read += max(request.cache.seen - before, 1)

    def _read_one_forward(self, request: Request) -> None:
        try:
            logits = next(request.reader)
        except Exception as error:  # noqa: BLE001
            self.reading.remove(request)
            request.emit(Event(error=f"{type(error).__name__}: {error}"))
            return
        read = request.cache.seen
        if self.progress and len(request.prompt) - request.cached_tokens > self.model.config.attention_window:
            print(f"lex serve: {request.id}: read {read} of {len(request.prompt)} prompt tokens "
                  f"({time.perf_counter() - request.started:.1f} s)", file=sys.stderr, flush=True)
        if logits is None:
            return
        self.reading.remove(request)
        request.reader = None
        if self._append(request, logits):
            self.decoding.append(request)

    @property
    def in_flight(self) -> int:
        """Requests reading their prompt or decoding (not those still in the queue)."""
        return len(self.reading) + len(self.decoding)

    def _decode_step(self, batch: list[Request]) -> None:
        self.largest_batch = max(self.largest_batch, len(batch))
        ids = torch.tensor([[request.generated[-1]] for request in batch], device=self.model.device)
        began = time.perf_counter()
        try:
            logits = self.model(input_ids=ids, cache=LexRows([request.cache for request in batch])).logits[:, -1]
        except Exception:  # noqa: BLE001  (every cache is as it was: step the rows alone to find the one that fails)
            for request in batch:
                self._decode_step_alone(request)
            return
        self.decoded_tokens += len(batch)
        self.decoding_steps += 1
        self.decoding_seconds += time.perf_counter() - began
        for request, row in zip(batch, logits):
            if not self._append(request, row):
                self.decoding.remove(request)

    def _decode_step_alone(self, request: Request) -> None:
        ids = torch.tensor([[request.generated[-1]]], device=self.model.device)
        try:
            logits = self.model(input_ids=ids, cache=LexRows([request.cache])).logits[0, -1]
        except Exception as error:  # noqa: BLE001
            self.decoding.remove(request)
            request.emit(Event(error=f"{type(error).__name__}: {error}"))
            return
        if not self._append(request, logits):
            self.decoding.remove(request)

    # ------------------------------------------------------------------------------------------ one new token

    def _append(self, request: Request, logits: torch.Tensor) -> bool:
        """Choose the request's next token from `logits` (vocab,), emit the text it completes; whether the request
        goes on."""
        token = self._choose(request, logits.float())
        sampling = request.sampling
        finish = None
        if token in self.eos:
            finish = "stop"
        else:
            request.generated.append(token)
            if len(request.generated) >= sampling.max_tokens:
                finish = "length"
        self._detokenize(request, final=finish is not None)
        text = request.text
        cut = min((text.find(stop) for stop in sampling.stop if stop in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        if finish is None:  # hold back what may begin a stop string
            safe = len(text)
            for stop in sampling.stop:
                for length in range(min(len(stop) - 1, safe), 0, -1):
                    if text[safe - length : safe] == stop[:length]:
                        safe -= length
                        break
            text = text[:safe]
        if len(text) > request.sent or finish is not None:
            event = Event(text=text[request.sent :], finish_reason=finish)
            request.sent = max(request.sent, len(text))
            if finish is not None:
                event.prompt_tokens, event.completion_tokens = len(request.prompt), len(request.generated)
                event.cached_tokens = request.cached_tokens
            request.emit(event)
        return finish is None

    def _detokenize(self, request: Request, final: bool) -> None:
        """Add to the request's text what its new tokens complete, decoding the tokens from the last decoding's
        start, not the whole answer at every token (the incremental detokenizing of vLLM and TGI: the tokens before
        the new ones are decoded with them, so that a word's leading space comes out as a whole decode writes it).
        A token that ends inside a character (bytes of UTF-8 split across tokens) waits for the next, but at the
        end (`final`)."""
        start, read = request.decoded
        before = self.tokenizer.decode(request.generated[start:read], skip_special_tokens=True)
        after = self.tokenizer.decode(request.generated[start:], skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            request.text += after[len(before) :]
            request.decoded = (read, len(request.generated))

    @staticmethod
    def _choose(request: Request, logits: torch.Tensor) -> int:
        if request.sampling.temperature == 0:
            return int(logits.argmax())
        scores = request.warpers(None, logits[None])
        return int(torch.multinomial(scores.softmax(-1), 1, generator=request.generator))


__all__ = ["Engine", "Event", "Request", "Sampling"]
