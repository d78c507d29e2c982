"""`lex export MODEL_DIR OUT_DIR [--push-to-hub REPO_ID] [--private] [--dry-run]`: a Hub-ready folder.

The folder holds config.json (with `auto_map`), model.safetensors (sharded above --max-shard-size),
generation_config.json, the tokenizer when the model has one, a model card, and the model code as flat files
(configuration_lex.py, xpos.py, attention.py, cache.py, modeling_lex.py) importing each other relatively, so

    AutoModelForCausalLM.from_pretrained(OUT_DIR_or_repo, trust_remote_code=True)

works where this package is not installed. The folder is written to a temporary sibling and moved into place
only when complete; exporting twice gives identical files.
"""

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_FILES = {
    "configuration_lex.py": ROOT / "configuration_lex" / "configuration_lex.py",
    "xpos.py": ROOT / "modeling_lex" / "xpos.py",
    "attention.py": ROOT / "modeling_lex" / "attention.py",
    "cache.py": ROOT / "modeling_lex" / "cache.py",
    "modeling_lex.py": ROOT / "modeling_lex" / "modeling_lex.py",
}
# Imports between the two packages, rewritten for the flat layout; relative imports inside modeling_lex stay.
IMPORT_REWRITES = {
    "from configuration_lex.configuration_lex import LexConfig": "from .configuration_lex import LexConfig",
}
AUTO_MAP = {
    "AutoConfig": "configuration_lex.LexConfig",
    "AutoModel": "modeling_lex.LexModel",
    "AutoModelForCausalLM": "modeling_lex.LexForCausalLM",
}
PACKAGE_IMPORT = re.compile(r"^\s*(from|import)\s+(configuration_lex|modeling_lex|lex|convert)\b", re.MULTILINE)


class ExportError(ValueError):
    pass


def flat_source(name: str) -> str:
    """A code file with its cross-package imports made relative; any other package import is an error."""
    text = CODE_FILES[name].read_text(encoding="utf-8")
    for old, new in IMPORT_REWRITES.items():
        text = text.replace(old, new)
    leftover = PACKAGE_IMPORT.search(text)
    if leftover:
        line = text[leftover.start() : text.index("\n", leftover.start())].strip()
        raise ExportError(f"{CODE_FILES[name]} imports the package in a way the flat export cannot map: {line!r}")
    return text


def results_table(model_dir: Path) -> str | None:
    """A markdown table of perplexity by length from a `lex eval-length` results.json in the model folder."""
    path = model_dir / "results.json"
    if not path.is_file():
        return None
    from .eval_length import table

    rows = json.loads(path.read_text())
    return table(rows, "segments") if rows else None


def model_card(config, parameters: int, repo_name: str, license_name: str, results: str | None) -> str:
    mode, window = config.attention_mode, config.attention_window
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        f"license: {license_name}",
        "tags:",
        "- lex",
        "- xpos",
        "- length-extrapolation",
        "- custom_code",
        "---",
        "",
        f"# {repo_name}",
        "",
        'A LEX Transformer ("A Length-Extrapolatable Transformer", Sun et al. 2022): '
        f"{config.position_embedding_type} positions with {mode} attention.",
        "",
        "| | |",
        "|---|---|",
        f"| training length | {config.max_position_embeddings} tokens |",
        f"| attention mode | {mode} |",
        f"| attention window | {window} tokens (blocks of {window // 2}) |",
        f"| position embedding | {config.position_embedding_type} |",
        f"| parameters | {parameters:,} |",
        f"| layers / hidden / heads | {config.num_hidden_layers} / {config.hidden_size} / {config.num_attention_heads} |",
        "",
        "Inputs may be far longer than the training length: blockwise and sliding attention only ever look at "
        f"{window} keys, and generate() keeps a cache of at most {window} positions per layer.",
        "",
        "## How to load",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_name}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_name}")',
        'ids = tokenizer("In the beginning", return_tensors="pt").input_ids',
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=50)[0]))",
        "```",
    ]
    if results:
        lines += ["", "## Perplexity by evaluation length", "", results]
    return "\n".join(lines) + "\n"


def export(model_dir: str | Path, out_dir: str | Path, *, license_name: str = "mit", max_shard_size: str = "2GB",
           repo_name: str | None = None, force: bool = False) -> Path:
    """Write the Hub-ready folder for a LEX model folder; returns OUT_DIR."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modeling_lex  # noqa: F401

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists() and not force:
        raise ExportError(f"{out_dir} exists; pass --force to replace it")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if model.config.model_type != "lex":
        raise ExportError(f"{model_dir} holds a {model.config.model_type!r} model, not a LEX model")
    model.config.auto_map = dict(AUTO_MAP)
    sources = {name: flat_source(name) for name in CODE_FILES}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        for name, text in sources.items():
            (staging / name).write_text(text, encoding="utf-8")
        if (model_dir / "tokenizer_config.json").is_file():
            AutoTokenizer.from_pretrained(model_dir).save_pretrained(staging)
        parameters = sum(p.numel() for p in model.parameters())
        card = model_card(model.config, parameters, repo_name or out_dir.name, license_name, results_table(model_dir))
        (staging / "README.md").write_text(card, encoding="utf-8")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


def push(folder: Path, repo_id: str, private: bool, dry_run: bool, api=None) -> str:
    """Upload exactly the exported folder as one commit (or, with dry_run, say what would be uploaded)."""
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    message = f"Upload LEX model ({len(files)} files) with lex export"
    if dry_run:
        return "\n".join([f"dry run: would create {'private ' if private else ''}repo {repo_id} and commit "
                          f"{message!r} with:"] + [f"  {f}" for f in files])
    from huggingface_hub import HfApi

    api = api or HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message=message)
    return f"pushed {len(files)} files to {repo_id}: {getattr(info, 'commit_url', info)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lex export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the folder to this Hub repository")
    parser.add_argument("--private", action="store_true", help="create the Hub repository as private")
    parser.add_argument("--dry-run", action="store_true", help="list what --push-to-hub would upload; no network")
    parser.add_argument("--license", default="mit", help="license field of the model card")
    parser.add_argument("--max-shard-size", default="2GB", help="shard model.safetensors above this size")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    args = parser.parse_args(argv)
    try:
        folder = export(args.model_dir, args.out_dir, license_name=args.license, max_shard_size=args.max_shard_size,
                        repo_name=args.push_to_hub, force=args.force)
    except (ExportError, OSError) as error:
        print(f"lex export: {error}", file=sys.stderr)
        return 2
    print(f"exported {folder}")
    if args.push_to_hub:
        print(push(folder, args.push_to_hub, args.private, args.dry_run))
    return 0
