"""TorchScale 0.3.0 Decoders (and fairseq-style LM checkpoints) -> LEX folders: same logits, same greedy tokens."""

import json
import math
import pickle
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lex.cli import main as lex

VOCAB, LENGTH = 61, 32
BASE = dict(decoder_embed_dim=32, decoder_attention_heads=4, decoder_ffn_embed_dim=48, decoder_layers=2,
            vocab_size=VOCAB, xpos_rel_pos=True, max_target_positions=LENGTH)
VARIANTS = {
    "defaults_subln_prenorm": {},
    "postnorm": dict(subln=False, decoder_normalize_before=False),
    "deepnorm": dict(deepnorm=True),
    "prenorm_no_subln_relu": dict(subln=False, activation_fn="relu"),
    "swish_shared_output": dict(activation_fn="swish", share_decoder_input_output_embed=True),
    "layernorm_embedding_scaled": dict(layernorm_embedding=True, no_scale_embedding=False, layernorm_eps=1e-6),
    "xpos_scale_base_256": dict(xpos_scale_base=256),
    "no_xpos": dict(xpos_rel_pos=False),
}


class FairseqSinusoidal(nn.Module):
    """fairseq's SinusoidalPositionalEmbedding (padding_idx 1), written from its definition for the reference."""

    def __init__(self, dim: int, padding_idx: int = 1, size: int = 512):
        super().__init__()
        half = dim // 2
        scale = math.log(10000) / (half - 1)
        frequencies = torch.exp(torch.arange(half, dtype=torch.float) * -scale)
        angles = torch.arange(size, dtype=torch.float)[:, None] * frequencies[None, :]
        table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
        table[padding_idx] = 0
        self.padding_idx = padding_idx
        self.register_buffer("table", table, persistent=False)

    def forward(self, tokens, incremental_state=None):
        mask = tokens.ne(self.padding_idx).int()
        positions = torch.cumsum(mask, dim=1) * mask + self.padding_idx
        return self.table[positions]


def torchscale_decoder(options: dict, seed: int, embed_positions=None):
    from torchscale.architecture.config import DecoderConfig
    from torchscale.architecture.decoder import Decoder

    torch.manual_seed(seed)
    args = DecoderConfig(**options)
    embed = nn.Embedding(VOCAB, args.decoder_embed_dim)
    decoder = Decoder(args, embed_tokens=embed, embed_positions=embed_positions).eval()
    with torch.no_grad():
        for name, parameter in decoder.named_parameters():
            parameter.add_(torch.randn_like(parameter) * (0.2 if parameter.dim() > 1 else 0.1))
    return decoder


def torchscale_greedy(decoder, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """TorchScale's own incremental decoding: first step over the prompt, then one token at a time."""
    state = {"is_first_step": True}
    tokens = prompt
    with torch.no_grad():
        for _ in range(steps):
            logits, _ = decoder(tokens, incremental_state=state)
            state["is_first_step"] = False
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    return tokens


def convert(tmp_path: Path, checkpoint, config: dict | None = None) -> Path:
    source = tmp_path / "checkpoint.pt"
    torch.save(checkpoint, source)
    args = ["convert-torchscale", str(source), str(tmp_path / "hf")]
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        args += ["--config", str(tmp_path / "config.json")]
    assert lex(args) == 0
    return tmp_path / "hf"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_decoder_matches_torchscale(variant, tmp_path):
    options = {**BASE, **VARIANTS[variant]}
    decoder = torchscale_decoder(options, seed=len(variant))
    folder = convert(tmp_path, decoder.state_dict(), options)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(2, VOCAB, (3, LENGTH))
    with torch.no_grad():
        expected, _ = decoder(ids)
        ours = model(ids).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)

    prompt = ids[:1, :7]
    expected_tokens = torchscale_greedy(decoder, prompt, 20)
    ours_tokens = model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(ours_tokens, expected_tokens)


def fairseq_checkpoint(decoder, hyper: dict, style: str) -> dict:
    model = {f"decoder.{k}": v for k, v in decoder.state_dict().items()}
    if style == "cfg":
        cfg = {"model": {**hyper, "decoder_input_dim": "${model.decoder_embed_dim}"}, "task": {"tokens_per_sample": 32}}
        return {"model": model, "cfg": cfg}
    return {"model": model, "args": Namespace(**hyper)}


@pytest.mark.parametrize("style", ["cfg", "args"])
def test_fairseq_checkpoint_converts_without_config(style, tmp_path):
    hyper = dict(decoder_embed_dim=32, decoder_attention_heads=4, decoder_ffn_embed_dim=48, decoder_layers=2,
                 xpos_rel_pos=True, activation_fn="relu", share_decoder_input_output_embed=True,
                 decoder_normalize_before=True, tokens_per_sample=LENGTH)
    reference_options = {**BASE, **hyper, "subln": False, "no_scale_embedding": False}
    reference_options.pop("tokens_per_sample")
    decoder = torchscale_decoder(reference_options, seed=5, embed_positions=FairseqSinusoidal(32))
    folder = convert(tmp_path, fairseq_checkpoint(decoder, hyper, style))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.config.absolute_position_embedding == "sinusoidal" and model.config.max_position_embeddings == 32
    ids = torch.randint(2, VOCAB, (2, LENGTH))
    with torch.no_grad():
        expected, _ = decoder(ids)
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_round_trip_hf_torchscale_hf_is_exact(tmp_path):
    options = {**BASE, "subln": True}
    folder = convert(tmp_path, torchscale_decoder(options, seed=3).state_dict(), options)
    assert lex(["convert-to-torchscale", str(folder), str(tmp_path / "back.pt")]) == 0
    assert lex(["convert-torchscale", str(tmp_path / "back.pt"), str(tmp_path / "again"), "--config",
                str(tmp_path / "back.json")]) == 0
    first = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    second = AutoModelForCausalLM.from_pretrained(tmp_path / "again").state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["subln"] is True


class Exploit:
    def __reduce__(self):
        import os

        return (os.system, (f"touch {MARKER}",))


MARKER = Path("/tmp/lex-convert-exploit-ran")


def test_malicious_pickle_is_refused_and_never_runs(tmp_path, capsys):
    MARKER.unlink(missing_ok=True)
    source = tmp_path / "evil.pt"
    with source.open("wb") as handle:
        pickle.dump({"model": Exploit()}, handle)
    assert lex(["convert-torchscale", str(source), str(tmp_path / "out"), "--config", "/dev/null"]) == 2
    assert "refusing to load" in capsys.readouterr().err
    assert not MARKER.exists() and not (tmp_path / "out").exists()


def test_failed_conversion_leaves_no_output_and_names_keys(tmp_path, capsys):
    decoder = torchscale_decoder(BASE, seed=1)
    state = decoder.state_dict()
    state.pop("layers.1.ffn.fc2.bias")
    state["layers.0.ffn.fc1.weight"] = state["layers.0.ffn.fc1.weight"][:, :16]
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    torch.save(state, tmp_path / "broken.pt")
    assert lex(["convert-torchscale", str(tmp_path / "broken.pt"), str(tmp_path / "out"), "--config",
                str(tmp_path / "config.json")]) == 2
    error = capsys.readouterr().err
    assert "model.layers.1.mlp.fc2.bias" in error and "model.layers.0.mlp.fc1.weight" in error
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("option, value", [("moe_freq", 2), ("multiway", True), ("rel_pos_buckets", 32)])
def test_refused_options_name_themselves(option, value, tmp_path, capsys):
    decoder = torchscale_decoder(BASE, seed=2)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, option: value}))
    torch.save(decoder.state_dict(), tmp_path / "c.pt")
    assert lex(["convert-torchscale", str(tmp_path / "c.pt"), str(tmp_path / "out"), "--config",
                str(tmp_path / "config.json")]) == 2
    assert option in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_existing_output_needs_force(tmp_path, capsys):
    folder = convert(tmp_path, torchscale_decoder(BASE, seed=4).state_dict(), BASE)
    args = ["convert-torchscale", str(tmp_path / "checkpoint.pt"), str(folder), "--config", str(tmp_path / "config.json")]
    assert lex(args) == 2 and "--force" in capsys.readouterr().err
    assert lex([*args, "--force", "--dtype", "bfloat16"]) == 0
    assert AutoModelForCausalLM.from_pretrained(folder).dtype == torch.bfloat16
