"""A Hub-ready folder of a LEX model, and its upload (`lex export MODEL_DIR OUT_DIR [--push_to_hub REPO_ID]`).

The folder holds config.json (with `auto_map`), model.safetensors (sharded above --max_shard_size),
generation_config.json, the tokenizer when the model has one, a model card (README.md, lex.model_card: the
base_model and license of MODEL_DIR's own card are kept) and the model code as
flat files (configuration_lex.py and every module of modeling_lex/) importing each other
relatively, so that

    AutoModelForCausalLM.from_pretrained(OUT_DIR_or_repo, trust_remote_code=True)

works where this package is not installed. Its config names `AutoModelForCausalLM` as its architecture, which
finds the class through `auto_map`: transformers serve (5.23-5.25) loads a model as
`getattr(transformers, config.architectures[0])`, so `transformers serve OUT_DIR --trust-remote-code` serves the
folder (the class's own name, LexForCausalLM, is no attribute of transformers). The folder is written to a
temporary sibling and moved into place only when complete; exporting twice gives identical files. --push_to_hub
then uploads exactly that folder as one commit (files in the repository that the folder lacks are deleted;
--dry_run only lists the commit).

From Python: `export(model_or_dir, out_dir)` then `push_to_hub(out_dir, repo_id)`.
"""

import ast
import importlib.util
from fnmatch import fnmatch
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

from .model_card import CARD_FILE, Origin, card_metadata, model_card
from .models import has_tokenizer, model_config, saved_for_generation
from .report import length_table

AUTO_MAP = {
    "AutoConfig": "configuration_lex.LexConfig",
    "AutoModel": "modeling_lex.LexModel",
    "AutoModelForCausalLM": "modeling_lex.LexForCausalLM",
}
# config.json's `architectures`: a class of transformers that loads the folder through AUTO_MAP (see above).
ARCHITECTURES = ["AutoModelForCausalLM"]
# Every module of the two packages the remote code needs, and its flat file name. An import of any other
# module of this project fails the export, so an edit cannot silently produce a folder that does not load.
# Every module of the model, as a flat file of the exported folder (a module added to modeling_lex/ comes along).
FLAT_MODULES = {"configuration_lex.configuration_lex": "configuration_lex"} | {
    f"modeling_lex.{info.name}": info.name for info in pkgutil.iter_modules(modeling_lex.__path__)
}
PROJECT_PACKAGES = ("configuration_lex", "modeling_lex", "lex", "convert", "lex_base")
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


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def refuse_quantized(config, name: str) -> None:
    """An ExportError for quantized weights: an exported folder loads by remote code without this package, and
    torchao's CPU layouts are laid out by lex.quantization, which the folder's code does not carry."""
    if getattr(config, "quantization_config", None) is not None:
        raise ExportError(f"{name} holds quantized weights (quantization_config, torchao): lex export writes unquantized "
                          "folders, since its remote code loads without this package; export the unquantized model "
                          "and quantize at load time (from_pretrained(..., quantization_config=TorchAoConfig(...)))")


def export(model, out_dir: str | Path, *, tokenizer=None, results: str | Path | None = None,
           license_name: str | None = None, max_shard_size: str | int = "2GB", repo_name: str | None = None,
           force: bool = False) -> Path:
    """Write the Hub-ready folder for a LEX model (a model folder or a LexForCausalLM); returns OUT_DIR.

    The tokenizer and the results file default to those in the model folder (tokenizer files, results.json).
    `repo_name` is the name the card's loading snippet uses (default: the folder's name). The card keeps the
    base_model and license of the model folder's own card (`license_name` replaces that license; default mit).
    """
    out_dir = Path(out_dir).resolve()
    if license_name is not None and not LICENSE_ID.match(license_name):
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
        config = model_config(model_dir, "MODEL_DIR")
        if config.model_type != "lex":
            raise ExportError(f"{model_dir} holds a {config.model_type!r} model; lex export writes LEX models only")
        refuse_quantized(config, str(model_dir))
        model = LexForCausalLM.from_pretrained(model_dir)
        if tokenizer is None and has_tokenizer(model_dir):
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if results is None and (model_dir / "results.json").is_file():
            results = model_dir / "results.json"
    elif model.config.model_type != "lex":
        raise ExportError(f"the model is a {model.config.model_type!r} model; lex export writes LEX models only")
    else:
        refuse_quantized(model.config, "the model")
    table = length_table(load_results(Path(results))) if results is not None else None
    sources = {f"{flat}.py": flat_source(module) for module, flat in FLAT_MODULES.items()}
    parameters = sum(p.numel() for p in model.parameters())
    carried = card_metadata(model_dir) if model_dir is not None else {}
    base = carried.get("base_model")
    origin = Origin(base, carried.get("license"),
                    f"its weights come from `{base}`" if base else "exported by lex export")
    card = model_card(model.config, parameters, repo_name or out_dir.name, origin=origin,
                      license_name=license_name or origin.license or "mit", tokenizer=tokenizer is not None,
                      remote_code=True, extra_tags=("custom_code",), results=table)

    previous_auto_map = getattr(model.config, "auto_map", None)
    model.config.auto_map = dict(AUTO_MAP)
    try:
        with saved_for_generation(model.config), atomic_directory(out_dir, force) as staging:
            model.save_pretrained(staging, max_shard_size=max_shard_size)
            name_architecture(staging / "config.json")
            for name, text in sources.items():
                (staging / name).write_text(text, encoding="utf-8")
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            (staging / CARD_FILE).write_text(card, encoding="utf-8")
    finally:
        model.config.auto_map = previous_auto_map
    return out_dir


def name_architecture(config_file: Path) -> None:
    """Set ARCHITECTURES in a saved config.json (save_pretrained writes the class's own name there), in the layout
    transformers writes (PreTrainedConfig.to_json_string)."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["architectures"] = ARCHITECTURES
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def folder_files(folder: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """The files under `folder`, as repository paths, but those under a top-level entry matching `exclude`."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                  and not any(fnmatch(p.relative_to(folder).parts[0], pattern) for pattern in exclude))


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, dry_run: bool = False,
                commit_message: str | None = None, token: str | None = None, exclude: tuple[str, ...] = ()) -> str:
    """Upload exactly the folder (an export, or a model or adapter folder with its card) to `repo_id` as one
    commit; with `dry_run`, describe it and touch nothing.

    Files of the repository that the folder lacks (a stale shard of an earlier export) are deleted in the same
    commit, so the repository ends up equal to the folder; .gitattributes is kept. Top-level entries matching a
    pattern of `exclude` (lex train's checkpoint-*) are not uploaded. A name without a namespace is created in the
    token's own.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ExportError(f"--push_to_hub {repo_id!r}: {error}") from error
    folder = Path(folder)
    files = folder_files(folder, exclude)
    if not {"config.json", "adapter_config.json"} & set(files) or CARD_FILE not in files:
        raise ExportError(f"{folder} is not an exported folder (no config.json or adapter_config.json, or no "
                          f"{CARD_FILE}); run lex export first")
    message = commit_message or f"Upload LEX model with lex export ({len(files)} files)"
    if dry_run:
        return "\n".join([f"dry run: would create {'private ' if private else ''}model repo {repo_id} if needed "
                          f"and commit {message!r}, adding:", *[f"  {name}" for name in files],
                          "and deleting any other file of the repository (except .gitattributes)"])
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    stale = sorted(set(api.list_repo_files(repo_id, repo_type="model")) - set(files) - {".gitattributes"})
    operations = [CommitOperationDelete(path_in_repo=name) for name in stale]
    operations += [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in files]
    info = api.create_commit(repo_id, operations, commit_message=message, repo_type="model")
    return f"pushed {len(files)} files to {repo_id} (deleted {len(stale)} stale): {info.commit_url}"
