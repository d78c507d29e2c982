"""TorchScale / fairseq-TorchScale checkpoints <-> LEX HF folders.

    lex convert-torchscale CHECKPOINT OUT_DIR [--config CONFIG.json] [--tokenizer DIR] [--dtype ...] [--force]
    lex convert-to-torchscale HF_DIR OUT.pt        # writes OUT.pt (Decoder state dict) and OUT.json (its config)

CHECKPOINT is a TorchScale `Decoder` state dict saved with torch.save (its `DecoderConfig` keyword arguments
in --config), or a fairseq-trained TorchScale LM checkpoint (`model` with `decoder.`-prefixed keys and the
hyper-parameters in `cfg["model"]` or the older `args`). Checkpoints are read with weights_only=True: a pickle
that would run code is refused, never executed. The output is built in a temporary folder and moved into
place only when complete.
"""

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import torch

# TorchScale 0.3.0 DecoderConfig defaults for the fields a dense decoder LM uses.
DECODER_DEFAULTS = {
    "decoder_embed_dim": 768, "decoder_attention_heads": 12, "decoder_ffn_embed_dim": 3072, "decoder_layers": 12,
    "decoder_normalize_before": True, "activation_fn": "gelu", "dropout": 0.0, "attention_dropout": 0.0,
    "activation_dropout": 0.0, "no_scale_embedding": True, "layernorm_embedding": False, "deepnorm": False,
    "subln": True, "share_decoder_input_output_embed": False, "max_target_positions": 1024, "layernorm_eps": 1e-5,
    "xpos_rel_pos": False, "xpos_scale_base": 512, "vocab_size": -1,
}
# fairseq's LM defaults differ (DESIGN.md section 5).
FAIRSEQ_DEFAULTS = {
    **DECODER_DEFAULTS, "activation_fn": "relu", "no_scale_embedding": False, "subln": False,
    "no_token_positional_embeddings": False, "decoder_learned_pos": False,
}
# Options LexConfig cannot express: refused by name when set.
REFUSED = {
    "moe_freq": "mixture-of-experts layers", "moe_expert_count": "mixture-of-experts layers",
    "use_xmoe": "mixture-of-experts layers", "multiway": "multiway (BEiT-3) networks",
    "rel_pos_buckets": "bucketed relative position bias", "max_rel_pos": "bucketed relative position bias",
    "decoder_learned_pos": "learned absolute positions", "no_output_layer": "a decoder without output layer",
}
ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "swish": "swish"}


class ConversionError(ValueError):
    pass


# ---------------------------------------------------------------- reading checkpoints safely


def load_checkpoint(path: Path) -> dict:
    """torch.load with weights_only=True; argparse.Namespace is the one non-container type allowed (fairseq)."""
    try:
        with torch.serialization.safe_globals([Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConversionError(f"{path}: no such checkpoint") from None
    except Exception as error:  # UnpicklingError and friends: the file asked for something unsafe
        raise ConversionError(
            f"refusing to load {path}: it is not a plain weights checkpoint and loading it would execute pickled "
            f"code ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        ) from None


def _resolve(value, root: dict):
    """Resolve simple omegaconf interpolations "${model.x}" / "${x}" against the cfg dict."""
    while isinstance(value, str) and (match := re.fullmatch(r"\$\{([\w.]+)\}", value.strip())):
        node = root
        for part in match.group(1).split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConversionError(f"cannot resolve interpolation {value!r} in the checkpoint's cfg")
            node = node[part]
        value = node
    return value


def fairseq_hyperparameters(checkpoint: dict) -> dict:
    if checkpoint.get("cfg") is not None:
        cfg = checkpoint["cfg"]
        model = cfg.get("model") if isinstance(cfg, dict) else None
        if isinstance(model, Namespace):
            model = vars(model)
        if not isinstance(model, dict):
            raise ConversionError("the checkpoint's cfg has no 'model' section")
        return {k: _resolve(v, cfg) for k, v in model.items()}
    if isinstance(checkpoint.get("args"), Namespace):
        return dict(vars(checkpoint["args"]))
    raise ConversionError("a fairseq checkpoint needs its hyper-parameters in 'cfg' or 'args'")


def read_source(path: Path, config_path: Path | None) -> tuple[dict, dict, bool]:
    """(TorchScale Decoder state dict without prefix, DecoderConfig-style options, is_fairseq)."""
    checkpoint = load_checkpoint(path)
    if not isinstance(checkpoint, dict):
        raise ConversionError(f"{path} does not hold a state dict or a fairseq checkpoint")
    if isinstance(checkpoint.get("model"), dict) and any(k.startswith("decoder.") for k in checkpoint["model"]):
        state = {k[len("decoder."):]: v for k, v in checkpoint["model"].items() if k.startswith("decoder.")}
        options = {**FAIRSEQ_DEFAULTS, **fairseq_hyperparameters(checkpoint)}
        return state, options, True
    if config_path is None:
        raise ConversionError(f"{path} is a plain Decoder state dict: pass its DecoderConfig as --config CONFIG.json")
    options = {**DECODER_DEFAULTS, **json.loads(Path(config_path).read_text())}
    return checkpoint, options, False


# ---------------------------------------------------------------- TorchScale -> LEX


def lex_config(options: dict, state: dict, fairseq: bool):
    from configuration_lex import LexConfig

    for key, what in REFUSED.items():
        if options.get(key):
            raise ConversionError(f"option {key}={options[key]!r} ({what}) cannot be expressed by LexConfig")
    if any(k.startswith("embed_positions.") and not k.endswith("_float_tensor") for k in state):
        raise ConversionError("option decoder_learned_pos (learned absolute positions) cannot be expressed by LexConfig")
    deepnorm, subln, normalize_before = options["deepnorm"], options["subln"], options["decoder_normalize_before"]
    if deepnorm:  # DecoderConfig's own precedence rules
        normalize_before, subln = False, False
    if subln:
        normalize_before, deepnorm = True, False
    activation = str(options["activation_fn"])
    if activation not in ACTIVATIONS:
        raise ConversionError(f"option activation_fn={activation!r} is not one of {list(ACTIVATIONS)}")
    if "embed_tokens.weight" not in state:
        raise ConversionError("missing key embed_tokens.weight")
    vocab, hidden = state["embed_tokens.weight"].shape
    tied = "output_projection.weight" not in state or bool(options["share_decoder_input_output_embed"])
    if tied and "output_projection.weight" in state and not torch.equal(
            state["output_projection.weight"], state["embed_tokens.weight"]):
        raise ConversionError("share_decoder_input_output_embed is set but output_projection.weight differs "
                              "from embed_tokens.weight")
    length = int(options.get("tokens_per_sample") or options["max_target_positions"])
    window = 2 * int(options["block_size"]) if options.get("block_size") else length
    absolute = None
    if fairseq and not options.get("no_token_positional_embeddings"):
        absolute = "sinusoidal"
    return LexConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(options["decoder_ffn_embed_dim"]),
        num_hidden_layers=int(options["decoder_layers"]), num_attention_heads=int(options["decoder_attention_heads"]),
        hidden_act=ACTIVATIONS[activation], max_position_embeddings=length, attention_window=window,
        position_embedding_type="xpos" if options["xpos_rel_pos"] else "none",
        xpos_scale_base=float(options["xpos_scale_base"]), layer_norm_eps=float(options["layernorm_eps"]),
        hidden_dropout=float(options["dropout"]), attention_dropout=float(options["attention_dropout"]),
        activation_dropout=float(options["activation_dropout"]), normalize_before=bool(normalize_before),
        subln=bool(subln), deepnorm=bool(deepnorm), layernorm_embedding=bool(options["layernorm_embedding"]),
        embedding_scale=1.0 if options["no_scale_embedding"] else math.sqrt(hidden), tie_word_embeddings=bool(tied),
        absolute_position_embedding=absolute, absolute_position_offset=2,  # fairseq's padding_idx (1) + 1
        # TorchScale's Decoder attends fully; the LEX fork's BCA block_size means blockwise attention.
        attention_mode="blockwise" if options.get("block_size") else "full",
    )


RENAMES = [
    (r"^embed_tokens\.", "model.embed_tokens."),
    (r"^layernorm_embedding\.", "model.layernorm_embedding."),
    (r"^layers\.(\d+)\.self_attn\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^layers\.(\d+)\.self_attn\.", r"model.layers.\1.self_attn."),
    (r"^layers\.(\d+)\.ffn\.", r"model.layers.\1.mlp."),
    (r"^layers\.(\d+)\.(self_attn_layer_norm|final_layer_norm)\.", r"model.layers.\1.\2."),
    (r"^layer_norm\.", "model.norm."),
    (r"^output_projection\.", "lm_head."),
]


def to_lex_state(state: dict, config) -> dict:
    from modeling_lex.xpos import xpos_zeta

    mapped = {}
    for key, tensor in state.items():
        if key.endswith("self_attn.xpos.scale"):
            expected = xpos_zeta(config.head_dim, config.xpos_gamma, torch.device("cpu")).to(tensor.dtype)
            if tensor.shape != expected.shape or not torch.allclose(tensor, expected):
                raise ConversionError(f"{key} is not the xPos scale of head_dim {config.head_dim}")
            continue
        if key.startswith("embed_positions.") or key == "version":
            continue
        for pattern, replacement in RENAMES:
            if re.match(pattern, key):
                mapped[re.sub(pattern, replacement, key)] = tensor
                break
        else:
            raise ConversionError(f"unexpected key {key}")
    if config.tie_word_embeddings:
        mapped.pop("lm_head.weight", None)
    return mapped


def check_against(model, state: dict) -> None:
    expected = {k: v for k, v in model.state_dict().items()
                if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
              for k in sorted(set(state) & set(expected)) if state[k].shape != expected[k].shape]
    problems = ([f"missing keys: {', '.join(missing)}"] if missing else []) + (
        [f"unexpected keys: {', '.join(unexpected)}"] if unexpected else []) + (
        [f"shape mismatches: {'; '.join(shapes)}"] if shapes else [])
    if problems:
        raise ConversionError("; ".join(problems))


def atomic_folder(out_dir: Path, force: bool):
    """A staging folder beside OUT_DIR; call the returned `commit()` to move it into place."""
    if out_dir.exists() and not force:
        raise ConversionError(f"{out_dir} exists; pass --force to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))

    def commit() -> None:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)

    return staging, commit


def convert_from_torchscale(checkpoint: Path, out_dir: Path, config_path: Path | None = None,
                            tokenizer: Path | None = None, dtype: str = "float32", force: bool = False) -> Path:
    import modeling_lex  # noqa: F401
    from modeling_lex import LexForCausalLM

    state, options, fairseq = read_source(Path(checkpoint), config_path)
    config = lex_config(options, state, fairseq)
    mapped = to_lex_state(state, config)
    model = LexForCausalLM(config)
    check_against(model, mapped)
    model.load_state_dict(mapped, strict=False)
    model.tie_weights()
    model.to(getattr(torch, dtype))
    staging, commit = atomic_folder(Path(out_dir), force)
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer).save_pretrained(staging)
        commit()
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return Path(out_dir)


# ---------------------------------------------------------------- LEX -> TorchScale


def convert_to_torchscale(hf_dir: Path, out_path: Path, force: bool = False) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM

    import modeling_lex  # noqa: F401
    from modeling_lex.xpos import xpos_zeta

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    config = model.config
    if config.position_embedding_type not in ("xpos", "none"):
        raise ConversionError(f"position_embedding_type={config.position_embedding_type!r}: TorchScale's Decoder "
                              "has only xPos (or no relative positions)")
    if config.absolute_position_embedding or not (config.attention_bias and config.mlp_bias):
        raise ConversionError("absolute positions or bias-free projections have no TorchScale Decoder equivalent")
    if config.embedding_scale not in (1.0, math.sqrt(config.hidden_size)):
        raise ConversionError(f"embedding_scale={config.embedding_scale}: TorchScale scales by 1 or sqrt(d)")
    out_path, config_path = Path(out_path), Path(out_path).with_suffix(".json")
    if (out_path.exists() or config_path.exists()) and not force:
        raise ConversionError(f"{out_path} or {config_path} exists; pass --force to replace them")
    state = {}
    inverse = [(r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.self_attn.out_proj."),
               (r"^model\.layers\.(\d+)\.mlp\.", r"layers.\1.ffn."), (r"^model\.norm\.", "layer_norm."),
               (r"^model\.", ""), (r"^lm_head\.", "output_projection.")]
    for key, tensor in model.state_dict().items():
        for pattern, replacement in inverse:
            if re.match(pattern, key):
                state[re.sub(pattern, replacement, key)] = tensor.clone()
                break
    if config.position_embedding_type == "xpos":
        scale = xpos_zeta(config.head_dim, config.xpos_gamma, torch.device("cpu")).float()
        for layer in range(config.num_hidden_layers):
            state[f"layers.{layer}.self_attn.xpos.scale"] = scale.clone()
    options = {
        "decoder_embed_dim": config.hidden_size, "decoder_attention_heads": config.num_attention_heads,
        "decoder_ffn_embed_dim": config.intermediate_size, "decoder_layers": config.num_hidden_layers,
        "decoder_normalize_before": config.normalize_before, "activation_fn": config.hidden_act,
        "dropout": config.hidden_dropout, "attention_dropout": config.attention_dropout,
        "activation_dropout": config.activation_dropout, "no_scale_embedding": config.embedding_scale == 1.0,
        "layernorm_embedding": config.layernorm_embedding, "deepnorm": config.deepnorm, "subln": config.subln,
        "share_decoder_input_output_embed": config.tie_word_embeddings,
        "max_target_positions": config.max_position_embeddings, "layernorm_eps": config.layer_norm_eps,
        "xpos_rel_pos": config.position_embedding_type == "xpos", "xpos_scale_base": config.xpos_scale_base,
        "vocab_size": config.vocab_size,
    }
    if config.attention_window != config.max_position_embeddings:
        options["block_size"] = config.attention_window // 2
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_path.parent) as staging:
        torch.save(state, Path(staging) / "state.pt")
        (Path(staging) / "config.json").write_text(json.dumps(options, indent=2))
        (Path(staging) / "state.pt").replace(out_path)
        (Path(staging) / "config.json").replace(config_path)
    return out_path, config_path


# ---------------------------------------------------------------- command line


def main_from_torchscale(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lex convert-torchscale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--config", type=Path, help="DecoderConfig keyword arguments (JSON) of a plain state dict")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer folder to save with the model")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    args = parser.parse_args(argv)
    try:
        out = convert_from_torchscale(args.checkpoint, args.out_dir, args.config, args.tokenizer, args.dtype,
                                      args.force)
    except (ConversionError, OSError, json.JSONDecodeError) as error:
        print(f"lex convert-torchscale: {error}", file=sys.stderr)
        return 2
    print(f"converted {args.checkpoint} -> {out}")
    return 0


def main_to_torchscale(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lex convert-to-torchscale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("out", type=Path, help="OUT.pt; the DecoderConfig goes to OUT.json")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    try:
        state_path, config_path = convert_to_torchscale(args.hf_dir, args.out, args.force)
    except (ConversionError, OSError) as error:
        print(f"lex convert-to-torchscale: {error}", file=sys.stderr)
        return 2
    print(f"converted {args.hf_dir} -> {state_path} + {config_path}")
    return 0
