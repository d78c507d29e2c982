"""TorchScale / fairseq-TorchScale language models <-> LEX Hugging Face folders.

    lex convert-torchscale CHECKPOINT OUT_DIR [--config CONFIG.json] [--tokenizer DIR] [--dtype DTYPE]
                           [--attention-mode MODE] [--force]
    lex convert-to-torchscale HF_DIR OUT.pt [--format auto|decoder|fairseq] [--force]

CHECKPOINT is a TorchScale 0.3.0 `Decoder` state dict saved with torch.save, with its `DecoderConfig` keyword
arguments as JSON in --config, or a fairseq-trained TorchScale LM checkpoint (`model` holding `decoder.` keys,
hyper-parameters in `cfg["model"]` or the older `args`), read without --config. Checkpoints are opened with
torch.load(weights_only=True): a pickle that would run code is refused, never executed. OUT_DIR appears only
once complete. The converted model attends blockwise (LEX's BCA) with a window of the training length l
(or the LEX fork's `block_size`), which equals TorchScale's full attention on inputs up to that window;
--attention-mode full keeps TorchScale's attention beyond it.

The reverse writes OUT.pt as a `Decoder` state dict plus OUT.json (its DecoderConfig arguments), or, for
models with fairseq's sinusoidal positions (--format fairseq), a fairseq-style checkpoint that
`lex convert-torchscale` reads back without --config.
"""

import json
import math
import re
import sys
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoModelForCausalLM, AutoTokenizer

from configuration_lex import LexConfig
from lex_base.staging import atomic_directory, atomic_files
from modeling_lex import LexForCausalLM
from modeling_lex.positions import POSITION_METHODS

from .checkpoint import (
    ConversionError,
    Unresolved,
    check_tensors,
    load_checkpoint,
    refuse_field,
    resolve_interpolations,
)

# TorchScale 0.3.0 `DecoderConfig` fields and defaults (torchscale/architecture/config.py).
DECODER_DEFAULTS = {
    "decoder_embed_dim": 768, "decoder_attention_heads": 12, "decoder_ffn_embed_dim": 3072, "decoder_layers": 12,
    "decoder_normalize_before": True, "activation_fn": "gelu", "dropout": 0.0, "drop_path_rate": 0.0,
    "attention_dropout": 0.0, "activation_dropout": 0.0, "no_scale_embedding": True, "layernorm_embedding": False,
    "moe_freq": 0, "moe_top1_expert": False, "moe_expert_count": 0, "moe_gating_use_fp32": True,
    "moe_eval_capacity_token_fraction": 0.25, "moe_second_expert_policy": "random",
    "moe_normalize_gate_prob_before_dropping": False, "use_xmoe": False, "rel_pos_buckets": 0, "max_rel_pos": 0,
    "deepnorm": False, "subln": True, "bert_init": False, "multiway": False,
    "share_decoder_input_output_embed": False, "max_target_positions": 1024, "no_output_layer": False,
    "layernorm_eps": 1e-5, "vocab_size": -1, "checkpoint_activations": False, "fsdp": False, "ddp_rank": 0,
    "xpos_rel_pos": False, "xpos_scale_base": 512,
    "block_size": -1,  # added by the LEX authors' fork: its BCA window (-1: full attention)
}
# fairseq's `lm` model builds `DecoderConfig()` and overrides it with its own options, whose defaults differ
# (TorchScale examples/fairseq/models/language_modeling.py; `lm_base` forces pre-norm).
FAIRSEQ_DEFAULTS = {
    **DECODER_DEFAULTS, "activation_fn": "relu", "dropout": 0.1, "no_scale_embedding": False, "subln": False,
    "no_token_positional_embeddings": False, "decoder_learned_pos": False, "tokens_per_sample": None,
}
FAIRSEQ_PADDING_IDX = 1  # fairseq Dictionary: <s>=0, <pad>=1, </s>=2
XPOS_GAMMA = 0.4  # TorchScale's fixed xPos gamma
TORCHSCALE_ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # fixed_pos_embedding: theta 10000, no scaling

# option -> (is it in use?, what LexConfig cannot express)
REFUSED = {
    "moe_freq": (lambda o: o["moe_freq"] != 0, "mixture-of-experts layers"),
    "use_xmoe": (lambda o: bool(o["use_xmoe"]), "X-MoE routing"),
    "multiway": (lambda o: bool(o["multiway"]), "multiway (BEiT-3) networks"),
    "rel_pos_buckets": (lambda o: o["rel_pos_buckets"] > 0 and o["max_rel_pos"] > 0,
                        "bucketed relative position bias (with max_rel_pos)"),
    "decoder_learned_pos": (
        lambda o: bool(o.get("decoder_learned_pos")) and not o.get("no_token_positional_embeddings"),
        "learned absolute positions",
    ),
    "no_output_layer": (lambda o: bool(o["no_output_layer"]), "a decoder without output layer"),
}
# LexConfig field -> the TorchScale option it comes from, to name the source of a LexConfig refusal.
SOURCE_OPTIONS = {
    "hidden_size": "decoder_embed_dim", "num_attention_heads": "decoder_attention_heads",
    "intermediate_size": "decoder_ffn_embed_dim", "num_hidden_layers": "decoder_layers",
    "normalize_before": "decoder_normalize_before", "deepnorm": "deepnorm", "subln": "subln",
    "hidden_act": "activation_fn", "layer_norm_eps": "layernorm_eps", "xpos_scale_base": "xpos_scale_base",
    "max_position_embeddings": "max_target_positions", "attention_window": "block_size",
    "hidden_dropout": "dropout", "attention_dropout": "attention_dropout", "activation_dropout": "activation_dropout",
}

# TorchScale Decoder key -> LEX key, and back; first match wins.
TO_LEX = [
    (r"embed_tokens\.", "model.embed_tokens."),
    (r"layernorm_embedding\.", "model.layernorm_embedding."),
    (r"layers\.(\d+)\.self_attn\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|inner_attn_ln)\.", r"model.layers.\1.self_attn.\2."),
    (r"layers\.(\d+)\.ffn\.(fc1|fc2|ffn_layernorm)\.", r"model.layers.\1.mlp.\2."),
    (r"layers\.(\d+)\.(self_attn_layer_norm|final_layer_norm)\.", r"model.layers.\1.\2."),
    (r"layer_norm\.", "model.norm."),
    (r"output_projection\.", "lm_head."),
]
TO_TORCHSCALE = [
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.self_attn.out_proj."),
    (r"model\.layers\.(\d+)\.mlp\.", r"layers.\1.ffn."),
    (r"model\.norm\.", "layer_norm."),
    (r"model\.", ""),
    (r"lm_head\.", "output_projection."),
]
TORCHSCALE_ACTIVATIONS = ("relu", "gelu", "swish")  # FeedForwardNetwork's; LexConfig's "silu" is "swish"
# Constant buffers: TorchScale's per-layer xPos scale, the LEX fork's shared one, fairseq's sinusoidal table.
XPOS_BUFFER = re.compile(r"(layers\.\d+\.self_attn\.xpos|self_attn_xpos)\.scale")
SINUSOIDAL_BUFFERS = ("embed_positions._float_tensor", "embed_positions.weights")
# Wrappers that fairscale/FSDP insert into parameter names.
WRAPPER_SEGMENTS = re.compile(r"(_fsdp_wrapped_module|_fpw_module|_checkpoint_wrapped_module)\.")


def rename(key: str, rules: list[tuple[str, str]]) -> str | None:
    for pattern, replacement in rules:
        renamed, count = re.subn(f"^{pattern}", replacement, key)
        if count:
            return renamed
    return None


def torchscale_xpos_scale(head_dim: int) -> torch.Tensor:
    """TorchScale's `xpos.scale` buffer, zeta_i = (2i + 0.4 d) / (1.4 d), computed the way TorchScale does."""
    return (torch.arange(0, head_dim, 2) + 0.4 * head_dim) / (1.4 * head_dim)


# ---------------------------------------------------------------- reading a TorchScale / fairseq checkpoint


@dataclass
class Source:
    state: dict[str, torch.Tensor]  # TorchScale Decoder names
    options: dict  # the DecoderConfig values the checkpoint's model was built with
    fairseq: bool
    prefix: str = ""  # how the file names the decoder's keys ("decoder." in fairseq checkpoints)
    foreign: list[str] = field(default_factory=list)  # keys of the file outside the decoder
    ignored: list[str] = field(default_factory=list)  # --config keys that DecoderConfig ignores

    @property
    def kind(self) -> str:
        return "fairseq-TorchScale LM" if self.fairseq else "TorchScale Decoder"


def strip_wrappers(state: dict) -> dict:
    state = {WRAPPER_SEGMENTS.sub("", key): value for key, value in state.items()}
    if state and all(key.startswith("module.") for key in state):
        state = {key[len("module."):]: value for key, value in state.items()}
    return state


def fairseq_hyperparameters(checkpoint: dict) -> dict:
    """cfg["model"] (interpolations resolved, the task's tokens_per_sample added) or the older args Namespace."""
    cfg, args = checkpoint.get("cfg"), checkpoint.get("args")
    if isinstance(cfg, dict) and isinstance(cfg.get("model"), (dict, Namespace)):
        model = cfg["model"] if isinstance(cfg["model"], dict) else vars(cfg["model"])
        hyper = resolve_interpolations(model, cfg)
        task = cfg.get("task") if isinstance(cfg.get("task"), dict) else {}
        if hyper.get("tokens_per_sample") is None and "tokens_per_sample" in task:
            hyper["tokens_per_sample"] = resolve_interpolations(task, cfg)["tokens_per_sample"]
        return hyper
    if isinstance(args, Namespace):
        return dict(vars(args))
    raise ConversionError("the fairseq checkpoint has neither cfg['model'] nor an args Namespace to read "
                          "its hyper-parameters from")


def apply_decoder_config_rules(options: dict) -> dict:
    """DecoderConfig.__init__'s precedence: deepnorm means post-norm without subln; subln means pre-norm."""
    options = dict(options)
    if options["deepnorm"]:
        options["decoder_normalize_before"], options["subln"] = False, False
    if options["subln"]:
        options["decoder_normalize_before"], options["deepnorm"] = True, False
    return options


def read_source(path: Path, config_path: Path | None) -> Source:
    checkpoint = load_checkpoint(path)
    if not isinstance(checkpoint, dict):
        raise ConversionError(f"{path} holds a {type(checkpoint).__name__}, not a state dict or a fairseq checkpoint")
    model = checkpoint.get("model")
    if isinstance(model, dict) and any(str(key).startswith("decoder.") for key in model):
        if config_path is not None:
            raise ConversionError(f"{path} is a fairseq checkpoint with its own hyper-parameters; drop --config")
        model = strip_wrappers(model)
        state = {key[len("decoder."):]: value for key, value in model.items() if key.startswith("decoder.")}
        hyper = {key: value for key, value in fairseq_hyperparameters(checkpoint).items() if value is not None}
        # fairseq's DecoderConfig().override(args) bypasses DecoderConfig's precedence rules.
        options = {**FAIRSEQ_DEFAULTS, **hyper}
        foreign = sorted(key for key in model if not key.startswith("decoder."))
        return Source(state, options, fairseq=True, prefix="decoder.", foreign=foreign)
    not_tensors = [str(key) for key, value in checkpoint.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise ConversionError(f"{path} is neither a Decoder state dict nor a fairseq checkpoint: "
                              f"{', '.join(not_tensors[:5])} {'is' if len(not_tensors) == 1 else 'are'} not tensors")
    if config_path is None:
        raise ConversionError(f"{path} is a plain Decoder state dict: pass its DecoderConfig arguments as "
                              "--config CONFIG.json")
    try:
        kwargs = json.loads(Path(config_path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConversionError(f"--config {config_path}: {error}") from None
    if not isinstance(kwargs, dict):
        raise ConversionError(f"--config {config_path} must hold a JSON object of DecoderConfig keyword arguments")
    options = apply_decoder_config_rules({**DECODER_DEFAULTS, **kwargs})
    ignored = sorted(set(kwargs) - set(DECODER_DEFAULTS))
    return Source(strip_wrappers(checkpoint), options, fairseq=False, ignored=ignored)


# ---------------------------------------------------------------- TorchScale -> LEX


def training_length(options: dict, fairseq: bool) -> int:
    """fairseq trains on tokens_per_sample tokens; a Decoder's max_target_positions is its stated length."""
    for key in ("tokens_per_sample", "max_target_positions") if fairseq else ("max_target_positions",):
        value = options.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DECODER_DEFAULTS["max_target_positions"]


def lex_config(source: Source, attention_mode: str | None = None, special_ids: dict | None = None):
    """The LexConfig of the model `source` describes, or a ConversionError naming the option at fault."""
    options, state = source.options, source.state
    unresolved = [f"{key}={value}" for key, value in options.items()
                  if isinstance(value, Unresolved) and (key in DECODER_DEFAULTS or key in FAIRSEQ_DEFAULTS)]
    if unresolved:
        raise ConversionError(f"cannot resolve the checkpoint's cfg interpolations {', '.join(unresolved)}")
    for key, (in_use, what) in REFUSED.items():
        if in_use(options):
            raise ConversionError(f"option {key}={options[key]!r} ({what}) has no LexConfig equivalent; "
                                  "refusing to convert")
    if "embed_positions.weight" in state:
        raise ConversionError(f"option decoder_learned_pos (learned absolute positions: key {source.prefix}"
                              "embed_positions.weight) has no LexConfig equivalent; refusing to convert")
    if options["activation_fn"] not in TORCHSCALE_ACTIVATIONS:
        raise ConversionError(f"option activation_fn={options['activation_fn']!r} is not one of "
                              f"{list(TORCHSCALE_ACTIVATIONS)} "
                              "(TorchScale's FeedForwardNetwork supports only these)")

    absolute = None
    has_positions = [key for key in state if key.startswith("embed_positions.")]
    if source.fairseq and not options["no_token_positional_embeddings"]:
        absolute = "sinusoidal"
    elif has_positions:
        why = ("no_token_positional_embeddings is set" if source.fairseq
               else "a plain Decoder state dict does not say which position module made it; convert the fairseq "
                    "checkpoint instead")
        raise ConversionError(f"unexpected keys {', '.join(source.prefix + k for k in has_positions)}: {why}")

    embed = state.get("embed_tokens.weight")
    if embed is None:
        raise ConversionError(f"missing key {source.prefix}embed_tokens.weight")
    vocab = int(embed.shape[0])
    if int(options["vocab_size"]) > 0 and int(options["vocab_size"]) != vocab:
        raise ConversionError(f"option vocab_size={options['vocab_size']} but {source.prefix}embed_tokens.weight "
                              f"has {vocab} rows")
    length = training_length(options, source.fairseq)
    fork_window = options.get("block_size")  # the LEX fork's BCA window w (not a block length)
    window = fork_window if isinstance(fork_window, int) and fork_window > 0 else length + length % 2
    shared = bool(options["share_decoder_input_output_embed"])
    hidden = int(options["decoder_embed_dim"])
    fields = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(options["decoder_ffn_embed_dim"]),
        num_hidden_layers=int(options["decoder_layers"]), num_attention_heads=int(options["decoder_attention_heads"]),
        hidden_act=options["activation_fn"], max_position_embeddings=length,
        attention_mode=attention_mode or "blockwise", attention_window=window,
        position_embedding_type="xpos" if options["xpos_rel_pos"] else "none",
        xpos_scale_base=float(options["xpos_scale_base"]), xpos_gamma=XPOS_GAMMA,
        layer_norm_eps=float(options["layernorm_eps"]), hidden_dropout=float(options["dropout"]),
        attention_dropout=float(options["attention_dropout"]), activation_dropout=float(options["activation_dropout"]),
        normalize_before=bool(options["decoder_normalize_before"]), subln=bool(options["subln"]),
        deepnorm=bool(options["deepnorm"]), layernorm_embedding=bool(options["layernorm_embedding"]),
        embedding_scale=1.0 if options["no_scale_embedding"] else math.sqrt(hidden),
        attention_bias=True, mlp_bias=True, tie_word_embeddings=shared,
        absolute_position_embedding=absolute, absolute_position_offset=FAIRSEQ_PADDING_IDX + 1,
        **(special_ids or {}),
    )
    try:
        return LexConfig(**fields)
    except (ValueError, StrictDataclassError) as error:  # @strict's field and class validation errors
        named = [f"{SOURCE_OPTIONS[name]}={options.get(SOURCE_OPTIONS[name])!r}" for name in SOURCE_OPTIONS
                 if re.search(rf"\b{name}\b", str(error))]
        raise ConversionError(f"the {source.kind}'s options ({', '.join(named) or 'see below'}) do not fit "
                              f"LexConfig: {error}") from None


def to_lex_state(source: Source, config) -> tuple[dict, list[str]]:
    """(state dict in LEX names, keys of the file that have no LEX counterpart)."""
    mapped, unexpected = {}, list(source.foreign)
    for key, tensor in source.state.items():
        if XPOS_BUFFER.fullmatch(key) and config.position_embedding_type == "xpos":
            expected = torchscale_xpos_scale(config.head_dim)
            if tensor.shape != expected.shape or not torch.allclose(tensor.double(), expected.double(), rtol=1e-6):
                raise ConversionError(f"{source.prefix}{key} is not TorchScale's xPos scale for head_dim "
                                      f"{config.head_dim}")
            continue
        if key in SINUSOIDAL_BUFFERS and config.absolute_position_embedding == "sinusoidal":
            continue
        name = rename(key, TO_LEX)
        if name is None:
            unexpected.append(source.prefix + key)
        else:
            mapped[name] = tensor
    if config.tie_word_embeddings and "lm_head.weight" in mapped:
        if "model.embed_tokens.weight" in mapped and not torch.equal(mapped["lm_head.weight"],
                                                                     mapped["model.embed_tokens.weight"]):
            raise ConversionError(f"share_decoder_input_output_embed is set but {source.prefix}output_projection"
                                  f".weight differs from {source.prefix}embed_tokens.weight")
        del mapped["lm_head.weight"]
    return mapped, unexpected


def check_checkpoint_tensors(model, mapped: dict, unexpected: list[str], source: Source) -> None:
    """Every key the model needs, nothing else, every shape right; the report uses the checkpoint's names."""
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    check_tensors({key: tuple(tensor.shape) for key, tensor in mapped.items()},
                  {key: tuple(tensor.shape) for key, tensor in expected.items()},
                  f"the {source.kind} does not match its options",
                  lambda lex_key: source.prefix + (rename(lex_key, TO_TORCHSCALE) or lex_key), unexpected,
                  noun="keys", needs="the options need")


def load_tokenizer(folder: Path | None):
    if folder is None:
        return None
    if not Path(folder).is_dir():
        raise ConversionError(f"--tokenizer {folder}: not a folder (a local tokenizer folder is needed)")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as error:
        raise ConversionError(f"--tokenizer {folder}: {error}") from None


def convert_from_torchscale(
    checkpoint: Path, out_dir: Path, config_path: Path | None = None, tokenizer: Path | None = None,
    dtype: str | None = None, attention_mode: str | None = None, force: bool = False,
):
    """Write OUT_DIR (config.json, model.safetensors, the tokenizer if given); returns the LexConfig.

    An existing OUT_DIR is refused unless `force`, and replaced only once the new folder is complete.
    """
    with atomic_directory(out_dir, force) as staging:
        source = read_source(Path(checkpoint), config_path)
        tok = load_tokenizer(tokenizer)
        if source.fairseq:
            special_ids = dict(bos_token_id=0, pad_token_id=FAIRSEQ_PADDING_IDX, eos_token_id=2)
        elif tok is not None:
            special_ids = dict(bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id)
        else:
            special_ids = {}
        config = lex_config(source, attention_mode, special_ids)
        if tok is not None and len(tok) > config.vocab_size:
            raise ConversionError(f"--tokenizer {tokenizer} has {len(tok)} tokens but the model's vocabulary has "
                                  f"{config.vocab_size}")
        mapped, unexpected = to_lex_state(source, config)
        model = LexForCausalLM(config)
        check_checkpoint_tensors(model, mapped, unexpected, source)
        model.load_state_dict(mapped, strict=False)
        model.to(getattr(torch, dtype) if dtype else mapped["model.embed_tokens.weight"].dtype)
        model.save_pretrained(staging)
        if tok is not None:
            tok.save_pretrained(staging)
    for key in source.ignored:
        print(f"note: --config option {key!r} is not a DecoderConfig field; TorchScale ignores it, and so did this "
              "conversion", file=sys.stderr)
    return config


# ---------------------------------------------------------------- LEX -> TorchScale


def torchscale_options(config) -> dict:
    """The DecoderConfig arguments (TorchScale names) of a LexConfig, or a ConversionError naming the field."""
    if not POSITION_METHODS[config.position_embedding_type].torchscale:
        refuse_field(config, "position_embedding_type", "TorchScale computes xPos, no relative positions, or "
                                                        "fairseq's sinusoidal table, nothing else")
    if config.position_embedding_type == "xpos" and config.xpos_gamma != XPOS_GAMMA:
        refuse_field(config, "xpos_gamma", f"TorchScale's xPos fixes gamma at {XPOS_GAMMA}")
    if config.position_embedding_type == "xpos" and config.rope_parameters != TORCHSCALE_ROPE:
        refuse_field(config, "rope_parameters", f"TorchScale's xPos rotates with {TORCHSCALE_ROPE}")
    for field_ in ("attention_bias", "attention_output_bias", "mlp_bias"):
        if not getattr(config, field_):
            refuse_field(config, field_, "TorchScale's projections all have biases")
    backbone = {"norm_type": "layernorm", "mlp_type": "fc", "num_key_value_heads": config.num_attention_heads,
                "head_dim": config.hidden_size // config.num_attention_heads}
    gemma = {"sublayer_output_norms": False, "query_pre_attn_scalar": None, "attn_logit_softcapping": None,
             "final_logit_softcapping": None, "embedding_scale_in_lookup": False, "local_layers": None}
    for field_, value in {**backbone, **gemma}.items():
        if getattr(config, field_) != value:
            refuse_field(config, field_, f"TorchScale's Decoder has only {field_}={value!r}")
    if ("swish" if config.hidden_act == "silu" else config.hidden_act) not in TORCHSCALE_ACTIVATIONS:
        refuse_field(config, "hidden_act", f"TorchScale's activations are {', '.join(TORCHSCALE_ACTIVATIONS)}")
    scaled = math.isclose(config.embedding_scale, math.sqrt(config.hidden_size), rel_tol=1e-12)
    if config.embedding_scale != 1.0 and not scaled:
        refuse_field(config, "embedding_scale", f"TorchScale scales embeddings by 1 or sqrt(hidden_size) = "
                                                f"{math.sqrt(config.hidden_size)}")
    if config.absolute_position_embedding and config.absolute_position_offset != FAIRSEQ_PADDING_IDX + 1:
        refuse_field(config, "absolute_position_offset",
                     f"fairseq's positions start at padding_idx + 1 = {FAIRSEQ_PADDING_IDX + 1}")
    options = {
        "decoder_embed_dim": config.hidden_size, "decoder_attention_heads": config.num_attention_heads,
        "decoder_ffn_embed_dim": config.intermediate_size, "decoder_layers": config.num_hidden_layers,
        "decoder_normalize_before": config.normalize_before,
        "activation_fn": "swish" if config.hidden_act == "silu" else config.hidden_act,
        "dropout": config.hidden_dropout, "attention_dropout": config.attention_dropout,
        "activation_dropout": config.activation_dropout, "no_scale_embedding": not scaled,
        "layernorm_embedding": config.layernorm_embedding, "deepnorm": config.deepnorm, "subln": config.subln,
        "share_decoder_input_output_embed": config.tie_word_embeddings,
        "max_target_positions": config.max_position_embeddings, "layernorm_eps": config.layer_norm_eps,
        "xpos_rel_pos": config.position_embedding_type == "xpos", "xpos_scale_base": config.xpos_scale_base,
        "vocab_size": config.vocab_size,
    }
    if config.attention_mode != "full":
        options["block_size"] = config.attention_window  # the LEX fork's BCA window; TorchScale 0.3.0 ignores it
    return options


def torchscale_state(model) -> dict:
    config = model.config
    state = {}
    for key, tensor in model.state_dict().items():
        name = rename(key, TO_TORCHSCALE)
        if name is None:
            raise ConversionError(f"{key} has no TorchScale counterpart")
        state[name] = tensor.detach()
    if config.tie_word_embeddings:
        state["output_projection.weight"] = state["embed_tokens.weight"]
    if config.position_embedding_type == "xpos":
        for layer in range(config.num_hidden_layers):
            state[f"layers.{layer}.self_attn.xpos.scale"] = torchscale_xpos_scale(config.head_dim)
    return state


def convert_to_torchscale(hf_dir: Path, out_path: Path, fmt: str = "auto", force: bool = False) -> list[Path]:
    """Write OUT.pt (+ OUT.json for a Decoder state dict); returns the paths written."""
    if not Path(hf_dir).is_dir():
        raise ConversionError(f"{hf_dir}: not a model folder")
    out_path = Path(out_path)
    config_path = out_path.with_suffix(".json")
    if config_path == out_path:
        raise ConversionError(f"{out_path}: name the checkpoint OUT.pt; its config goes to OUT.json")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    except (OSError, ValueError, StrictDataclassError) as error:
        raise ConversionError(f"{hf_dir}: cannot load a model from it: {error}") from None
    config = model.config
    if getattr(config, "model_type", None) != "lex":
        raise ConversionError(f"{hf_dir} holds a {config.model_type!r} model, not a LEX one")
    if fmt == "auto":
        fmt = "fairseq" if config.absolute_position_embedding else "decoder"
    options = torchscale_options(config)
    state = torchscale_state(model)
    if fmt == "decoder":
        if config.absolute_position_embedding:
            raise ConversionError(f"LexConfig.absolute_position_embedding={config.absolute_position_embedding!r}: "
                                  "a TorchScale Decoder state dict cannot carry fairseq's positions; "
                                  "use --format fairseq")
        changed = [f"{key} {options[key]} -> {value}" for key, value in apply_decoder_config_rules(options).items()
                   if value != options[key]]
        if changed:
            raise ConversionError(f"DecoderConfig's deepnorm/subln precedence would change {', '.join(changed)}; "
                                  "use --format fairseq, whose checkpoints keep these options as they are")
        targets = [out_path, config_path]
    else:
        hyper = {**options, "no_token_positional_embeddings": not config.absolute_position_embedding,
                 "decoder_learned_pos": False, "tokens_per_sample": config.max_position_embeddings}
        state = {f"decoder.{key}": value for key, value in state.items()}
        if config.absolute_position_embedding:
            state["decoder.embed_positions._float_tensor"] = torch.zeros(1)
        targets = [out_path]
    with atomic_files(out_path.parent, tuple(target.name for target in targets), force) as staging:
        if fmt == "decoder":
            torch.save(state, staging / out_path.name)
            (staging / config_path.name).write_text(json.dumps(options, indent=2) + "\n")
        else:
            cfg = {"model": {"_name": "lm", **hyper}, "task": {"tokens_per_sample": config.max_position_embeddings}}
            torch.save({"model": state, "cfg": cfg}, staging / out_path.name)
    if config.attention_mode != "blockwise":
        print(f"note: TorchScale has no attention_mode={config.attention_mode!r}; pass --attention-mode "
              f"{config.attention_mode} when converting back", file=sys.stderr)
    return targets
