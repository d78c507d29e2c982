"""`lex COMMAND ...`: one entry point; each command's main lives in lex/commands/ and is imported on demand."""

import importlib
import sys

COMMANDS = {
    "demo": ("lex.commands.demo", "main", "train xpos/rope/alibi at a short length and compare them far beyond it"),
    "train": ("lex.commands.train", "main", "train or fine-tune with the HF Trainer (run_clm-style arguments)"),
    "eval-length": ("lex.commands.eval_length", "main", "perplexity by evaluation length, resolution, passkey"),
    "generate": ("lex.commands.generate", "main", "generate from a long prompt with the bounded cache"),
    "convert-torchscale": ("lex.commands.convert", "main_from_torchscale", "TorchScale checkpoint -> HF folder"),
    "convert-to-torchscale": ("lex.commands.convert", "main_to_torchscale", "HF folder -> TorchScale state dict"),
    "convert-hf": ("lex.commands.convert_hf", "main_convert_hf", "Llama / Mistral / Qwen2 folder -> LEX folder"),
    "convert-to-hf": ("lex.commands.convert_hf", "main_convert_to_hf", "LEX folder (rope) -> Llama / Mistral / Qwen2"),
    "export": ("lex.commands.export", "main", "a Hub-ready folder loadable with trust_remote_code"),
}


def usage() -> str:
    lines = ["usage: lex COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<22} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "lex COMMAND --help shows a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lex: unknown command {name!r}; one of {', '.join(COMMANDS)}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function_name, _ = COMMANDS[name]
    function = getattr(importlib.import_module(module_name), function_name)
    return function(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
