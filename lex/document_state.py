"""The state of a read document as a value: read once, then kept, copied, saved and loaded for many questions.

A `LexCache` that has read a document already holds everything the next token depends on: each layer's window part
and sink slots, the stream's bookkeeping, the block memory (store, representatives, the choice it holds) and the
evidence the next forward starts from. A `DocumentState` is such a cache (a batch of one row) with the tokens it
read and the logits of the next token, so that a second question about a book costs the question, not the book:

    state = DocumentState.read(model, book_ids)                  # (1, n): the book, read once
    ids = torch.cat([state.tokens, question_ids[0]])[None].to(model.device)
    out = model.generate(ids, **{CACHE_NAME: state.copy().cache}, max_new_tokens=32)

generate() reads only the tokens its cache has not seen (the question), exactly as reading the book and the question
from scratch through one LexCache would (`CACHE_NAME`, modeling_lex.generation: `cache` from transformers 5.24 on,
`past_key_values` before). Pass `attention_mask=torch.ones_like(ids)` where the text may hold the pad token, which
generate() would otherwise take for padding. generate() writes into the cache it is given: hand it a `copy()` to keep
the state for the next question.

A state is read as generate()'s prefill reads a prompt (`read_steps`: the forwards of `model.reading_spans`, the same
position ids), saved to a folder (safetensors and a small JSON, no pickle; atomically, lex_base.staging) and loaded
for a model that reads as it was read: a folder with a missing or truncated file, of another model (its config and
weights fingerprints), read with other reading settings or another dtype is refused naming what differs (StateError).
A loaded state's block memory is memory-mapped copy-on-write from the folder's files: loading reads none of it, and
its copies share its pages.
"""

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import safetensors.torch
import torch
from tqdm.auto import tqdm

from lex.data import DataError
from lex_base.staging import atomic_directory
from modeling_lex import LexCache
from modeling_lex.memory import Choice, _allocate
from modeling_lex.reading import ReadingPolicy
from modeling_lex.stream import Stream, StreamState

FORMAT = 1
STATE_JSON = "state.json"
TENSORS = "state.safetensors"
# Room for the tokens a question evicts, written into a saved store as a hole (no disk where the file system has
# sparse files), so that a loaded state appends in place instead of copying its store to grow it.
STORE_ROOM = 1024
READING = ("attention_mode", "attention_window", "attention_sinks", "attention_sink_positions",
           "attention_memory_blocks", "attention_memory_block_size", "local_attention_window")
SAMPLED = 1024  # values of each weight tensor the weights fingerprint reads
STREAM_TENSORS = ("positions", "valid", "index", "sink_index", "sink_positions", "sink_valid", "memory_valid")
STREAM_STATES = ("after", "base", "state")
STREAM_VALUES = ("seen", "sink_slots", "floor", "record_past", "removable_from")
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


class StateError(DataError):
    """A state folder that cannot continue this model: a missing or truncated file, another model, other reading
    settings or another dtype. Raised before anything is read into a cache."""


def store_name(layer: int) -> str:
    return f"memory-{layer}.safetensors"


# --------------------------------------------------------------------------------------------------- reading


def read_steps(model, cache: LexCache, input_ids: torch.Tensor) -> Iterator[torch.Tensor | None]:
    """Read `input_ids` (1, n) into `cache` one forward per next(): the spans of `model.reading_spans(n)`, with the
    position ids generate() passes (continuing the cache's stream), so the cache ends as generate()'s prefill leaves
    it. Yields None after each span but the last, and the next token's logits (vocab,) float32 after the last.

    A caller (the server) may run other forwards between two next(): nothing is held across a yield but the cache. A
    forward that raises leaves the cache as it was before that forward (cache.py); spans read before it stay read."""
    if not isinstance(cache, LexCache):
        raise TypeError(f"read_steps reads into a LexCache, got {type(cache).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must have shape (1, n) with n >= 1, got {tuple(input_ids.shape)}")
    positions = cache.stream.positions
    if positions is not None and positions.shape[0] != 1:
        raise ValueError(f"read_steps reads into a cache of one row; this one holds {positions.shape[0]}")
    input_ids = input_ids.to(model.device)
    seen, length = cache.seen, input_ids.shape[1]
    position_ids = torch.arange(seen, seen + length, device=input_ids.device)[None]  # (generate()'s: the mask's)
    cache.reserve_memory(seen + length)
    spans = model.reading_spans(length)
    for start, stop in spans[:-1]:
        with torch.no_grad():  # (per forward: a grad mode held across a yield would leak into the caller's code)
            model.model(input_ids=input_ids[:, start:stop], position_ids=position_ids[:, start:stop], cache=cache,
                        use_cache=True, in_spans=False)
        yield None
    start, stop = spans[-1]
    with torch.no_grad():
        out = model(input_ids=input_ids[:, start:stop], position_ids=position_ids[:, start:stop], cache=cache,
                    use_cache=True, in_spans=False, logits_to_keep=1)
    yield out.logits[0, -1].float()


# --------------------------------------------------------------------------------------------------- fingerprints


def config_fingerprint(config) -> str:
    """What the model computes, by its config: every field but the reading settings (checked one by one) and the
    private and bookkeeping ones."""
    fields = {key: value for key, value in config.to_dict().items()
              if key not in READING and not key.startswith("_")
              and key not in ("transformers_version", "dtype", "torch_dtype", "architectures", "name_or_path")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def weights_fingerprint(model) -> str:
    """The weights' names, shapes, dtypes and `SAMPLED` values spread over each tensor: another checkpoint or fine-tune
    of the same architecture differs, in milliseconds where hashing every weight would read the whole model."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.numel():
            flat = tensor.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLED)][:SAMPLED].cpu().contiguous()
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def reading_settings(config) -> dict:
    return {name: getattr(config, name, None) for name in READING}


def identity(model) -> dict:
    """What a state records of the model that read it, and a loading model must match: its fingerprints and dtype
    (and its name, for the message)."""
    return {"config": config_fingerprint(model.config), "weights": weights_fingerprint(model),
            "dtype": str(model.dtype).removeprefix("torch."),
            "name_or_path": getattr(model.config, "_name_or_path", "")}


# ------------------------------------------------------------------------------------------- the cache as tensors


def _cache_parts(cache: LexCache) -> tuple[dict[str, torch.Tensor], dict, dict[int, tuple]]:
    """What a LexCache holds between forwards: its small tensors by name, its ints (JSON), and each memory layer's store
    (keys, values, tokens held) apart, since it grows with the document."""
    if cache.stream.record_past or any(layer.forward_open for layer in cache.layers):
        raise ValueError("a document state is taken between forwards from a cache that is not recording the past")
    tensors, layers, stores = {}, [], {}
    stream = cache.stream
    for name in STREAM_TENSORS:
        if getattr(stream, name) is not None:
            tensors[f"stream.{name}"] = getattr(stream, name)
    for name in STREAM_STATES:
        if getattr(stream, name) is not None:
            for field in dataclasses.fields(StreamState):
                tensors[f"stream.{name}.{field.name}"] = getattr(getattr(stream, name), field.name)
    if cache.memory_evidence is not None:
        tensors["memory_evidence"] = cache.memory_evidence
    for index, layer in enumerate(cache.layers):
        entry = {"window": layer._window[0] is not None, "sinks": layer._sinks[0] is not None, "memory": None}
        if entry["window"]:
            for which, kind in enumerate(("keys", "values")):
                buffer, begin, end = layer._window[which]
                tensors[f"layers.{index}.{kind}"] = buffer[:, :, begin:end]
                if entry["sinks"]:
                    tensors[f"layers.{index}.sink_{kind}"] = layer._sinks[which]
        memory = layer.memory
        if memory is not None:
            entry["memory"] = {"length": memory.length, "chosen_among": None}
            if memory.keys is not None:
                stores[index] = (memory.keys, memory.values, memory.length)
            if memory.representatives is not None:
                tensors[f"layers.{index}.representatives"] = memory.representatives[:, :, :, : memory.blocks]
            if memory.chosen is not None:
                entry["memory"]["chosen_among"] = memory.chosen.among
                for kind in ("blocks", "keys", "values"):
                    tensors[f"layers.{index}.chosen_{kind}"] = getattr(memory.chosen, kind)
        layers.append(entry)
    values = {name: getattr(stream, name) for name in STREAM_VALUES}
    values["seen"] = int(values["seen"])
    return tensors, {"stream": values, "layers": layers, "drafted_tokens": cache.drafted_tokens}, stores


def _build_cache(config, tensors: dict[str, torch.Tensor], meta: dict, stores: dict[int, tuple],
                 memory_directory: str | None) -> LexCache:
    """A LexCache holding `tensors`, `meta` and `stores` (as `_cache_parts` gives them): each layer's window part in
    a buffer of its own (the next forward writes around it), every other tensor as given (no forward writes them in
    place, but the stores: the caller passes stores nothing else writes)."""
    cache = LexCache(config, memory_directory)
    stream = Stream(cache.policy)
    for name in STREAM_TENSORS:
        setattr(stream, name, tensors.get(f"stream.{name}"))
    for name in STREAM_STATES:
        if f"stream.{name}.start" in tensors:
            setattr(stream, name, StreamState(*(tensors[f"stream.{name}.{f.name}"]
                                                for f in dataclasses.fields(StreamState))))
    for name, value in meta["stream"].items():
        setattr(stream, name, value)
    cache.stream = stream
    cache.memory_evidence = tensors.get("memory_evidence")
    cache.drafted_tokens = meta["drafted_tokens"]
    if len(meta["layers"]) != len(cache.layers):
        raise ValueError(f"a state of {len(meta['layers'])} layers for a model of {len(cache.layers)}")
    for index, (layer, entry) in enumerate(zip(cache.layers, meta["layers"])):
        if entry["window"]:
            for which, kind in enumerate(("keys", "values")):
                window = tensors[f"layers.{index}.{kind}"]
                sinks = tensors.get(f"layers.{index}.sink_{kind}")
                count = 0 if sinks is None else sinks.shape[2]
                buffer = window.clone() if sinks is None else torch.cat([sinks, window], dim=2)
                layer._window[which] = (buffer, count, buffer.shape[2])
                layer._sinks[which] = sinks
            layer.lazy_initialization(layer._window[0][0], layer._window[1][0])
        if entry["memory"] is not None:
            memory = layer.memory
            if memory is None:
                raise ValueError(f"layer {index} of the state has a block memory; the model's has none")
            memory.length = entry["memory"]["length"]
            if index in stores:
                memory.keys, memory.values = stores[index][:2]
            memory.representatives = tensors.get(f"layers.{index}.representatives")
            if entry["memory"]["chosen_among"] is not None:
                chosen = {kind: tensors[f"layers.{index}.chosen_{kind}"] for kind in ("blocks", "keys", "values")}
                memory.chosen = Choice(among=entry["memory"]["chosen_among"], **chosen)
    return cache


# --------------------------------------------------------------------------------------------------- store files


@dataclasses.dataclass(frozen=True)
class MappedStore:
    """A layer's store mapped copy-on-write from a state folder's file: `keys`/`values` are the tensors the cache got,
    holding `length` tokens as the file does. While the cache holds these tensors at that length, the file is the
    store (a copy maps it again, a save links it)."""

    path: Path
    keys: torch.Tensor
    values: torch.Tensor
    length: int

    def unchanged(self, memory) -> bool:
        return memory is not None and memory.keys is self.keys and memory.length == self.length


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and where its data begin."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        if size > os.path.getsize(path):
            raise ValueError("the header is longer than the file")
        return json.loads(handle.read(size)), 8 + size


def write_store(path: Path, keys: torch.Tensor, values: torch.Tensor, length: int, block: int) -> None:
    """A layer's store as a safetensors file of keys and values (1, H, capacity, d): the `length` tokens held, then
    `STORE_ROOM` tokens of room left as a hole (zeros), the capacity a multiple of the memory's block, as the store's
    own buffers are (memory.py reads whole blocks as rows)."""
    capacity = -(-(length + STORE_ROOM) // block) * block
    shape = [1, keys.shape[1], capacity, keys.shape[3]]
    element = keys.element_size()
    part = shape[1] * capacity * shape[3] * element
    header = {"keys": {"dtype": SAFETENSORS_DTYPES[keys.dtype], "shape": shape, "data_offsets": [0, part]},
              "values": {"dtype": SAFETENSORS_DTYPES[values.dtype], "shape": shape, "data_offsets": [part, 2 * part]},
              "__metadata__": {"length": str(length)}}
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)  # (the data 64-byte aligned: mapped as tensors in place)
    row = capacity * shape[3] * element
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        start = handle.tell()
        for number, held in enumerate((keys, values)):
            for head in range(shape[1]):
                handle.seek(start + number * part + head * row)
                handle.write(held[0, head, :length].contiguous().cpu().view(torch.uint8).numpy().tobytes())
        handle.truncate(start + 2 * part)


def map_store(path: Path) -> MappedStore:
    """A store file mapped copy-on-write (MAP_PRIVATE): pages are read when touched, writes stay in this process."""
    header, start = _header(path)
    nbytes = os.path.getsize(path)
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=nbytes)
    data = torch.tensor([], dtype=torch.uint8).set_(storage)
    tensors = []
    for name in ("keys", "values"):
        first, last = header[name]["data_offsets"]
        dtype = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}[header[name]["dtype"]]
        tensors.append(data[start + first : start + last].view(dtype).view(header[name]["shape"]))
    return MappedStore(path, *tensors, int(header["__metadata__"]["length"]))


# --------------------------------------------------------------------------------------------------- the state


class DocumentState:
    """The state of a read document: everything the next token depends on.

    `cache`: a LexCache of one row that has read `tokens` (n,) long, in order; `logits`: the next token's logits
    (vocab,) float32 after the last token read (None where unknown); `source`: the reading model's `identity`, which
    `save` records and `load` checks. Continue it with generate() on a `copy()` (module docstring); read more into
    a new state with `read(model, ids, state)`."""

    def __init__(self, cache: LexCache, tokens: torch.Tensor, logits: torch.Tensor | None,
                 source: dict | None = None, mapped: dict[int, MappedStore] | None = None) -> None:
        self.cache, self.tokens, self.logits, self.source = cache, tokens, logits, source
        self._mapped = mapped or {}  # layer -> its store, mapped from a state folder's file

    @classmethod
    def read(cls, model, input_ids: torch.Tensor, state: "DocumentState | None" = None, progress: bool = False,
             memory_directory: str | None = None) -> "DocumentState":
        """Read `input_ids` (1, n) as generate()'s prefill reads a prompt (`read_steps`), after `state`'s tokens
        (into a copy of it: `state` stays as it is, even if a forward raises), or into a new LexCache (its block
        memory in RAM, or memory-mapped in `memory_directory`). `progress`: a bar over the tokens on stderr."""
        source = identity(model)
        if state is not None:
            state.check_reads_as(model, source)
            base = state.copy()
        else:
            base = cls(LexCache(model.config, memory_directory), torch.zeros(0, dtype=torch.long), None)
        tokens = input_ids.shape[-1]
        logits = None
        with tqdm(total=tokens, desc="reading", unit="tok", disable=not progress, file=sys.stderr) as bar:
            spans = iter(model.reading_spans(tokens))
            for logits in read_steps(model, base.cache, input_ids):
                start, stop = next(spans)
                bar.update(stop - start)
                if base.cache.policy.memory_tokens:
                    bar.set_postfix_str(f"memory {base.cache.memory_bytes / 1e6:.1f} MB", refresh=False)
        return cls(base.cache, torch.cat([base.tokens, input_ids[0].cpu()]), logits, source, base._mapped)

    def check_reads_as(self, model, source: dict) -> None:
        """Refuse a model (of `identity` `source`) other than the one that read the state, or one that reads with
        other settings (StateError naming what differs)."""
        theirs, mine = ReadingPolicy.of(model.config), self.cache.policy
        if theirs != mine:
            raise StateError(f"the state was read with {mine}; the model reads with {theirs}")
        if self.source is not None:
            differ = [kind for kind in ("config", "weights", "dtype") if self.source[kind] != source[kind]]
            if differ:
                raise StateError(f"the state was read by another model (its {', '.join(differ)} differ: "
                                 f"{[self.source[kind] for kind in differ]} vs {[source[kind] for kind in differ]})")

    def copy(self) -> "DocumentState":
        """A state that continues as this one, independently: it shares only what no forward writes in place (the
        stream's bookkeeping, the sink slots, the memory's representatives of the blocks held and its last choice:
        a forward replaces them, and a representatives buffer of exactly the blocks held grows into a new one). It
        copies each layer's window part (O(w) per layer), which the next forward writes around, and the store, which
        grows in place: for a state loaded from a folder, nothing (its files mapped again, copy-on-write: pages are
        shared until a copy appends), else the store's bytes (`cache.memory_bytes`, in RAM or in the cache's memory
        directory)."""
        tensors, meta, stores = _cache_parts(self.cache)
        mapped, owned = {}, {}
        for index, (keys, values, length) in stores.items():
            source = self._mapped.get(index)
            if source is not None and source.unchanged(self.cache.layers[index].memory):
                mapped[index] = map_store(source.path)
                owned[index] = (mapped[index].keys, mapped[index].values, None)
            else:
                owned[index] = (*(_copied_store(held, length, self.cache.memory_directory) for held in (keys, values)),
                                None)
        cache = _build_cache(self.cache.config, tensors, meta, owned, self.cache.memory_directory)
        return DocumentState(cache, self.tokens, self.logits, self.source, mapped)

    @property
    def nbytes(self) -> int:
        """Bytes the state holds: the cache's tensors (the store counted by the tokens it holds), tokens and logits."""
        tensors, _, _ = _cache_parts(self.cache)
        extra = self.tokens.nbytes + (0 if self.logits is None else self.logits.nbytes)
        return sum(tensor.nbytes for tensor in tensors.values()) + self.cache.memory_bytes + extra

    # ------------------------------------------------------------------------------------------------ on disk

    def save(self, folder: str | Path, force: bool = False) -> None:
        """Write the state to `folder` (an existing one refused unless `force`, then replaced only once the new one
        is complete): `state.json` (the model's fingerprints, reading settings, dtype, the cache's ints, each file's
        size), `state.safetensors` (the window, sink slots, stream, representatives, choice, evidence, tokens,
        logits) and one `memory-LAYER.safetensors` per memory layer (its store; a store still mapped unchanged from
        a state folder is hard-linked, not written again). Written through a staging folder: a failure (a full
        disk) leaves the previous folder and no partial one."""
        if self.source is None:
            raise ValueError("a DocumentState without its reading model's identity (`source`) cannot be saved: "
                             "make it with DocumentState.read or load")
        tensors, meta, stores = _cache_parts(self.cache)
        tensors = {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}  # (views of one another)
        tensors["tokens"] = self.tokens.cpu().contiguous()
        if self.logits is not None:
            tensors["logits"] = self.logits.detach().float().cpu().contiguous()
        block = self.cache.policy.memory_block_size
        with atomic_directory(folder, force=force) as staging:
            for index, (keys, values, length) in stores.items():
                target = staging / store_name(index)
                source = self._mapped.get(index)
                if source is not None and source.unchanged(self.cache.layers[index].memory):
                    try:
                        os.link(source.path, target)
                        continue
                    except OSError:  # (another file system: written below)
                        pass
                write_store(target, keys, values, length, block)
            safetensors.torch.save_file(tensors, staging / TENSORS)
            files = {path.name: path.stat().st_size for path in sorted(staging.iterdir())}
            description = {
                "format": FORMAT, "kind": "lex-document-state", "model": self.source,
                "reading": reading_settings(self.cache.config),
                "tokens": int(self.tokens.shape[0]), "cache": meta, "files": files,
            }
            (staging / STATE_JSON).write_text(json.dumps(description, indent=1))

    @classmethod
    def load(cls, folder: str | Path, model, memory_directory: str | None = None) -> "DocumentState":
        """The state saved in `folder`, for `model`; refused (StateError, naming the file or setting) where a file is
        missing or truncated, or the model, its reading settings or its dtype differ from the saver's. The stores
        are mapped copy-on-write from the folder's files (`memory_directory`: where they grow, if they outgrow the
        room saved with them)."""
        folder = Path(folder)
        if not folder.is_dir():
            raise StateError(f"state folder {folder}: no such folder")
        path = folder / STATE_JSON
        if not path.is_file():
            raise StateError(f"state folder {folder}: {STATE_JSON} is missing")
        try:
            description = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise StateError(f"state folder {folder}: {STATE_JSON} is truncated or not JSON ({error})") from None
        if not isinstance(description, dict) or description.get("kind") != "lex-document-state":
            raise StateError(f"state folder {folder}: {STATE_JSON} does not describe a LEX document state")
        if description.get("format") != FORMAT:
            raise StateError(f"state folder {folder}: format {description.get('format')!r}; this version reads "
                             f"format {FORMAT}")
        for name, size in description["files"].items():
            file = folder / name
            if not file.is_file():
                raise StateError(f"state folder {folder}: {name} is missing")
            if file.stat().st_size != size:
                raise StateError(f"state folder {folder}: {name} is truncated or changed ({file.stat().st_size} bytes, "
                                 f"saved with {size})")
        source = identity(model)
        if description["model"]["dtype"] != source["dtype"]:
            raise StateError(f"state folder {folder}: dtype {description['model']['dtype']} (saved); the model "
                             f"computes in {source['dtype']} (load it with --dtype {description['model']['dtype']})")
        saved, mine = description["reading"], reading_settings(model.config)
        differ = [f"{name} {saved.get(name)!r} (saved) vs {mine[name]!r}"
                  for name in READING if saved.get(name) != mine[name]]
        if differ:
            raise StateError(f"state folder {folder}: read with other reading settings than the model's: "
                             f"{'; '.join(differ)}")
        for kind in ("config", "weights"):
            if description["model"][kind] != source[kind]:
                raise StateError(f"state folder {folder}: read by another model (its {kind} fingerprint "
                                 f"{description['model'][kind]}, this model's {source[kind]}; saved from "
                                 f"{description['model']['name_or_path'] or 'an unnamed model'})")
        try:
            tensors = safetensors.torch.load_file(folder / TENSORS)
        except Exception as error:  # (safetensors raises its own error types for a damaged file)
            raise StateError(f"state folder {folder}: {TENSORS} cannot be read ({error})") from None
        meta, device = description["cache"], model.device
        mapped, stores = {}, {}
        for index, entry in enumerate(meta["layers"]):
            if entry["memory"] is None or not entry["memory"]["length"]:
                continue
            name = store_name(index)
            try:
                store = map_store(folder / name)
            except (ValueError, KeyError, RuntimeError, OSError) as error:
                raise StateError(f"state folder {folder}: {name} cannot be read ({error})") from None
            if store.length != entry["memory"]["length"]:
                raise StateError(f"state folder {folder}: {name} holds {store.length} tokens, the state "
                                 f"{entry['memory']['length']}")
            if device.type == "cpu":
                mapped[index] = store
                stores[index] = (store.keys, store.values, None)
            else:
                stores[index] = (store.keys.to(device), store.values.to(device), None)
        tokens, logits = tensors.pop("tokens"), tensors.pop("logits", None)
        cache = _build_cache(model.config, {name: t.to(device) for name, t in tensors.items()}, meta, stores,
                             memory_directory)
        return cls(cache, tokens, None if logits is None else logits.to(device), description["model"], mapped)


def _copied_store(held: torch.Tensor, length: int, directory: str | None) -> torch.Tensor:
    """A store buffer of the same capacity holding the same first `length` tokens, in RAM or in `directory`."""
    copy = _allocate(held, tuple(held.shape), directory)
    copy[:, :, :length] = held[:, :, :length]
    return copy


def disk_bytes(folder: str | Path) -> int:
    """Bytes a state folder takes on disk (the blocks allocated: a store's room is a hole)."""
    return sum(path.stat().st_blocks * 512 for path in Path(folder).iterdir())


__all__ = ["DocumentState", "StateError", "config_fingerprint", "disk_bytes", "identity", "read_steps",
           "weights_fingerprint"]
