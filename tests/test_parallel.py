"""Past one device: a LEX model loaded as transformers users load one across devices (`from_pretrained(...,
tp_plan="auto")` under torchrun, gloo on CPU), against one process (the reference: the same folders read without
tensor parallel), for full attention, sliding + 4 sinks, and sliding + 4 sinks + the block memory.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from convert.hf import lex_from_hf
from modeling_lex import LexForCausalLM
from tests.helpers import gemma3_source, perturb
from tests.parallel_gloo import NEW_TOKENS, READINGS, reading

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
WINDOW = 16
MEMORY = dict(attention_sinks=4, attention_memory_blocks=3, attention_memory_block_size=4)
FIELDS = {"full": dict(attention_mode="full"),
          "sliding_sinks": dict(attention_mode="sliding", attention_window=WINDOW, attention_sinks=4),
          "sliding_sinks_memory": dict(attention_mode="sliding", attention_window=WINDOW, **MEMORY),
          "blockwise_sinks_memory": dict(attention_mode="blockwise", attention_window=WINDOW, **MEMORY),
          "gemma3_sliding_sinks_memory": dict(attention_mode="sliding", attention_window=WINDOW, **MEMORY)}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A Llama with 4 query and 2 key/value heads (each of 2 ranks holds 2 and 1), every parameter perturbed."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=WINDOW)
    return perturb(LlamaForCausalLM(config).eval(), seed)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """The three folders and a prompt of 60 tokens (past the window: spans, evictions, memory choices)."""
    workdir = tmp_path_factory.mktemp("parallel")
    for name, fields in FIELDS.items():
        source = gemma3_source() if name.startswith("gemma3") else tiny_llama()
        lex_from_hf(source, **fields).save_pretrained(workdir / name)
    torch.save(torch.randperm(96, generator=torch.Generator().manual_seed(5))[None, :60] + 1, workdir / "prompt.pt")
    return workdir


def run_script(workdir: Path, mode: str, *readings: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(ROOT / "tests" / "parallel_gloo.py"), str(workdir), mode, *readings]
    return subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)


def launch(workdir: Path, mode: str, *readings: str) -> tuple[Path, list[dict], list[dict]]:
    """`torchrun --nproc_per_node 2 tests/parallel_gloo.py WORKDIR MODE [READING ...]`: each rank's summary and
    tensors."""
    run = run_script(workdir, mode, *readings)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = sorted(workdir.glob(f"{mode}[0-9].json"))
    summaries = [json.loads(path.read_text()) for path in ranks]
    tensors = [torch.load(path.with_suffix(".pt"), weights_only=True) for path in ranks]
    return workdir, summaries, tensors


@pytest.fixture(scope="module")
def launched(folders) -> tuple[Path, list[dict], list[dict]]:
    return launch(folders, "tp")


@pytest.mark.slow
@pytest.mark.parametrize("name", READINGS)
def test_a_model_sharded_over_two_processes_reads_as_one(launched, name):
    """Each rank holds its share of q_proj's rows and of the cache's keys and values (the world size read from the
    ranks); the logits are one process's within 1e-5, the 16 greedy tokens equal, and with the block memory every
    rank chooses the blocks one process chooses: a Llama converted to full, sliding + 4 sinks, sliding or blockwise
    + 4 sinks + a memory, and a Gemma 3 (local layers with their own window, q/k norms) with sinks and a memory."""
    workdir, summaries, tensors = launched
    world = summaries[0]["world_size"]
    assert world == 2 and len(summaries) == world
    single = reading(LexForCausalLM.from_pretrained(workdir / name).eval(),
                     torch.load(workdir / "prompt.pt", weights_only=True))
    for summary, logits in zip(summaries, tensors):
        share = summary[name]
        assert share["q_proj_rows"] * world == share["q_proj_rows_in_all"] == (4 * 8 if "gemma3" in name else 4 * 16)
        assert share["cache_bytes"] * world == single["cache_bytes"]
        torch.testing.assert_close(logits[name], single["logits"], atol=1e-5, rtol=0)
        assert share["tokens"] == single["tokens"].tolist()
        assert share["blocks"] == single["blocks"]
    if name.endswith("memory"):  # every layer chose (Gemma 3: its 2 global layers), 3 blocks each
        assert len(single["blocks"]) == (2 if "gemma3" in name else 3)
        assert all(len(row[0]) == 3 for row in single["blocks"].values())


def torchrun(processes: int, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                           "--master_port", str(free_port()), "-m", "lex.cli", *command],
                          env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_lex_commands_shard_a_folder_over_torchrun_and_speak_once(launched, tmp_path, lex_run):
    """`torchrun --nproc_per_node 2 -m lex.cli generate FOLDER ... --tp_plan auto` continues the prompt as one
    process does and prints it once; `eval-length ... --tp_plan auto` scores what one process scores and writes its
    results once; 3 processes over 4 query and 2 key/value heads are refused by name, with the numbers allowed."""
    from tests.helpers import word_tokenizer

    workdir, _, _ = launched
    folder = workdir / "sliding_sinks_memory"
    tokenizer, words = word_tokenizer()
    tokenizer.save_pretrained(folder)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(" ".join(words[(7 * i) % 96] for i in range(50)))
    prompt = ["--prompt_file", str(tmp_path / "docs" / "a.txt"), "--max_new_tokens", "12", "--no_progress"]
    status, alone, _ = lex_run("generate", str(folder), *prompt)
    assert status == 0
    sharded = torchrun(2, "generate", str(folder), *prompt, "--tp_plan", "auto")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert sharded.stdout.split() == alone.split() and len(alone.split()) == 12
    assert sharded.stderr.count("read the prompt and generated 12 tokens") == 1

    scores = ["--files", str(tmp_path / "docs" / "a.txt"), "--lengths", "48", "--protocols", "segments",
              "--attention_modes", "sliding"]
    assert lex_run("eval-length", str(folder), *scores, "--output_dir", str(tmp_path / "alone"))[0] == 0
    sharded = torchrun(2, "eval-length", str(folder), *scores, "--output_dir", str(tmp_path / "sharded"),
                       "--tp_plan", "auto")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert sharded.stdout.count("wrote ") == 1
    ppl = [json.loads((tmp_path / run / "results.json").read_text())[0]["ppl"] for run in ("alone", "sharded")]
    assert ppl[1] == pytest.approx(ppl[0], rel=1e-5)

    refused = torchrun(3, "generate", str(folder), *prompt, "--tp_plan", "auto")
    assert refused.returncode != 0
    assert refused.stderr.count("lex generate: --tp_plan over 3 processes") == 1
    assert "4 query and 2 key/value heads, which 3 does not divide (allowed numbers of processes: 1, 2)" in \
        refused.stderr


@pytest.mark.slow
def test_a_pipeline_of_two_stages_reads_as_one_process(folders):
    """`DistributedConfig(pp_size=2)`: each rank holds the layers of its stage (the world size read from the ranks),
    and both return one process's logits (within 1e-5) and greedy tokens, for full attention and for sliding + 4
    sinks (a prompt read in spans past the window); the block memory is refused by name (a layer chooses by the
    scores of the layers below it, which the other stage holds)."""
    _, summaries, tensors = launch(folders, "pp", "full", "sliding_sinks")
    assert summaries[0]["world_size"] == 2 and len(summaries) == 2
    assert [summary["full"]["layers"] for summary in summaries] == [[0, 1], [2]]
    ids = torch.load(folders / "prompt.pt", weights_only=True)
    for name in ("full", "sliding_sinks"):
        model = LexForCausalLM.from_pretrained(folders / name).eval()
        with torch.no_grad():
            logits = model(ids).logits
            tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                    eos_token_id=None)[:, ids.shape[1]:]
        for summary, stage in zip(summaries, tensors):
            torch.testing.assert_close(stage[name], logits, atol=1e-5, rtol=0)
            assert summary[name]["tokens"] == tokens.tolist()
    refused = run_script(folders, "pp", "sliding_sinks_memory")
    assert refused.returncode != 0
    assert "LexConfig.attention_memory_blocks=3 with pipeline parallel (pp_size=2)" in refused.stderr


@pytest.mark.parametrize("fields, distributed, message", [
    (dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72), dict(tp_size=2, pp_size=1),
     r"num_attention_heads=9 and num_key_value_heads=3 with tensor parallel \(tp_size=2\).*allowed: 1, 3"),
    (dict(subln=True), dict(tp_size=2, pp_size=1), r"subln=True with tensor parallel \(tp_size=2\)"),
    (dict(position_embedding_type="alibi"), dict(tp_size=2, pp_size=1),
     r"position_embedding_type='alibi' with tensor parallel .*allowed: xpos, rope, decay, none, sinusoidal"),
    (dict(attention_mode="sliding", attention_memory_blocks=2), dict(tp_size=1, pp_size=2),
     r"attention_memory_blocks=2 with pipeline parallel \(pp_size=2\)"),
    (dict(embedding_scale=8.0), dict(tp_size=1, pp_size=2), r"embedding_scale=8.0.*with pipeline parallel"),
])
def test_what_a_split_cannot_compute_is_refused_by_name(fields, distributed, message):
    """As transformers sets it on a model it shards (`config.distributed_config`), checked at the first forward on
    every rank: uneven heads, a norm or a bias over every head (tensor parallel), the memory's choice across stages
    and embeddings changed after the lookup (pipeline parallel)."""
    from types import SimpleNamespace

    from tests.helpers import tiny_config

    model = LexForCausalLM(tiny_config(**{"num_attention_heads": 4, "num_key_value_heads": 2, **fields})).eval()
    model.config.distributed_config = SimpleNamespace(**distributed)
    with pytest.raises(ValueError, match=message):
        model(torch.tensor([[1, 2, 3]]))
