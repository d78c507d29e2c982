"""Model cards: the README.md of every folder the product writes (`lex convert-hf`, `lex train`, `lex export`,
`lex demo`'s models), so that each folder is ready for the Hub as it is written.

`model_card` is the one writer. Its YAML front matter is built by huggingface_hub's ModelCardData, so that
`huggingface_hub.ModelCard` parses it: base_model, library_name (transformers, or peft for an adapter),
pipeline_tag, tags and the license of the source where it is known. The body says what the model is and where its
weights come from, its reading settings (attention mode, window, sinks, block memory, training length), how to
load it, and the figures the run measured, if it measured any. No field is ever written blank: base_model names
what the weights came from (a Hub id, else the source's absolute local path); a model trained from scratch has
no base and its card leaves the field out, as transformers' Trainer does for run_clm trained from scratch.
"""

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData

from convert.hf import read_names, weight_files

from .models import has_tokenizer
from .report import markdown_table

logger = logging.getLogger(__name__)
CARD_FILE = "README.md"
PIPELINE_TAG = "text-generation"
HUB_URL = "https://huggingface.co/"
# GGUF keys that may name the Hub repository a file was converted from: llama.cpp's older key (a repo id), then
# the URLs of its current metadata (general.source.*), read as a repo id where they point into the Hub.
GGUF_SOURCE_KEYS = ("general.source.huggingface.repository", "general.source.repo_url", "general.source.url")


@dataclass(frozen=True)
class Origin:
    """Where a model's weights come from: the card's base_model and license, and a sentence for its body."""

    base_model: str | None = None
    license: str | None = None
    description: str = "trained from scratch"


def card_metadata(folder: str | Path) -> dict:
    """The front matter of the model card in `folder`, what a new card carries over: empty when it has none, or
    one whose YAML does not parse (a warning names it: it only lends a license or a base)."""
    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return {}
    try:
        return ModelCard.load(path).data.to_dict()
    except (ValueError, yaml.YAMLError) as error:  # a malformed field, or YAML that does not parse
        logger.warning("%s: its front matter is not a model card's (%s); its metadata is not carried over", path,
                       str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
        return {}


def source_origin(source: str | Path, how: str) -> Origin:
    """The origin of weights read from `source`, a model folder or Hub id, by `how` ("converted by lex
    convert-hf"). A local folder is named by its absolute path (a relative one means nothing to whoever reads the
    card elsewhere) and lends its own card's license; a Hub id is named as given."""
    path = Path(source)
    if not path.exists():
        return Origin(str(source), None, f"{how} from `{source}`")
    path = path.resolve()
    license_name = card_metadata(path).get("license") if path.is_dir() else None
    return Origin(str(path), license_name, f"{how} from `{path}`")


def gguf_origin(path: str | Path, how: str) -> Origin:
    """The origin of a .gguf file's weights, from its metadata (GGUF's general.* keys): base_model is the Hub
    repository it was converted from (GGUF_SOURCE_KEYS) where it records one, else the file's absolute path; the
    license is general.license; the sentence names the model (general.name, general.organization)."""
    from gguf import GGUFReader

    path = Path(path).resolve()
    fields = GGUFReader(path).fields

    def text(key: str) -> str | None:
        value = fields[key].contents() if key in fields else None
        return value if isinstance(value, str) and value.strip() else None

    sources = [text(key) for key in GGUF_SOURCE_KEYS]
    repository = next((source.removeprefix(HUB_URL).strip("/") for source in sources
                       if source and (source.startswith(HUB_URL) or "://" not in source)), None)
    name = " by ".join(filter(None, (text("general.name"), text("general.organization"))))
    named = f"{name}, " if name else ""
    return Origin(repository or str(path), text("general.license"), f"{how} from {named}the GGUF file `{path}`"
                  + (f" (converted from {repository})" if repository else ""))


def load_snippet(name: str, *, lex: bool = True, remote_code: bool = False, adapter: bool = False,
                 tokenizer: bool = True) -> list[str]:
    """Python that loads the folder or repository `name`: with trust_remote_code where the code ships with the
    weights, else after `import modeling_lex` (which registers LEX with transformers' Auto classes), through
    peft's AutoPeftModelForCausalLM for an adapter."""
    lines = ["import modeling_lex  # registers LEX with transformers (pip install lex-transformer)"] if (
        lex and not remote_code) else []
    auto = "AutoPeftModelForCausalLM" if adapter else "AutoModelForCausalLM"
    imported = [auto] if not adapter else []
    lines += ["from peft import AutoPeftModelForCausalLM"] if adapter else []
    imported += ["AutoTokenizer"] if tokenizer else []
    lines += [f"from transformers import {', '.join(imported)}"] if imported else []
    lines += ["", f'model = {auto}.from_pretrained("{name}"' + (", trust_remote_code=True)" if remote_code else ")")]
    if tokenizer:
        lines += [f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
                  'ids = tokenizer("In the beginning", return_tensors="pt").input_ids',
                  "print(tokenizer.decode(model.generate(ids, max_new_tokens=50)[0]))"]
    return lines


def settings_rows(config, parameters: int) -> list[list[str]]:
    """The reading settings of a model of `config` (a LexConfig, or a transformers config read as published)."""
    rows = [["training length", f"{config.max_position_embeddings} tokens"]]
    if config.model_type == "lex":
        memory = (f"{config.attention_memory_blocks} blocks of {config.attention_memory_block_size} tokens"
                  if config.attention_memory_blocks else "none")
        rows += [["attention mode", config.attention_mode],
                 ["attention window", f"{config.attention_window} tokens"],
                 ["attention sinks", str(config.attention_sinks)]]
        if config.attention_sinks:
            rows.append(["sink positions", config.attention_sink_positions])
        rows += [["block memory", memory], ["position embedding", config.position_embedding_type]]
    else:
        rows += [["attention mode", "full (as published)"], ["model type", config.model_type]]
    return rows + [["parameters", f"{parameters:,}"],
                   ["layers / hidden / heads",
                    f"{config.num_hidden_layers} / {config.hidden_size} / {config.num_attention_heads}"]]


def attention_text(config) -> str:
    """What a LEX model's attention sees, and what that means for inputs past the training length."""
    mode, window = config.attention_mode, config.attention_window
    attention = {
        "blockwise": f"blockwise causal (BCA): blocks of {window // 2} tokens, a token sees its block and the "
                     f"previous one (at most {window} keys)",
        "sliding": f"sliding window: a token sees the last {window} keys",
        "full": "full causal attention",
    }[mode]
    if mode == "full":
        return (f"Attention: {attention}. Attention here is full: for inputs longer than the training length load "
                'the model with `attention_mode="blockwise"` (a config override), which reads any length in '
                f"O(n·{window}) memory.")
    sinks, memory = config.attention_sinks, config.attention_memory_blocks
    plus = f" plus the document's first {sinks} tokens (attention sinks)" if sinks else ""
    if memory:
        plus += (f", and the {memory} blocks of {config.attention_memory_block_size} evicted tokens that the query "
                 "scores best (a block memory, which stores every evicted block)")
    return (f"Attention: {attention}. Inputs may be far longer than the training length: attention only ever looks "
            f"at {window} keys{plus}, and `generate()` keeps a cache of at most {window - 1 + sinks} positions per "
            "layer" + (" besides the memory." if memory else "."))


def model_card(config, parameters: int, name: str, *, origin: Origin = Origin(), license_name: str | None = None,
               tokenizer: bool = True, remote_code: bool = False, adapter: bool = False,
               extra_tags: tuple[str, ...] = (), notes: str = "", figures: dict[str, float] | None = None,
               figures_source: str = "", results: str | None = None, results_source: str = "`lex eval-length`"
               ) -> str:
    """README.md for the model (or adapter) of `config` with `parameters` weights, loaded as `name` (a folder or
    Hub id; `load_snippet`): its metadata (`license_name` over the origin's), settings, loading, and what the run
    measured (`figures`, described by `figures_source`; `results`, a perplexity-by-length table, measured by
    `results_source`)."""
    lex = config.model_type == "lex"
    load = load_snippet(name, lex=lex, remote_code=remote_code, adapter=adapter, tokenizer=tokenizer)
    tags = (["lex", config.position_embedding_type, "length-extrapolation"] if lex else [config.model_type])
    tags += [tag for tag in extra_tags if tag not in tags]
    metadata = ModelCardData(base_model=origin.base_model, library_name="peft" if adapter else "transformers",
                             license=license_name or origin.license, pipeline_tag=PIPELINE_TAG, tags=tags)
    what = ('a LEX Transformer ("A Length-Extrapolatable Transformer", Sun et al. 2022): a decoder-only language '
            f"model with {config.position_embedding_type} positions and {config.attention_mode} attention"
            if lex else f"a {config.model_type} decoder-only language model with full attention")
    what = f"A LoRA adapter (peft) of {what}" if adapter else what[0].upper() + what[1:]
    lines = ["---", metadata.to_yaml(), "---", "", f"# {name.rstrip('/').rpartition('/')[2]}", "",
             f"{what}; {origin.description}.", "",
             markdown_table(["", ""], settings_rows(config, parameters)), ""]
    if lex:
        lines += [attention_text(config), ""]
    if notes:
        lines += [notes, ""]
    lines += ["## How to load", ""]
    if lex and remote_code:
        lines += ["The model code ships with the weights (`trust_remote_code=True`); it needs torch and "
                  "transformers 5.", ""]
    elif lex:
        lines += ["The model code is the lex-transformer package: `import modeling_lex` before loading.", ""]
    lines += ["```python", *load, "```"]
    if figures:
        lines += ["", "## Measured by this run", "", figures_source, "",
                  markdown_table(["figure", "value"], [[key, f"{value:.4g}"] for key, value in figures.items()])]
    if results:
        lines += ["", "## Perplexity by evaluation length", "",
                  f"Trained on {config.max_position_embeddings}-token sequences; evaluated at the lengths below "
                  f"({results_source}).", "", results]
    return "\n".join(lines) + "\n"


def write_card(folder: str | Path, text: str) -> Path:
    """Write `text` as the folder's README.md, replacing any card there (peft's blank template included)."""
    path = Path(folder) / CARD_FILE
    path.write_text(text, encoding="utf-8")
    return path


def write_conversion_card(folder: Path, config, source: Path, out_dir: Path) -> None:
    """The model card of a folder converted from `source` (its base_model) and being staged in `folder` for
    `out_dir` (convert.hf's `card`): parameters counted from the weights written there."""
    how = "converted by lex convert-hf"
    origin = gguf_origin(source, how) if source.is_file() else source_origin(source, how)
    parameters = sum(math.prod(shape) for _, shape, _ in read_names(weight_files(folder)).values())
    notes = ("The xPos scale is new to these weights: fine-tune before use (`lex train`)."
             if config.position_embedding_type == "xpos" else "")
    write_card(folder, model_card(config, parameters, str(out_dir), origin=origin, tokenizer=has_tokenizer(folder),
                                  notes=notes))
