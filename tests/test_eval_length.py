"""Perplexity by length (streamed evaluator, evaluate module, CLI), attention resolution, passkey."""

import json
import math
from pathlib import Path

import evaluate
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from configuration_lex import LexConfig
from lex import perplexity
from lex.cli import main as lex
from lex.data import kjv_books, train_tokenizer
from lex.resolution import analytic_curve, expected_scores, resolution
from modeling_lex import LexForCausalLM
from tests import reference
from tests.helpers import perturb

METRIC = Path(__file__).resolve().parents[1] / "lex" / "metrics" / "length_perplexity"


@pytest.fixture(scope="module")
def tokenizer():
    """A 300-token byte-level BPE trained on two KJV books."""
    return train_tokenizer([b["text"] for b in kjv_books()[:2]], vocab_size=300)


@pytest.fixture(scope="module")
def folder(tokenizer, tmp_path_factory) -> Path:
    """A tiny random LEX model (w = 32) with a BPE tokenizer, saved like any trained folder."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = LexConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, max_position_embeddings=32)
    LexForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [b["text"][:3000] for b in kjv_books()[40:43]]


def spans(budget: int, length: int, protocol: str) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over a document's first `budget` tokens."""
    if protocol == "segments":
        return [(s, s + length, s + 1) for s in range(0, budget - length + 1, length)]
    out, previous_end = [], 0  # HF's fixed-length recipe: windows every length/2, each token scored once
    for begin in range(0, budget, length // 2):
        end = min(begin + length, budget)
        out.append((begin, end, max(previous_end, begin + 1)))
        previous_end = end
        if end == budget:
            break
    return out


def hand_computed(folder: Path, texts: list[str], length: int, protocol: str, budget: int) -> float:
    """The two protocols written out token by token, independently of lex.perplexity."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    nll, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids[:budget]
        for begin, end, first_scored in spans(budget, length, protocol):
            with torch.no_grad():
                log_probs = model(torch.tensor([ids[begin:end]])).logits[0].log_softmax(-1)
            for position in range(first_scored, end):
                nll -= log_probs[position - 1 - begin, ids[position]].item()
                count += 1
    return math.exp(nll / count)


def full_logits_nll(model, documents: list[torch.Tensor], length: int, protocol: str) -> tuple[float, int]:
    """The evaluator before streaming (the spec): each window in one forward, its full logits, one cross-entropy."""
    nll, count = 0.0, 0
    for document in documents:
        for begin, end, first_scored in spans(len(document), length, protocol):
            with torch.no_grad():
                logits = model(document[None, begin:end]).logits[0, first_scored - 1 - begin : -1]
            targets = document[first_scored:end]
            nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            count += len(targets)
    return nll, count


def tiny_lex(mode: str, window: int = 16, vocab: int = 300) -> LexForCausalLM:
    torch.manual_seed(0)
    config = LexConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=window, attention_mode=mode)
    return LexForCausalLM(config).eval()


@pytest.mark.parametrize("protocol", ["segments", "strided"])
@pytest.mark.parametrize("mode", ["full", "blockwise", "sliding"])
def test_streamed_evaluation_equals_full_logits(mode, protocol, monkeypatch):
    """w = 16; windows shorter than, equal to and several times w, batched by 2 over 3 documents, and logits
    taken 3 positions at a time so that slices cut through the w-token chunks."""
    monkeypatch.setattr(perplexity, "HEAD_TOKENS", 6)
    model = tiny_lex(mode)
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(0, 300, (n,), generator=generator) for n in (100, 100, 130)]
    lengths = [8, 16, 40, 100]
    scores = perplexity.perplexity_by_length(model, documents, lengths, protocol, batch_size=2)
    for length in lengths:
        nll, count = full_logits_nll(model, [d[:100] for d in documents], length, protocol)
        assert scores[length].tokens == count
        assert scores[length].nll == pytest.approx(nll, rel=1e-5), length


def test_other_causal_lms_are_scored_as_before():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    documents = [torch.randint(0, 300, (70,)) for _ in range(2)]
    scores = perplexity.perplexity_by_length(model, documents, [16, 70], "strided", batch_size=2)
    for length in (16, 70):
        nll, count = full_logits_nll(model, documents, length, "strided")
        assert (scores[length].tokens, scores[length].nll) == (count, pytest.approx(nll, rel=1e-5))


class LargestTensor(TorchDispatchMode):
    """The size in bytes of the largest tensor any operation produces while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.bytes = max(self.bytes, tensor.numel() * tensor.element_size())
        return out


def largest_tensor(model: LexForCausalLM, tokens: int) -> int:
    """The largest tensor of the evaluation of one `tokens`-long document as one strided window."""
    document = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    with LargestTensor() as probe:
        perplexity.perplexity_by_length(model, [document], [tokens], "strided", batch_size=1)
    return probe.bytes


@pytest.mark.parametrize("mode", ["full", "blockwise", "sliding"])
def test_evaluation_memory_does_not_grow_with_the_document(mode):
    """2w vs 32w tokens (w = 32, hidden 32, vocab 250): blockwise and sliding allocate nothing larger at 32w (the
    2w document's last logits slice is one position shorter, hence 2%); full attention keeps its keys (O(n) by
    nature) but never the window's n x vocab logits."""
    model = tiny_lex(mode, window=32, vocab=250)
    short, long = largest_tensor(model, 64), largest_tensor(model, 1024)
    if mode == "full":
        assert long < 1024 * 250 * 4
    else:
        assert long <= 1.02 * short


@pytest.mark.parametrize("protocol", ["segments", "strided"])
def test_evaluate_module_matches_hand_computation(folder, texts, protocol, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    metric = evaluate.load(str(METRIC))
    result = metric.compute(predictions=texts, model_id=str(folder), lengths=[16, 64], protocol=protocol)
    assert result["lengths"] == [16, 64]
    for length, ppl in zip(result["lengths"], result["perplexities"]):
        assert ppl == pytest.approx(hand_computed(folder, texts, length, protocol, budget=64), rel=1e-5)


def test_resolution_is_equation_3():
    s = torch.tensor([3.0, 2.5, 1.0, 0.2, -1.0], dtype=torch.float64)
    e = [math.exp(x) for x in s.tolist()]
    direct = sum(e[i] * (e[i] - e[i + 1]) for i in range(len(e) - 1)) / sum(e) ** 2
    assert resolution(s) == pytest.approx(direct, rel=1e-12)
    assert resolution(s + 7.0) == pytest.approx(direct, rel=1e-9)
    assert resolution(torch.zeros(10)) == 0.0
    assert resolution(torch.tensor([0.0, -100.0])) == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["xpos", "rope", "alibi", "kerple", "sandwich"])
def test_expected_scores_equal_the_naive_reference(kind):
    """The mean pre-softmax score at each distance, read from the model's own forward, against the float64 naive
    model's scores (tests/reference.py, independent of modeling_lex) on a random model whose every parameter is
    perturbed (KERPLE's r1, r2 included). Windows of 16, 15 and 16 tokens (w = 16): all are cut to 15. The
    model's attention implementation and transformers' attention registry are left as they were."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    torch.manual_seed(0)
    config = LexConfig(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=16, position_embedding_type=kind)
    model = LexForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * (0.15 if parameter.dim() > 1 else 0.1))
    windows = [torch.randint(0, 97, (n,)) for n in (16, 15, 16)]
    implementation, registry = model.config._attn_implementation, set(ALL_ATTENTION_FUNCTIONS)

    got = expected_scores(model, windows)

    state, n = model.state_dict(), 15
    expected = torch.zeros(2, n, dtype=torch.float64)
    for window in windows:
        for layer, scores in enumerate(reference.pre_softmax_scores(state, config, window[:n])):
            mean = scores.mean(0)  # over heads
            expected[layer] += torch.stack([mean.diagonal(-d).mean() for d in range(n)]) / len(windows)
    assert got.dtype == torch.float64 and got.shape == (2, n)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (model.config._attn_implementation, set(ALL_ATTENTION_FUNCTIONS)) == (implementation, registry)
    with pytest.raises(ValueError, match="at most attention_window = 16"):
        expected_scores(model, [torch.randint(0, 97, (17,))])
    assert (model.config._attn_implementation, set(ALL_ATTENTION_FUNCTIONS)) == (implementation, registry)


def test_analytic_curve_xpos_decays_where_rope_oscillates():
    rope, xpos = analytic_curve(64, 4096, "rope"), analytic_curve(64, 4096, "xpos")
    assert rope[0] == pytest.approx(1.0) and xpos[0] == pytest.approx(1.0)
    assert xpos[1000:].abs().max() < rope[1000:].abs().max()


def documents_glob(folder: Path, texts: list[str]) -> str:
    """`texts` written as doc0.txt, doc1.txt, ... in `folder`; the glob that matches them (`--files`)."""
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"doc{i}.txt").write_text(text)
    return f"{folder}/*.txt"


def test_eval_length_cli_writes_everything(folder, texts, tmp_path, capsys):
    out = tmp_path / "eval"
    assert lex(["eval-length", str(folder), "--files", documents_glob(tmp_path / "docs", texts), "--lengths", "8,16,64",
                "--attention_modes", "full,blockwise,sliding", "--output_dir", str(out), "--resolution",
                "--passkey"]) == 0
    printed, bars = capsys.readouterr()
    assert "token/s" in bars  # the progress bar counts tokens read
    assert "| model | attention | 8 | 16 | 64 |" in printed and "resolution" in printed and "passkey" in printed
    rows = json.loads((out / "results.json").read_text())
    assert {r["attention_mode"] for r in rows} == {"full", "blockwise", "sliding"} and len(rows) == 3 * 2 * 3
    assert (out / "results.csv").read_text().startswith("model,attention_mode,attention_sinks,protocol,length")
    for name in ("ppl_vs_length.png", "resolution.png", "resolution.json", "passkey.json"):
        assert (out / name).stat().st_size > 0, name



# ---------------------------------------------------------------- any causal LM folder: Llama, GPT-2, remote code


@pytest.fixture(scope="module")
def llama_folder(tokenizer, tmp_path_factory) -> Path:
    """A tiny Llama checkpoint (GQA, trained at l = 16) saved by transformers, with a BPE tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    perturb(LlamaForCausalLM(config), seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def masked_nll(path: Path, texts: list[str], budget: int, mask: torch.Tensor | None,
               sinks_in_cache: tuple[str, int, int] | None = None) -> float:
    """Perplexity of each text's first `budget` tokens read in one window by transformers' own class, under an
    explicit additive 4D mask (None: its causal mask), or with `sinks_in_cache` = (mode, w, S) under
    tests/reference.py's naive window attention with S sinks placed within the cache (a converted model's rule)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    if sinks_in_cache is not None:
        reference.use_window_attention(model, *sinks_in_cache)
    nll, count = 0.0, 0
    for text in texts:
        ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids[:budget]])
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits[0, :-1]
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += budget - 1
    return math.exp(nll / count)


def window_mask(mode: str, length: int, window: int, sinks: int) -> torch.Tensor:
    """DESIGN §3's windows with sinks as an additive (1, 1, n, n) mask, from tests/reference.py's rule."""
    allowed = reference.visible(mode, window, length, pad=0, sinks=sinks)
    return torch.zeros(length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]


def test_eval_length_on_a_llama_folder_reads_every_mode_with_and_without_sinks(llama_folder, texts, tmp_path,
                                                                              capsys):
    """Full attention is the checkpoint as published; sliding and blockwise (w = 8) with 0 and 4 sinks are the
    checkpoint converted in memory, each equal to transformers' Llama under that window's explicit 4D mask (with
    sinks: under tests/reference.py's window attention, the sinks placed within the cache)."""
    out = tmp_path / "eval"
    assert lex(["eval-length", str(llama_folder), "--files", documents_glob(tmp_path / "docs", texts), "--lengths", "8,48",
                "--attention_modes", "full,sliding,blockwise", "--attention_sinks", "0,4", "--attention_window", "8",
                "--protocols", "strided", "--output_dir", str(out), "--passkey", "--resolution"]) == 0
    printed = capsys.readouterr().out
    assert "| sliding + 4 sinks |" in printed and "| blockwise |" in printed
    rows = json.loads((out / "results.json").read_text())
    assert {(r["attention_mode"], r["attention_sinks"]) for r in rows} == {
        ("full", 0), ("sliding", 0), ("sliding", 4), ("blockwise", 0), ("blockwise", 4)}
    assert (out / "results.csv").read_text().startswith("model,attention_mode,attention_sinks,protocol,length")
    at_48 = {(r["attention_mode"], r["attention_sinks"]): r["ppl"] for r in rows if r["length"] == 48}
    assert at_48["full", 0] == pytest.approx(masked_nll(llama_folder, texts, 48, None), rel=1e-5)
    for mode in ("sliding", "blockwise"):
        for sinks in (0, 4):
            expected = masked_nll(llama_folder, texts, 48, window_mask(mode, 48, 8, 0)) if not sinks else \
                masked_nll(llama_folder, texts, 48, None, sinks_in_cache=(mode, 8, sinks))
            assert at_48[mode, sinks] == pytest.approx(expected, rel=1e-5), (mode, sinks)
    assert len({round(p, 6) for p in at_48.values()}) == 5  # the five readings differ at 6 windows
    passkey = json.loads((out / "passkey.json").read_text())
    assert {(r["attention_mode"], r["attention_sinks"]) for r in passkey} == set(at_48)
    (resolution_row,) = json.loads((out / "resolution.json").read_text())
    assert len(resolution_row["resolution_per_layer"]) == 2  # q k^T over 4 query heads and 2 KV heads


def test_eval_length_reads_sinks_by_both_position_rules(llama_folder, texts, tmp_path, capsys):
    """--attention_sink_positions cache,true: each reading with sinks once per rule, labelled with it; the cache rule
    equals transformers' Llama under the naive window attention with its sinks placed within the cache, the true
    rule the same Llama under the window's explicit 4D mask with its sinks visible (true distances)."""
    out = tmp_path / "eval"
    docs = documents_glob(tmp_path / "docs", texts)
    assert lex(["eval-length", str(llama_folder), "--files", docs, "--lengths", "48", "--attention_modes", "sliding",
                "--attention_sinks", "0,4", "--attention_window", "8", "--attention_sink_positions", "cache,true",
                "--protocols", "strided", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| sliding + 4 sinks (cache positions) |" in printed and "| sliding + 4 sinks (true positions) |" in printed
    rows = json.loads((out / "results.json").read_text())
    ppl = {(r["attention_sinks"], r.get("attention_sink_positions")): r["ppl"] for r in rows}
    assert set(ppl) == {(0, None), (4, "cache"), (4, "true")}
    assert ppl[4, "cache"] == pytest.approx(masked_nll(llama_folder, texts, 48, None, ("sliding", 8, 4)), rel=1e-5)
    assert ppl[4, "true"] == pytest.approx(masked_nll(llama_folder, texts, 48, window_mask("sliding", 48, 8, 4)),
                                           rel=1e-5)
    assert "attention_sink_positions" in (out / "results.csv").read_text().splitlines()[0]


def test_document_tokens_scores_shorter_lengths_on_the_tokens_of_a_longer_run(llama_folder, texts, tmp_path, capsys):
    """--document_tokens 48 with --lengths 8,16 scores the same 48 tokens per document as --lengths 8,16,48 does,
    so a model that cannot read the longest length is compared on the same tokens; fewer is refused by name."""
    docs = documents_glob(tmp_path / "docs", texts)
    rows = {}
    for name, extra in (("all", ["--lengths", "8,16,48"]), ("short", ["--lengths", "8,16", "--document_tokens", "48"])):
        assert lex(["eval-length", str(llama_folder), "--files", docs, "--attention_modes", "full", "--protocols",
                    "segments", "--output_dir", str(tmp_path / name), *extra]) == 0
        rows[name] = {r["length"]: (r["ppl"], r["tokens"]) for r in json.loads((tmp_path / name / "results.json")
                                                                               .read_text())}
    for length in (8, 16):
        assert rows["short"][length][1] == rows["all"][length][1]
        assert rows["short"][length][0] == pytest.approx(rows["all"][length][0], rel=1e-6)
    code = lex(["eval-length", str(llama_folder), "--files", docs, "--lengths", "8,48", "--document_tokens", "16",
                "--output_dir", str(tmp_path / "refused")])
    assert code == 2 and "--document_tokens 16 is shorter than the longest of --lengths, 48" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_eval_length_scores_a_gpt2_folder_as_published_and_says_which_modes_do_not_apply(tokenizer, texts, tmp_path,
                                                                                          capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64)
                    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    files = tmp_path / "doc.txt"
    files.write_text(texts[0])
    out = tmp_path / "eval"
    assert lex(["eval-length", str(folder), "--files", str(files), "--lengths", "8,16", "--attention_modes",
                "full,blockwise,sliding", "--attention_sinks", "0,4", "--output_dir", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "do not apply" in line]
    assert lines == ["gpt2: a 'gpt2' model is scored as published (full attention); blockwise, sliding do not "
                     "apply: only LEX models and llama, mistral, qwen2, qwen3, phi3, smollm3, gemma2, "
                     "gemma3_text checkpoints (converted in memory) take an attention mode"]
    rows = json.loads((out / "results.json").read_text())
    assert {(r["attention_mode"], r["attention_sinks"]) for r in rows} == {("full", 0)}
    assert rows[-1]["ppl"] == pytest.approx(masked_nll(folder, [texts[0]], 16, None), rel=1e-5)


def test_evaluating_a_converted_llama_does_not_grow_with_the_document(llama_folder):
    """Sliding + 4 sinks, w = 32 after conversion in memory: the largest tensor at 32w tokens is that at 2w."""
    from convert.hf import lex_from_hf
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(llama_folder).eval()
    model = lex_from_hf(source, attention_mode="sliding", attention_window=32, attention_sinks=4).eval()
    short, long = largest_tensor(model, 64), largest_tensor(model, 1024)
    assert long <= 1.02 * short


def test_a_model_loaded_through_remote_code_is_streamed(folder, tmp_path):
    """An exported folder's model class, as transformers imports it from the folder's code (where this package is
    not installed, trust_remote_code loads exactly that class): the evaluator reads it through its own cache,
    never with n x vocab logits, and scores it as the package's model does."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    exported = tmp_path / "exported"
    assert lex(["export", str(folder), str(exported)]) == 0
    auto_map = json.loads((exported / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    remote_class = get_class_from_dynamic_module(auto_map, str(exported))
    remote = remote_class.from_pretrained(exported, attention_mode="sliding").eval()
    assert not isinstance(remote, LexForCausalLM) and type(remote).__name__ == "LexForCausalLM"
    short, long = largest_tensor(remote, 64), largest_tensor(remote, 1024)
    assert long <= 1.02 * short and long < 1024 * remote.config.vocab_size * 4
    ours = LexForCausalLM.from_pretrained(folder, attention_mode="sliding").eval()
    document = torch.randint(0, ours.config.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    scores = [perplexity.perplexity_by_length(m, [document], [200], "strided")[200].nll for m in (remote, ours)]
    assert scores[0] == pytest.approx(scores[1], rel=1e-6)


# ---------------------------------------------------------------- the block memory past the window (issue 40)


@pytest.mark.parametrize("mode", ["blockwise", "sliding"])
def test_streamed_evaluation_with_a_block_memory_reads_w_tokens_a_forward(mode):
    """With attention_memory_blocks > 0 the evaluator reads each window through a LexCache in forwards of at most
    w tokens (the model refuses longer ones with memory), and scores what the model's own long forward gives (it
    reads w tokens at a time too); the memory changes the scores past the window."""
    torch.manual_seed(0)
    config = LexConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       max_position_embeddings=16, attention_mode=mode, attention_memory_blocks=2,
                       attention_memory_block_size=4)
    model = perturb(LexForCausalLM(config), seed=0).eval()
    lengths_read = []
    model.model.register_forward_pre_hook(lambda module, args, kwargs: lengths_read.append(kwargs["input_ids"].shape[1]),
                                          with_kwargs=True)
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(0, 300, (100,), generator=generator) for _ in range(2)]
    scores = perplexity.perplexity_by_length(model, documents, [16, 100], "segments", batch_size=2)
    assert lengths_read and max(lengths_read) <= 16
    for length in (16, 100):
        nll, count = full_logits_nll(model, documents, length, "segments")
        assert scores[length].tokens == count
        assert scores[length].nll == pytest.approx(nll, rel=1e-5), length
    config.attention_memory_blocks = 0
    plain = LexForCausalLM(config).eval()
    plain.load_state_dict(model.state_dict())
    without = perplexity.perplexity_by_length(plain, documents, [100], "segments", batch_size=2)
    assert without[100].nll != pytest.approx(scores[100].nll, rel=1e-4)


def test_eval_length_labels_rows_with_the_block_memory(llama_folder, texts, tmp_path, capsys):
    """--attention_memory_blocks 0,2 --attention_memory_block_size 4: one row per value for sliding and blockwise,
    full attention with 0 only, each labelled in results.json, results.csv and the printed tables."""
    out = tmp_path / "eval"
    assert lex(["eval-length", str(llama_folder), "--files", documents_glob(tmp_path / "docs", texts), "--lengths",
                "8,48", "--attention_modes", "full,sliding,blockwise", "--attention_window", "8",
                "--attention_memory_blocks", "0,2", "--attention_memory_block_size", "4", "--protocols", "strided",
                "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| sliding + memory 2x4 |" in printed and "| blockwise |" in printed and "| full |" in printed
    rows = json.loads((out / "results.json").read_text())
    readings = {(r["attention_mode"], r["attention_memory_blocks"], r.get("attention_memory_block_size")) for r in rows}
    assert readings == {("full", 0, None), ("sliding", 0, None), ("sliding", 2, 4), ("blockwise", 0, None),
                        ("blockwise", 2, 4)}
    header = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert "attention_memory_blocks" in header and "attention_memory_block_size" in header
    at_48 = {(r["attention_mode"], r["attention_memory_blocks"]): r["ppl"] for r in rows if r["length"] == 48}
    assert at_48["sliding", 2] != pytest.approx(at_48["sliding", 0], rel=1e-6)  # the memory is read past w


@pytest.mark.parametrize("args, message", [
    (["--attention_modes", "full", "--attention_memory_blocks", "16"], "--attention_memory_blocks 16 with "
                                                                       "--attention_modes full"),
    (["--attention_modes", "full,sliding", "--attention-memory-blocks", "0,-2"], "-2 must be >= 0"),
    (["--attention_memory_block_size", "8"], "give --attention_memory_blocks"),
])
def test_eval_length_refuses_a_memory_it_cannot_read_by_name(folder, tmp_path, capsys, args, message):
    assert lex(["eval-length", str(folder), "--output_dir", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lex eval-length: ") and message in err, err
    assert not (tmp_path / "out").exists()


def test_load_model_takes_the_block_memory_over_a_lex_folder(folder, llama_folder):
    """A LEX folder: the fields over its config; with full attention refused by name. A Llama folder: converted
    in memory when memory is asked for, refused by name in full attention."""
    from lex.models import ModelError, load_model

    model = load_model(str(folder), "sliding", attention_memory_blocks=3, attention_memory_block_size=8)
    assert (model.config.attention_memory_blocks, model.config.attention_memory_block_size) == (3, 8)
    assert load_model(str(folder), "sliding").config.attention_memory_blocks == 0
    with pytest.raises(ModelError, match="attention_memory_blocks=3 with attention_mode='full'"):
        load_model(str(folder), "full", attention_memory_blocks=3)
    converted = load_model(str(llama_folder), "blockwise", attention_window=8, attention_memory_blocks=2)
    assert converted.config.model_type == "lex" and converted.config.attention_memory_blocks == 2
    assert converted.config.attention_memory_block_size == LexConfig().attention_memory_block_size
    with pytest.raises(ModelError, match="attention_memory_blocks=2 with attention_mode 'full'"):
        load_model(str(llama_folder), "full", attention_memory_blocks=2)
    with pytest.raises(ModelError, match="attention_memory_blocks=2 with attention_mode='full'"):
        load_model(str(llama_folder), attention_memory_blocks=2)
