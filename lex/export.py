"""A Hub-ready folder of a LEX model, and its upload (`lex export MODEL_DIR OUT_DIR [--push_to_hub REPO_ID]`).

The folder holds config.json (with `auto_map`), model.safetensors (sharded above --max_shard_size),
generation_config.json, the tokenizer when the model has one, a model card (README.md) and the model code as
flat files (configuration_lex.py and every module of modeling_lex/) importing each other
relatively, so that

    AutoModelForCausalLM.from_pretrained(OUT_DIR_or_repo, trust_remote_code=True)

works where this package is not installed. The folder is written to a temporary sibling and moved into place
only when complete; exporting twice gives identical files. --push_to_hub then uploads exactly that folder as
one commit (files in the repository that the folder lacks are deleted; --dry_run only lists the commit).

From Python: `export(model_or_dir, out_dir)` then `push_to_hub(out_dir, repo_id)`.
"""

import ast
import importlib.util
import json
import pkgutil
import re
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedModel
from transformers.utils.hub import convert_file_size_to_int

from lex_base.errors import LexError
from lex_base.staging import atomic_directory
import modeling_lex
from modeling_lex import LexForCausalLM

from .models import has_tokenizer, model_config, saved_for_generation
from .report import length_table, markdown_table

AUTO_MAP = {
    "AutoConfig": "configuration_lex.LexConfig",
    "AutoModel": "modeling_lex.LexModel",
    "AutoModelForCausalLM": "modeling_lex.LexForCausalLM",
}
# Every module of the two packages the remote code needs, and its flat file name. An import of any other
# module of this project fails the export, so an edit cannot silently produce a folder that does not load.
# Every module of the model, as a flat file of the exported folder (a module added to modeling_lex/ comes along).
FLAT_MODULES = {"configuration_lex.configuration_lex": "configuration_lex"} | {
    f"modeling_lex.{info.name}": info.name for info in pkgutil.iter_modules(modeling_lex.__path__)
}
PROJECT_PACKAGES = ("configuration_lex", "modeling_lex", "lex", "convert", "lex_base")
CARD_TAGS = ("lex", "xpos", "length-extrapolation", "custom_code")
LICENSE_ID = re.compile(r"^[a-z0-9][a-z0-9.+-]*$")


class ExportError(LexError):
    """A model, folder or option that cannot be exported; raised before OUT_DIR is touched."""


def flat_source(module: str) -> str:
    """The source of `module` (a key of FLAT_MODULES) ready to be a flat remote-code file."""
    path = Path(importlib.util.find_spec(module).origin)
    return flatten(path.read_text(encoding="utf-8"), module.rpartition(".")[0], str(path))


def flatten(text: str, package: str, origin: str) -> str:
    """`text`, a module of `package`, with its imports of the project rewritten to flat relative ones.

    transformers fetches remote code by following `from .name import` lines (dynamic_module_utils.
    get_relative_imports): only single-dot imports of sibling files work, so every project import becomes one.
    """
    lines = text.splitlines(keepends=True)
    for node in ast.walk(ast.parse(text, filename=origin)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT_PACKAGES:
                    raise ExportError(f"{origin}:{node.lineno}: `import {alias.name}` cannot be flattened; "
                                      "use `from MODULE import NAME` with a module of FLAT_MODULES in lex/export.py")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module.split(".")[0] not in PROJECT_PACKAGES:
                continue
            if node.level == 0:
                target = node.module
            elif node.level == 1 and node.module:
                target = f"{package}.{node.module}"
            else:
                target = None
            written = "from " + "." * node.level + (node.module or "")
            line = lines[node.lineno - 1]
            if target not in FLAT_MODULES or not line[node.col_offset :].startswith(written + " "):
                raise ExportError(f"{origin}:{node.lineno}: {line.strip()!r} imports something the flat export "
                                  f"does not map; import from one of {', '.join(FLAT_MODULES)} (FLAT_MODULES in "
                                  "lex/export.py)")
            start = node.col_offset
            lines[node.lineno - 1] = f"{line[:start]}from .{FLAT_MODULES[target]}{line[start + len(written):]}"
    return "".join(lines)


def load_results(path: Path) -> list[dict]:
    """Records with `length` and `ppl` (and optionally model, attention_mode, protocol) from a results file.

    Reads what `lex eval-length` and `lex demo` write: a list of records (results.json) or {"rows": [...]}
    (study.json).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ExportError(f"--results {path}: cannot read it as JSON ({error})") from error
    if isinstance(data, dict):
        data = data.get("rows")
    records = [r for r in data if isinstance(r, dict) and isinstance(r.get("length"), int)
               and isinstance(r.get("ppl"), (int, float))] if isinstance(data, list) else []
    if not records:
        raise ExportError(f"--results {path}: expected a list of records with 'length' and 'ppl' "
                          "(the results.json of `lex eval-length`)")
    return records


def model_card(config, parameters: int, repo_name: str, license_name: str, has_tokenizer: bool,
               results: str | None) -> str:
    """README.md: Hub metadata in YAML front matter, what the model is, how to load it, its perplexity table."""
    mode, window, length = config.attention_mode, config.attention_window, config.max_position_embeddings
    attention = {
        "blockwise": f"blockwise causal (BCA): blocks of {window // 2} tokens, a token sees its block and the "
                     f"previous one (at most {window} keys)",
        "sliding": f"sliding window: a token sees the last {window} keys",
        "full": "full causal attention",
    }[mode]
    if mode == "full":
        long_inputs = ("Attention here is full: for inputs longer than the training length load the model with "
                       '`attention_mode="blockwise"` (a config override), which reads any length in '
                       f"O(n·{window}) memory.")
    else:
        sinks = config.attention_sinks
        plus = f" plus the document's first {sinks} tokens (attention sinks)" if sinks else ""
        long_inputs = (f"Inputs may be far longer than the training length: attention only ever looks at {window} "
                       f"keys{plus}, and `generate()` keeps a cache of at most {window - 1 + sinks} positions per "
                       "layer.")
    load = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            f'model = AutoModelForCausalLM.from_pretrained("{repo_name}", trust_remote_code=True)']
    if has_tokenizer:
        load += [f'tokenizer = AutoTokenizer.from_pretrained("{repo_name}")',
                 'ids = tokenizer("In the beginning", return_tensors="pt").input_ids',
                 "print(tokenizer.decode(model.generate(ids, max_new_tokens=50)[0]))"]
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        f"license: {license_name}",
        "tags:",
        *[f"- {tag}" for tag in CARD_TAGS],
        "---",
        "",
        f"# {repo_name}",
        "",
        'A LEX Transformer ("A Length-Extrapolatable Transformer", Sun et al. 2022): a decoder-only language '
        f"model with {config.position_embedding_type} positions and {mode} attention.",
        "",
        markdown_table(["", ""], [
            ["training length", f"{length} tokens"],
            ["attention mode", mode],
            ["attention window", f"{window} tokens"],
            ["attention sinks", str(config.attention_sinks)],
            ["position embedding", config.position_embedding_type],
            ["parameters", f"{parameters:,}"],
            ["layers / hidden / heads",
             f"{config.num_hidden_layers} / {config.hidden_size} / {config.num_attention_heads}"],
        ]),
        "",
        f"Attention: {attention}. {long_inputs}",
        "",
        "## How to load",
        "",
        "The model code ships with the weights (`trust_remote_code=True`); it needs torch and transformers 5.",
        "",
        "```python",
        *load,
        "```",
    ]
    if results:
        lines += ["", "## Perplexity by evaluation length", "",
                  f"Trained on {length}-token sequences; evaluated at the lengths below (`lex eval-length`).", "",
                  results]
    return "\n".join(lines) + "\n"


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def export(model, out_dir: str | Path, *, tokenizer=None, results: str | Path | None = None,
           license_name: str = "mit", max_shard_size: str | int = "2GB", repo_name: str | None = None,
           force: bool = False) -> Path:
    """Write the Hub-ready folder for a LEX model (a model folder or a LexForCausalLM); returns OUT_DIR.

    The tokenizer and the results file default to those in the model folder (tokenizer files, results.json).
    `repo_name` is the name the card's loading snippet uses (default: the folder's name).
    """
    out_dir = Path(out_dir).resolve()
    if not LICENSE_ID.match(license_name):
        raise ExportError(f"--license {license_name!r}: use a Hub license id such as mit, apache-2.0 or other")
    try:
        convert_file_size_to_int(max_shard_size)
    except ValueError as error:
        raise ExportError(f"--max_shard_size {max_shard_size!r}: use bytes or a size such as 500MB or 5GB") from error
    model_dir = None
    if not isinstance(model, PreTrainedModel):
        model_dir = Path(model).resolve()
        if _is_within(model_dir, out_dir):
            raise ExportError(f"OUT_DIR {out_dir} would replace the model folder {model_dir}; choose another")
        model_type = model_config(model_dir, "MODEL_DIR").model_type
        if model_type != "lex":
            raise ExportError(f"{model_dir} holds a {model_type!r} model; lex export writes LEX models only")
        model = LexForCausalLM.from_pretrained(model_dir)
        if tokenizer is None and has_tokenizer(model_dir):
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if results is None and (model_dir / "results.json").is_file():
            results = model_dir / "results.json"
    elif model.config.model_type != "lex":
        raise ExportError(f"the model is a {model.config.model_type!r} model; lex export writes LEX models only")
    table = length_table(load_results(Path(results))) if results is not None else None
    sources = {f"{flat}.py": flat_source(module) for module, flat in FLAT_MODULES.items()}
    parameters = sum(p.numel() for p in model.parameters())
    card = model_card(model.config, parameters, repo_name or out_dir.name, license_name, tokenizer is not None,
                      table)

    previous_auto_map = getattr(model.config, "auto_map", None)
    model.config.auto_map = dict(AUTO_MAP)
    try:
        with saved_for_generation(model.config), atomic_directory(out_dir, force) as staging:
            model.save_pretrained(staging, max_shard_size=max_shard_size)
            for name, text in sources.items():
                (staging / name).write_text(text, encoding="utf-8")
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            (staging / "README.md").write_text(card, encoding="utf-8")
    finally:
        model.config.auto_map = previous_auto_map
    return out_dir


def folder_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, dry_run: bool = False,
                commit_message: str | None = None, token: str | None = None) -> str:
    """Upload exactly the exported folder to `repo_id` as one commit; with `dry_run`, describe it and touch nothing.

    Files of the repository that the folder lacks (a stale shard of an earlier export) are deleted in the same
    commit, so the repository ends up equal to the folder; .gitattributes is kept.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ExportError(f"--push_to_hub {repo_id!r}: {error}") from error
    folder = Path(folder)
    files = folder_files(folder)
    if "config.json" not in files or "README.md" not in files:
        raise ExportError(f"{folder} is not an exported folder (no config.json or README.md); run lex export first")
    message = commit_message or f"Upload LEX model with lex export ({len(files)} files)"
    if dry_run:
        return "\n".join([f"dry run: would create {'private ' if private else ''}model repo {repo_id} if needed "
                          f"and commit {message!r}, adding:", *[f"  {name}" for name in files],
                          "and deleting any other file of the repository (except .gitattributes)"])
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    stale = sorted(set(api.list_repo_files(repo_id, repo_type="model")) - set(files) - {".gitattributes"})
    operations = [CommitOperationDelete(path_in_repo=name) for name in stale]
    operations += [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in files]
    info = api.create_commit(repo_id, operations, commit_message=message, repo_type="model")
    return f"pushed {len(files)} files to {repo_id} (deleted {len(stale)} stale): {info.commit_url}"
