"""Weight-only quantization for CPU decoding: torchao quantizes the weights, torch's packed CPU kernels multiply.

Decoding one token reads every weight once, so on a CPU its speed is the width of the weights. Two widths
(`QUANTIZATIONS`) share one stored form, torchao's `Int8WeightOnlyConfig` (`Int8Tensor`: int8, symmetric, one
scale per output row), and differ in the layout `for_cpu` gives the weights for the CPU's kernels:

- int8: every Linear becomes an `Int8Linear`, which calls torch's fused `torch._weight_int8pack_mm` on the stored
  int8 values and scales (torchao's own eager matmul widens the whole weight on every call).
- int4: every Linear but the LM head is requantized from its int8 values into torchao's CPU int4 layout
  (`PrototypeInt4WeightOnlyConfig`: asymmetric groups of `INT4_GROUP_SIZE` input channels with float scales and
  zeros, `Int4OpaqueTensor`, multiplied by `aten._weight_int4pack_mm_for_cpu`); the LM head stays int8: at 4 bits
  it costs SmolLM2-135M a quarter of its perplexity, where the body's 4 bits cost under 1%. torchao cannot write
  this layout to safetensors, so a folder stores the int8 form and the layout is derived as it loads.

A tied LM head is untied first, so the embedding keeps its rows for the lookup and decoding reads the head's own
copy. The quantized Linears multiply in bfloat16 (`KERNEL_DTYPE`) whatever the activations' dtype: they round
their input to it and return the activations' dtype. The rest of the model (norms, attention, the caches and the
block memory's store) computes in the activations' dtype, float32 unless asked otherwise: torch's packed kernels
are fastest on bfloat16 (its int4 CPU kernel is an order of magnitude slower on float32), and its CPU attention
for one query is several times faster on float32.

In memory (`quantize`) and from a saved folder (`save_quantized`, then `from_pretrained` and `for_cpu` with the
folder's `stored_kind`) a model goes through the same steps on the same bfloat16 weights, so both give the same
logits in the same activations' dtype. A folder is written through transformers' documented path (`TorchAoConfig` at `from_pretrained`, then
`save_pretrained`: safetensors, no pickle), loads quantized with a plain `AutoModelForCausalLM.from_pretrained`
(int8 weights), and names in `QUANTIZATION_FILE` the layout it is read in.

This module owns the coupling with torchao; it targets torchao 0.18 (the `cpu-quant` extra) with transformers
5.23-5.25.
"""

import json
import shutil
import tempfile
from pathlib import Path
from typing import Literal, get_args

import torch
from torch import nn
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, TorchAoConfig

from lex_base.errors import LexError
from lex_base.staging import atomic_directory

Quantization = Literal["int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
INT4_GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1 group: a Q4_1 checkpoint's 16 levels a group survive requantization
INT4_CPU_ROWS = 16  # the tinygemm CPU layout packs output rows by 16; other weights stay int8
KERNEL_DTYPE = torch.bfloat16  # what the quantized Linears multiply in, and the weights are quantized from
QUANTIZATION_FILE = "lex_quantization.json"  # {"weights": KIND}: the layout a saved folder is read in


MODEL_FILES = ("config.json", "generation_config.json")  # with model*.safetensors: what save_pretrained writes


class QuantizationError(LexError, ValueError):
    """A quantization that cannot be done; the message names the field and the allowed values."""


def torchao():
    """torchao's quantization module, or a QuantizationError saying how to install it."""
    try:
        import torchao.quantization
    except ImportError as error:
        raise QuantizationError(f"quantized weights need torchao ({error}): pip install -e \".[cpu-quant]\"") from None
    return torchao.quantization


def check_kind(kind: str) -> None:
    if kind not in QUANTIZATIONS:
        raise QuantizationError(f"quantize={kind!r}: allowed values are {', '.join(QUANTIZATIONS)}")


def weight_config():
    """torchao's config of the stored form (both kinds)."""
    return torchao().Int8WeightOnlyConfig()


def quantization_config() -> TorchAoConfig:
    """The `quantization_config` of the stored form for `from_pretrained`: every Linear, the LM head included (the
    input embedding stays unquantized)."""
    return TorchAoConfig(weight_config(), include_input_output_embeddings=True,
                         modules_to_not_convert=["model.embed_tokens"])


def untie(model: nn.Module) -> nn.Module:
    """`model` with its LM head holding its own copy of a tied embedding, so that the head can be quantized
    while the embedding's lookup keeps its rows."""
    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    return model


def check_supported(model: nn.Module, kind: str) -> None:
    """Refuse, naming the layer, a Linear whose input width int4's groups do not divide."""
    check_kind(kind)
    if kind != "int4":
        return
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.in_features % INT4_GROUP_SIZE:
            raise QuantizationError(f"quantize='int4': {name} has {module.in_features} input features, not a "
                                    f"multiple of the int4 group size {INT4_GROUP_SIZE} (use quantize='int8')")


def quantize(model: nn.Module, kind: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """`model` (a causal LM, in eval mode) with `kind` weights in place, quantized from their bfloat16 values, and
    `dtype` activations, ready for CPU decoding: what `from_pretrained` of a `save_quantized` folder (in `dtype`)
    followed by `for_cpu` gives."""
    check_supported(model, kind)
    untie(model.to(KERNEL_DTYPE))
    embedding = model.get_input_embeddings()
    torchao().quantize_(model, weight_config(),
                        filter_fn=lambda module, name: isinstance(module, nn.Linear) and module is not embedding)
    model.config.quantization_config = quantization_config()
    quantized = set()
    for module in for_cpu(model, kind).modules():
        if isinstance(module, Int8Linear):
            quantized |= {id(module.qdata), id(module.scale)}
        elif isinstance(module, Int4Linear):
            quantized |= {id(module.qdata), id(module.scale_and_zero)}
    for tensor in [*model.parameters(), *model.buffers()]:  # the rest computes in the activations' dtype
        if id(tensor) not in quantized and tensor.is_floating_point():
            tensor.data = tensor.data.to(dtype)
    model.config.dtype = dtype
    return model


class Int8Linear(nn.Module):
    """A Linear of int8 weights with one scale per output row, multiplied by torch's fused CPU kernel
    (`torch._weight_int8pack_mm`) in `KERNEL_DTYPE` without widening the weight. The scales are stored in
    `KERNEL_DTYPE`, which the kernel takes (a compiled step's kernel reads them as stored, which Inductor
    requires of it); the input is rounded to it and the output returned in the input's dtype."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qdata.shape
        self.register_buffer("qdata", qdata.detach().clone(memory_format=torch.contiguous_format))
        self.register_buffer("scale", scale.reshape(-1).to(KERNEL_DTYPE).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        y = torch._weight_int8pack_mm(flat, self.qdata, self.scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


class Int4Linear(nn.Module):
    """A Linear of int4 weights in torchao's CPU layout (`Int4OpaqueTensor`: packed by
    `aten._convert_weight_to_int4pack_for_cpu`, `KERNEL_DTYPE` scales and zeros a group of `INT4_GROUP_SIZE`),
    multiplied by torch's tinygemm CPU kernel (`aten._weight_int4pack_mm_for_cpu`) on the packed tensors
    themselves, as torchao's own `linear` does, without a tensor subclass in the model (a compiled step then
    guards plain buffers). The input is rounded to `KERNEL_DTYPE` and the output returned in the input's
    dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qdata", weight.qdata)
        self.register_buffer("scale_and_zero", weight.scale_and_zero)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qdata, INT4_GROUP_SIZE, self.scale_and_zero)
        y = y.to(x.dtype) if self.bias is None else y.to(x.dtype) + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {INT4_GROUP_SIZE}"


def for_cpu(model: nn.Module, kind: str) -> nn.Module:
    """`model` with its stored int8 weights (see the module docstring) in the layouts the CPU kernels read for
    `kind`: Linears swapped for `Int8Linear`s, or for int4 every Linear but the LM head requantized from its
    bfloat16 values into the tinygemm CPU layout, an `Int4Linear` (those with a multiple of `INT4_CPU_ROWS`
    output rows; others stay int8). Leaves other weights as they are."""
    check_kind(kind)
    quantization = torchao()
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization.quantize_.workflows import Int8Tensor

    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or not isinstance(child.weight, Int8Tensor):
                continue
            if kind == "int4" and child is not head and child.out_features % INT4_CPU_ROWS == 0:
                plain = nn.Linear(child.in_features, child.out_features, bias=False, dtype=KERNEL_DTYPE)
                plain.weight = nn.Parameter(child.weight.dequantize().to(KERNEL_DTYPE), requires_grad=False)
                quantization.quantize_(plain, PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP_SIZE))
                setattr(parent, name, Int4Linear(plain.weight, child.bias))
            else:
                setattr(parent, name, Int8Linear(child.weight.qdata, child.weight.scale, child.bias))
    return model


def weights_of(model: nn.Module) -> str | None:
    """The kind of `model`'s quantized weights as laid out for the CPU (None: not laid out so)."""
    modules = list(model.modules())
    if any(isinstance(m, Int4Linear) for m in modules):
        return "int4"
    return "int8" if any(isinstance(m, Int8Linear) for m in modules) else None


def stored_kind(folder: str | Path) -> str | None:
    """The kind a model folder is read in: `QUANTIZATION_FILE`'s (`save_quantized`), "int8" for other torchao
    Int8WeightOnlyConfig folders, None for a folder without quantized weights."""
    folder = Path(folder)
    if (folder / QUANTIZATION_FILE).is_file():
        kind = json.loads((folder / QUANTIZATION_FILE).read_text(encoding="utf-8")).get("weights")
        check_kind(kind)
        return kind
    path = folder / "config.json"
    quantization = (json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}).get("quantization_config")
    if not quantization or quantization.get("quant_method") != "torchao":
        return None
    quant_type = quantization.get("quant_type") or {}
    name = quant_type.get("default", quant_type).get("_type") if isinstance(quant_type, dict) else None
    if name != "Int8WeightOnlyConfig":
        raise QuantizationError(f"{folder}: its torchao quantization_config is {name}; lex reads folders of "
                                "Int8WeightOnlyConfig weights (lex convert-hf --quantize int8|int4 writes them)")
    return "int8"


def save_quantized(model: nn.Module, out_dir: str | Path, kind: str, dtype: torch.dtype = torch.bfloat16,
                   force: bool = False, beside: str | Path | None = None) -> Path:
    """Write `model` (unquantized) to `out_dir` as a folder that `from_pretrained` loads with `kind` weights and
    `dtype` activations: untied and cast, saved to a scratch folder, quantized by `from_pretrained` with
    `quantization_config()` and saved again with `QUANTIZATION_FILE` naming `kind`, and with the files of folder `beside` (a tokenizer, a model card)
    that are not weights or configs. `out_dir` appears only when complete (an existing one is refused unless
    `force`)."""
    check_supported(model, kind)
    out_dir = Path(out_dir)
    with atomic_directory(out_dir, force) as staging:
        with tempfile.TemporaryDirectory(dir=staging.parent, prefix=f".{out_dir.name}.unquantized-") as scratch:
            untie(model.to(dtype)).save_pretrained(scratch)
            quantized = AutoModelForCausalLM.from_pretrained(scratch, quantization_config=quantization_config(),
                                                             dtype=dtype)
            quantized.save_pretrained(staging)
        (staging / QUANTIZATION_FILE).write_text(json.dumps({"weights": kind}) + "\n", encoding="utf-8")
        for file in sorted(Path(beside).iterdir()) if beside is not None else ():
            if (file.is_file() and file.name not in (*MODEL_FILES, QUANTIZATION_FILE)
                    and not file.name.startswith("model")):
                shutil.copy2(file, staging / file.name)
    return out_dir


def quantize_folder(src_dir: str | Path, out_dir: str | Path, kind: str, dtype: torch.dtype = torch.bfloat16,
                    force: bool = False) -> Path:
    """The unquantized model folder `src_dir` -> a folder of `kind` weights (`save_quantized`), its tokenizer and
    model card carried over, the card saying how the weights are stored and read."""
    src_dir = Path(src_dir)
    card = src_dir / "README.md"
    if card.is_file():
        card.write_text(quantized_card(card.read_text(encoding="utf-8"), kind, dtype), encoding="utf-8")
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=dtype).eval()
    return save_quantized(model, out_dir, kind, dtype, force, beside=src_dir)


def quantized_card(text: str, kind: str, dtype: torch.dtype) -> str:
    """A model card (README.md) with the tags and the section of `kind` weights added."""
    card = ModelCard(text)
    card.data.tags = [*(card.data.tags or []), "torchao", kind]
    layout = {"int8": "torch's packed int8 kernel",
              "int4": f"torchao's CPU int4 layout (groups of {INT4_GROUP_SIZE}) for every Linear but the LM head"}
    card.text += (f"\n## Quantized weights\n\nEvery Linear, the LM head included, is stored in int8 (torchao's "
                  "`Int8WeightOnlyConfig`, one scale per output row); the embedding and the norms are "
                  f"{str(dtype).removeprefix('torch.')}, and so are the activations. `from_pretrained` loads the "
                  f"folder quantized (it needs `torchao`); `lex.quantization.for_cpu(model, \"{kind}\")` then lays "
                  f"the weights out for {layout[kind]}, as `lex generate` and `lex eval-length` do.\n")
    return str(card)
