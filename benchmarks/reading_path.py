"""How far one decoded token travels through the package: the file crossings of one decoding step with the block
memory, before the layers, per layer and after them, and the modules it enters.

A crossing is a call into a file of modeling_lex/ or configuration_lex/ whose nearest caller in those folders is
another of their files (frames of torch, transformers and the standard library in between are looked through, so a
Module call from modeling_lex.py into modeling_lex.py is no crossing, and generate()'s call of the model is none).
The phases are split by forward hooks on the first and the last decoder layer.

The model: a tiny RoPE model (random weights; the path does not depend on them), sliding w = --window with
--sinks sinks at cache positions, a block memory of --memory_blocks blocks of --memory_block_size tokens,
--layers layers, 4 query heads over 2 key/value heads. It reads --context tokens through a LexCache, then decodes
tokens one forward at a time; the traced step is the next one, which chooses blocks if a block completed at the
token before it (`--choosing`), else reads the choice of the last step that chose.

    python benchmarks/reading_path.py [--context 87] [--choosing] [--output reading_path.json]
"""

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

from common import write_output

from configuration_lex import LexConfig
from modeling_lex import LexCache, LexForCausalLM

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (ROOT / "modeling_lex", ROOT / "configuration_lex")


def package_file(filename: str) -> str | None:
    """`filename` relative to the repository, where it lies in one of PACKAGES; else None."""
    path = Path(filename)
    return str(path.relative_to(ROOT)) if any(folder in path.parents for folder in PACKAGES) else None


def nearest_package_caller(frame) -> str | None:
    """The file of the nearest frame above `frame` that lies in PACKAGES (None: the call came from outside)."""
    caller = frame.f_back
    while caller is not None:
        name = package_file(caller.f_code.co_filename)
        if name is not None:
            return name
        caller = caller.f_back
    return None


class Trace:
    """Crossings counted by phase (`before`, `layers`, `after`) and the package files entered."""

    def __init__(self) -> None:
        self.phase = "before"
        self.crossings: Counter = Counter()
        self.edges: Counter = Counter()
        self.entered: set[str] = set()

    def __call__(self, frame, event: str, argument) -> None:
        if event != "call":
            return
        callee = package_file(frame.f_code.co_filename)
        if callee is None:
            return
        self.entered.add(callee)
        caller = nearest_package_caller(frame)
        if caller is not None and caller != callee:
            self.crossings[self.phase] += 1
            self.edges[(self.phase, caller, callee, frame.f_code.co_name)] += 1


def tiny_model(args: argparse.Namespace) -> LexForCausalLM:
    config = LexConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, position_embedding_type="rope", attention_mode="sliding",
        attention_window=args.window, attention_sinks=args.sinks, attention_sink_positions="cache",
        attention_memory_blocks=args.memory_blocks, attention_memory_block_size=args.memory_block_size,
        norm_type="rmsnorm", mlp_type="gated", hidden_act="silu",
    )
    torch.manual_seed(0)
    return LexForCausalLM(config).eval()


@torch.no_grad()
def trace_one_step(args: argparse.Namespace) -> dict:
    model = tiny_model(args)
    cache = LexCache(model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context + args.memory_block_size + 1))
    model(ids[:, : args.context], cache=cache)
    step = args.context
    # to a step that chooses (the evicted tokens completed a block at the step before it: the memory has a block
    # more than at the last choice) or to one that does not
    while ((cache.seen - cache.held) % args.memory_block_size == 0) != args.choosing:
        model(ids[:, step : step + 1], cache=cache)
        step += 1
    trace = Trace()
    layers = model.model.layers
    layers[0].register_forward_pre_hook(lambda *_: setattr(trace, "phase", "layers"))
    layers[-1].register_forward_hook(lambda *_: setattr(trace, "phase", "after"))
    sys.setprofile(trace)
    try:
        model(ids[:, step : step + 1], cache=cache)
    finally:
        sys.setprofile(None)
    return {
        "tokens_seen_before_the_step": step,
        "chooses": args.choosing,
        "layers": args.layers,
        "before_the_layers": trace.crossings["before"],
        "per_layer": trace.crossings["layers"] / args.layers,
        "after_the_layers": trace.crossings["after"],
        "modules_entered": sorted(trace.entered),
        "crossings": [{"phase": phase, "from": caller, "to": callee, "function": name, "calls": count}
                      for (phase, caller, callee, name), count in sorted(trace.edges.items())],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=87, help="tokens read before the traced step")
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--memory_blocks", type=int, default=2)
    parser.add_argument("--memory_block_size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--choosing", action="store_true", help="trace a step that chooses blocks")
    parser.add_argument("--output", type=Path, help="write the figures as JSON here too")
    args = parser.parse_args()
    result = trace_one_step(args)
    print(f"one decoded token after {result['tokens_seen_before_the_step']} tokens "
          f"({'chooses blocks' if result['chooses'] else 'reads the last choice'}), {args.layers} layers:")
    print(f"  crossings before the layers {result['before_the_layers']}, per layer {result['per_layer']:g}, "
          f"after the layers {result['after_the_layers']}; modules entered {len(result['modules_entered'])}")
    for phase in ("before", "layers", "after"):
        for edge in result["crossings"]:
            if edge["phase"] == phase:
                print(f"  {phase:7} {edge['from']} -> {edge['to']}: {edge['function']} x{edge['calls']}")
    write_output(args, result)


if __name__ == "__main__":
    main()
