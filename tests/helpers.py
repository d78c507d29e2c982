"""Builders the test modules share: tiny LEX configs and models, prompts, padded and packed batches, a word
tokenizer, and TorchScale reference decoders. Test modules import from here, never from each other."""

import torch
from torch import nn

import modeling_lex  # noqa: F401  (registers the Auto classes)
from configuration_lex import LexConfig
from modeling_lex import LexForCausalLM
from tests import reference

W = 16  # tiny_config's attention_window
PAD = 0  # never drawn as a prompt token below, so generate() infers no padding inside prompts


def tiny_config(**overrides) -> LexConfig:
    values = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=W,
    )
    values.update(overrides)
    return LexConfig(**values)


def perturbed_model(config: LexConfig, seed: int = 0) -> LexForCausalLM:
    """A model whose every parameter (norms and biases included) is random, so no term passes by accident."""
    torch.manual_seed(seed)
    model = LexForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            scale = 0.15 if parameter.dim() > 1 else 0.1
            parameter.add_(torch.randn_like(parameter) * scale)
    return model


def prompt(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 97, (batch, length), generator=generator)


def greedy(model, ids, **kwargs):
    return model.generate(
        ids, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=PAD, **kwargs
    )


def left_padded(lengths: list[int]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    rows = [prompt(1, n, seed=n)[0] for n in lengths]
    longest = max(lengths)
    ids = torch.full((len(rows), longest), PAD)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, longest - len(row) :] = row
        mask[i, longest - len(row) :] = 1
    return rows, ids, mask


def left_pad_mask(ids: torch.Tensor, pads: list[int]) -> torch.Tensor:
    """An attention mask for `ids` whose row r starts with pads[r] padding positions."""
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return mask


def assert_rows_equal_reference(model: LexForCausalLM, ids: torch.Tensor, logits: torch.Tensor,
                                pads: list[int] | None = None) -> None:
    """Each row's logits after its padding equal tests/reference.py's float64 forward of that row (1e-5)."""
    for row, pad in enumerate(pads or [0] * len(ids)):
        expected = reference.forward(model.state_dict(), model.config, ids[row], pad=pad)
        torch.testing.assert_close(logits[row, pad:].double(), expected[pad:], atol=1e-5, rtol=1e-5)


def packed(lengths: list[int], seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Documents of `lengths` packed into one row with position_ids restarting at each (padding-free)."""
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 97, (n,), generator=generator) for n in lengths]
    return docs, torch.cat(docs)[None], torch.cat([torch.arange(n) for n in lengths])[None]


def word_tokenizer():
    """A 96-word WordLevel tokenizer built locally (w0 ... w95, <pad> = 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(96)]
    backend = Tokenizer(models.WordLevel({w: i + 1 for i, w in enumerate(words)} | {"<pad>": 0}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>"), words


# ---------------------------------------------------------------- TorchScale 0.3.0 reference decoders

TORCHSCALE_VOCAB, TORCHSCALE_LENGTH = 61, 32
TORCHSCALE_BASE = dict(decoder_embed_dim=32, decoder_attention_heads=4, decoder_ffn_embed_dim=48, decoder_layers=2,
                       vocab_size=TORCHSCALE_VOCAB, xpos_rel_pos=True, max_target_positions=TORCHSCALE_LENGTH)


def perturb(module: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn_like(parameter) * (0.2 if parameter.dim() > 1 else 0.3))
    return module.eval()


def torchscale_decoder(options: dict, seed: int):
    from torchscale.architecture.config import DecoderConfig
    from torchscale.architecture.decoder import Decoder

    torch.manual_seed(seed)
    args = DecoderConfig(**options)
    return perturb(Decoder(args, embed_tokens=nn.Embedding(TORCHSCALE_VOCAB, args.decoder_embed_dim)), seed)


# ---------------------------------------------------------------- small trained models

def markov_batch(batch: int, length: int, seed: int, vocab: int = 97) -> torch.Tensor:
    """Token sequences of a fixed random chain (token t is followed by its favourite next token 3 times in 4), so
    that a model learns to predict well but not perfectly: drafters and prompt lookup get candidates accepted and
    rejected, which random weights hardly ever do."""
    table = torch.randperm(vocab - 1, generator=torch.Generator().manual_seed(1234)) + 1  # favourite next token
    generator = torch.Generator().manual_seed(seed)
    rows = torch.empty(batch, length, dtype=torch.long)
    rows[:, 0] = torch.randint(1, vocab, (batch,), generator=generator)
    for t in range(1, length):
        noise = torch.randint(1, vocab, (batch,), generator=generator)
        follow = torch.rand(batch, generator=generator) < 0.75
        rows[:, t] = torch.where(follow, table[rows[:, t - 1] - 1], noise)
    return rows


def trained_model(config: LexConfig, steps: int = 150, seed: int = 0) -> LexForCausalLM:
    """A tiny model trained in-test on `markov_batch` sequences of the training length (a few seconds)."""
    torch.manual_seed(seed)
    model = LexForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        ids = markov_batch(16, config.max_position_embeddings, seed=seed * 100_000 + step)
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def load_weights(state: dict, strict: bool = True, **config) -> LexForCausalLM:
    """A LexForCausalLM of tiny_config(**config) holding `state` (weights trained under another attention mode)."""
    model = LexForCausalLM(tiny_config(**config)).eval()
    model.load_state_dict(state, strict=strict)
    return model


def greedy_tokens(model, ids, new_tokens: int, **options) -> torch.Tensor:
    """The sequences of transformers' greedy search."""
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD, **options)


# ---------------------------------------------------------------- tiny Llama sources, as users hold them


def tiny_llama_source(corpus, folder, vocab_size: int, hidden_size: int, intermediate_size: int):
    """A tiny LlamaForCausalLM (2 layers, 4 heads, 2 key-value heads) with a BPE of the corpus's *.txt files,
    perturbed off its initialisation, saved by transformers itself in `folder` and as `tiny.gguf` beside it (where
    the gguf package is installed). Returns (model, tokenizer, gguf path)."""
    import importlib.util

    from transformers import LlamaConfig, LlamaForCausalLM

    from lex.data import train_tokenizer

    tokenizer = train_tokenizer([p.read_text() for p in sorted(corpus.glob("*.txt"))], vocab_size)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = perturb(LlamaForCausalLM(config), 0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    gguf = folder.parent / "tiny.gguf"
    if importlib.util.find_spec("gguf"):
        llama_gguf(gguf, model, tokenizer)
    return model, tokenizer, gguf


# ---------------------------------------------------------------- tiny .gguf files


def llama_gguf(path, model, tokenizer) -> None:
    """Write a LlamaForCausalLM (float32) and its byte-level BPE tokenizer as a llama.cpp GGUF file, as llama.cpp's
    convert_hf_to_gguf.py writes one: tensors under GGUF's names, q/k rows permuted per head into its
    interleaved rotation layout (`permute` there), written here from that script, not from this package."""
    import json

    import gguf

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
        return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
            weights.shape)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    backend = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(backend["vocab"], key=backend["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in tokenizer.all_special_tokens else 1 for token in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            if module == "self_attn.q_proj":
                tensor = permute(tensor, heads)
            elif module == "self_attn.k_proj":
                tensor = permute(tensor, kv_heads)
            name = f"blk.{index}.{layer_names[module]}.{kind}"
        else:
            name = names[name]
        writer.add_tensor(name, tensor.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------- a Gemma 3 source with local and global layers

GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def gemma3_source(local_window: int = 8, seed: int = 4, **overrides):
    """transformers' own Gemma3ForCausalLM, tiny: local layers (their own window and rope theta) between global ones
    (linear-scaled rope), q/k norms, Gemma's norms and scaled embeddings, every parameter perturbed."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12, sliding_window=local_window,
        layer_types=GEMMA3_LAYERS, max_position_embeddings=W, tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **overrides)
    return perturb(Gemma3ForCausalLM(config).eval(), seed)
