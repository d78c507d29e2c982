"""TorchScale 0.3.0 Decoders and fairseq-style TorchScale LMs <-> LEX folders.

References are TorchScale itself: its `Decoder` (with the options under test) and, for fairseq checkpoints,
the same `Decoder` built the way fairseq's `lm` model builds it, with a position module written here from
fairseq's SinusoidalPositionalEmbedding definition. Every parameter is perturbed (norms included) so that a
mapping mistake cannot pass unnoticed.
"""

import json
import math
import os
import pickle
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lex.cli import main as lex
from tests.helpers import TORCHSCALE_BASE, TORCHSCALE_LENGTH, TORCHSCALE_VOCAB, perturb, torchscale_decoder

pytestmark = pytest.mark.oldest  # also run on the oldest transformers we declare

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, LENGTH, PAD = TORCHSCALE_VOCAB, TORCHSCALE_LENGTH, 1
BASE = TORCHSCALE_BASE
VARIANTS = {  # DecoderConfig keyword arguments on top of BASE, as a TorchScale user writes them
    "defaults_prenorm_subln_gelu": {},
    "prenorm_relu": dict(subln=False, activation_fn="relu"),
    "postnorm": dict(subln=False, decoder_normalize_before=False),
    "deepnorm": dict(deepnorm=True),
    "swish_shared_output": dict(activation_fn="swish", share_decoder_input_output_embed=True),
    "scaled_embedding": dict(no_scale_embedding=False),
    "layernorm_embedding_eps": dict(layernorm_embedding=True, layernorm_eps=0.25),
    "xpos_scale_base_64": dict(xpos_scale_base=64),
    "no_xpos": dict(xpos_rel_pos=False),
}


class FairseqSinusoidal(nn.Module):
    """fairseq's SinusoidalPositionalEmbedding, written from its definition.

    Table in float32: [sin(p f) | cos(p f)], f_j = exp(-j log(10000) / (half - 1)), row padding_idx zeroed.
    Positions count non-pad tokens from padding_idx + 1; with an incremental_state (fairseq decoding one step)
    it returns the single row padding_idx + seq_len for every sequence.
    """

    def __init__(self, dim: int, padding_idx: int = PAD):
        super().__init__()
        self.dim, self.padding_idx = dim, padding_idx
        self.register_buffer("_float_tensor", torch.zeros(1))

    def table(self, size: int) -> torch.Tensor:
        half = self.dim // 2
        frequencies = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
        angles = torch.arange(size, dtype=torch.float)[:, None] * frequencies[None, :]
        table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
        table[self.padding_idx] = 0
        return table

    def forward(self, tokens, incremental_state=None):
        batch, length = tokens.shape
        weights = self.table(self.padding_idx + 1 + length)
        if incremental_state is not None:
            return weights[self.padding_idx + length].expand(batch, 1, -1)
        mask = tokens.ne(self.padding_idx).int()
        positions = (torch.cumsum(mask, dim=1) * mask).long() + self.padding_idx
        return weights[positions]


def fairseq_lm(hyper: dict, seed: int):
    """TorchScale's Decoder as fairseq's `lm` model builds it: DecoderConfig().override(args), pad masking."""
    from torchscale.architecture.config import DecoderConfig
    from torchscale.architecture.decoder import Decoder

    class LMDecoder(Decoder):
        def forward(self, tokens, **kwargs):
            return super().forward(tokens, tokens.eq(PAD), **kwargs)

    torch.manual_seed(seed)
    config = DecoderConfig()
    config.override(Namespace(**hyper))
    dim = config.decoder_embed_dim
    embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
    output = nn.Linear(dim, VOCAB, bias=False)
    if config.share_decoder_input_output_embed:
        output.weight = embed.weight
    positions = None if hyper.get("no_token_positional_embeddings") else FairseqSinusoidal(dim)
    return perturb(LMDecoder(config, embed, positions, output), seed)


def torchscale_greedy(decoder, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchScale's incremental decoding: the prompt as the first step, then one token at a time."""
    state, tokens, logits = {"is_first_step": True}, prompt, []
    with torch.no_grad():
        for _ in range(steps):
            out, _ = decoder(tokens, incremental_state=state)
            state["is_first_step"] = False
            logits.append(out[:, -1])
            tokens = torch.cat([tokens, out[:, -1:].argmax(-1)], dim=1)
    return tokens, torch.stack(logits, 1)


def fairseq_greedy(decoder, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fairseq's incremental decoding: every step is one token (the prompt forced), positions from the state."""
    state, tokens, logits = {}, prompt[:, :1], []
    with torch.no_grad():
        for t in range(prompt.shape[1] + steps - 1):
            out, _ = decoder(tokens, incremental_state=state)
            logits.append(out[:, -1])
            forced = t + 1 < prompt.shape[1]
            tokens = torch.cat([tokens, prompt[:, t + 1:t + 2] if forced else out[:, -1:].argmax(-1)], dim=1)
    return tokens, torch.stack(logits, 1)[:, prompt.shape[1] - 1:]


def convert(tmp_path: Path, checkpoint, config: dict | None = None, *extra: str) -> Path:
    source = tmp_path / "checkpoint.pt"
    torch.save(checkpoint, source)
    args = ["convert-torchscale", str(source), str(tmp_path / "hf"), *extra]
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        args += ["--config", str(tmp_path / "config.json")]
    assert lex(args) == 0
    return tmp_path / "hf"


def load(folder: Path):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None  # compare all steps, like the references
    return model


def assert_same_decoding(model, reference_tokens, reference_logits, prompt_length: int) -> None:
    prompt = reference_tokens[:, :prompt_length]
    steps = reference_tokens.shape[1] - prompt_length
    ours = model.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    torch.testing.assert_close(torch.stack(ours.logits, 1), reference_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.sequences, reference_tokens)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decoder_matches_torchscale_logits_and_incremental_decoding(variant, tmp_path):
    options = {**BASE, **VARIANTS[variant]}
    decoder = torchscale_decoder(options, seed=len(variant))
    model = load(convert(tmp_path, decoder.state_dict(), options))
    assert (model.config.attention_mode, model.config.attention_window) == ("blockwise", LENGTH)
    ids = torch.randint(3, VOCAB, (3, LENGTH))
    with torch.no_grad():
        expected, _ = decoder(ids)
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-4, rtol=1e-4)
    tokens, logits = torchscale_greedy(decoder, ids[:1, :7], steps=20)
    assert_same_decoding(model, tokens, logits, prompt_length=7)


def test_full_attention_mode_matches_torchscale_beyond_the_training_length(tmp_path):
    options = {**BASE, "max_target_positions": 16}
    decoder = torchscale_decoder(options, seed=11)
    model = load(convert(tmp_path, decoder.state_dict(), options, "--attention-mode", "full"))
    ids = torch.randint(3, VOCAB, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, decoder(ids)[0], atol=1e-4, rtol=1e-4)


FAIRSEQ_BASE = dict(decoder_embed_dim=32, decoder_attention_heads=4, decoder_ffn_embed_dim=48, decoder_layers=2,
                    decoder_normalize_before=True, activation_fn="relu", no_scale_embedding=False, subln=False,
                    deepnorm=False, dropout=0.1, share_decoder_input_output_embed=True, xpos_rel_pos=True,
                    no_token_positional_embeddings=False, decoder_learned_pos=False, layernorm_embedding=False)
FAIRSEQ_VARIANTS = {  # lm_base as fairseq-train writes it, and the other position/norm choices
    "lm_base_sinusoidal_xpos": {},
    "sinusoidal_only_gelu_separate_output": dict(xpos_rel_pos=False, activation_fn="gelu",
                                                 share_decoder_input_output_embed=False),
    "subln_layernorm_embedding_no_positions": dict(subln=True, layernorm_embedding=True,
                                                   no_token_positional_embeddings=True),
    "lex_fork_block_size": dict(no_token_positional_embeddings=True, block_size=24, tokens_per_sample=48),
}


def fairseq_checkpoint(decoder, hyper: dict, style: str) -> dict:
    model = {f"decoder.{key}": value for key, value in decoder.state_dict().items()}
    tokens_per_sample = hyper.get("tokens_per_sample", LENGTH)
    if style == "args":
        return {"model": model, "args": Namespace(**{**hyper, "tokens_per_sample": tokens_per_sample})}
    section = {**hyper, "_name": "lm", "tokens_per_sample": "${task.tokens_per_sample}",
               "max_target_positions": "${task.max_target_positions}", "decoder_input_dim": "${.decoder_embed_dim}",
               "tpu": "${common.tpu}"}  # unresolvable but unused: must not stop the conversion
    task = {"_name": "language_modeling", "tokens_per_sample": tokens_per_sample, "max_target_positions": None}
    extra_state = {"previous_best": np.float64(2.5), "train_iterator": {"epoch": 3, "shuffle": True},
                   "metrics": {"valid": {"loss": np.arange(3.0), "count": np.int64(7)}}}  # numpy, as fairseq saves
    return {"model": model, "cfg": {"model": section, "task": task}, "optimizer_history": [{"num_updates": 10}],
            "extra_state": extra_state}


@pytest.mark.parametrize("variant, style", [(variant, "cfg") for variant in FAIRSEQ_VARIANTS]
                         + [("lm_base_sinusoidal_xpos", "args")])
def test_fairseq_checkpoint_converts_without_config(variant, style, tmp_path):
    hyper = {**FAIRSEQ_BASE, **FAIRSEQ_VARIANTS[variant]}
    decoder = fairseq_lm(hyper, seed=len(variant))
    model = load(convert(tmp_path, fairseq_checkpoint(decoder, hyper, style)))
    config = model.config
    assert config.absolute_position_embedding == (None if hyper["no_token_positional_embeddings"] else "sinusoidal")
    assert (config.pad_token_id, config.max_position_embeddings) == (PAD, hyper.get("tokens_per_sample", LENGTH))
    assert config.attention_window == hyper.get("block_size", LENGTH)
    ids = torch.randint(3, VOCAB, (2, config.attention_window))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, decoder(ids)[0], atol=1e-4, rtol=1e-4)
    tokens, logits = fairseq_greedy(decoder, ids[:1, :4], steps=20)
    assert_same_decoding(model, tokens, logits, prompt_length=4)


def test_fairseq_deepnorm_is_pre_norm(tmp_path, capsys):
    """lm_base forces pre-norm and fairseq's override skips DecoderConfig's rules: deepnorm stays pre-norm."""
    hyper = {**FAIRSEQ_BASE, "deepnorm": True}
    decoder = fairseq_lm(hyper, seed=3)
    assert decoder.layer_norm is not None and decoder.layers[0].alpha > 1
    source = tmp_path / "checkpoint.pt"
    torch.save(fairseq_checkpoint(decoder, hyper, "cfg"), source)
    assert lex(["convert-torchscale", str(source), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    model = load(tmp_path / "hf")
    assert model.config.deepnorm and model.config.normalize_before
    ids = torch.randint(3, VOCAB, (2, LENGTH))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, decoder(ids)[0], atol=1e-4, rtol=1e-4)
    tokens, logits = fairseq_greedy(decoder, ids[:1, :4], steps=20)
    assert_same_decoding(model, tokens, logits, prompt_length=4)


def state_and_config(folder: Path) -> tuple[dict, dict]:
    return (AutoModelForCausalLM.from_pretrained(folder).state_dict(),
            json.loads((folder / "config.json").read_text()))


def assert_identical(first: Path, second: Path) -> None:
    (a, config_a), (b, config_b) = state_and_config(first), state_and_config(second)
    assert config_a == config_b
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_through_a_torchscale_decoder_is_exact(tmp_path):
    from torchscale.architecture.config import DecoderConfig
    from torchscale.architecture.decoder import Decoder

    options = {**BASE, "share_decoder_input_output_embed": True, "no_scale_embedding": False}
    folder = convert(tmp_path, torchscale_decoder(options, seed=3).state_dict(), options)
    assert lex(["convert-to-torchscale", str(folder), str(tmp_path / "back.pt")]) == 0

    # TorchScale tooling takes it: strict load into a Decoder built from back.json, same logits.
    args = DecoderConfig(**json.loads((tmp_path / "back.json").read_text()))
    decoder = Decoder(args, embed_tokens=nn.Embedding(VOCAB, args.decoder_embed_dim)).eval()
    decoder.load_state_dict(torch.load(tmp_path / "back.pt", weights_only=True), strict=True)
    ids = torch.randint(3, VOCAB, (2, LENGTH))
    with torch.no_grad():
        torch.testing.assert_close(decoder(ids)[0], load(folder)(ids).logits, atol=1e-5, rtol=1e-5)

    assert lex(["convert-torchscale", str(tmp_path / "back.pt"), str(tmp_path / "again"),
                "--config", str(tmp_path / "back.json")]) == 0
    assert_identical(folder, tmp_path / "again")


def test_round_trip_of_a_model_made_here_through_fairseq_format_is_exact(tmp_path):
    """Post-norm + subln + sinusoidal: only a fairseq-style checkpoint keeps all three (DecoderConfig would not)."""
    from configuration_lex import LexConfig
    from modeling_lex import LexForCausalLM

    config = LexConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=LENGTH, normalize_before=False, subln=True,
                       hidden_act="relu", embedding_scale=math.sqrt(32), tie_word_embeddings=False,
                       absolute_position_embedding="sinusoidal", pad_token_id=PAD, bos_token_id=0, eos_token_id=2)
    model = perturb(LexForCausalLM(config), seed=9)
    model.save_pretrained(tmp_path / "made_here")
    assert lex(["convert-to-torchscale", str(tmp_path / "made_here"), str(tmp_path / "back.pt"),
                "--format", "decoder"]) == 2
    assert lex(["convert-to-torchscale", str(tmp_path / "made_here"), str(tmp_path / "back.pt")]) == 0
    assert not (tmp_path / "back.json").exists()

    checkpoint = torch.load(tmp_path / "back.pt", weights_only=True)
    reference = fairseq_lm(checkpoint["cfg"]["model"], seed=0)
    reference.load_state_dict({k[len("decoder."):]: v for k, v in checkpoint["model"].items()}, strict=True)
    ids = torch.randint(3, VOCAB, (2, LENGTH))
    with torch.no_grad():
        torch.testing.assert_close(reference(ids)[0], model(ids).logits, atol=1e-4, rtol=1e-4)

    assert lex(["convert-torchscale", str(tmp_path / "back.pt"), str(tmp_path / "again")]) == 0
    assert_identical(tmp_path / "made_here", tmp_path / "again")


@pytest.mark.parametrize("field, value", [("position_embedding_type", "alibi"), ("attention_bias", False)])
def test_to_torchscale_refuses_what_torchscale_lacks(field, value, tmp_path, capsys):
    from configuration_lex import LexConfig
    from modeling_lex import LexForCausalLM

    config = LexConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, **{field: value})
    LexForCausalLM(config).save_pretrained(tmp_path / "m")
    assert lex(["convert-to-torchscale", str(tmp_path / "m"), str(tmp_path / "out.pt")]) == 2
    assert field in capsys.readouterr().err and not (tmp_path / "out.pt").exists()


MARKER = Path("/tmp/lex-convert-exploit-ran")


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


@pytest.mark.parametrize("writer", ["pickle", "torch.save", "numpy object array"])
def test_malicious_pickle_is_refused_and_never_runs(writer, tmp_path, capsys):
    MARKER.unlink(missing_ok=True)
    source = tmp_path / "evil.pt"
    payload = {"model": {"decoder.embed_tokens.weight": [0.0]}, "args": Exploit()}
    if writer == "pickle":
        source.write_bytes(pickle.dumps(payload, protocol=2))
    elif writer == "torch.save":
        torch.save(payload, source)
    else:
        hidden = np.empty(1, dtype=object)
        hidden[0] = Exploit()
        torch.save({"model": {"decoder.embed_tokens.weight": torch.zeros(1)}, "extra_state": hidden}, source)
    assert lex(["convert-torchscale", str(source), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "refusing to load" in error and ("system" in error or "ObjectDType" in error)
    assert not MARKER.exists() and not (tmp_path / "out").exists()


def test_mismatched_checkpoint_names_its_keys_and_leaves_nothing(tmp_path, capsys):
    state = torchscale_decoder(BASE, seed=1).state_dict()
    del state["layers.1.ffn.fc2.bias"]
    state["layers.0.ffn.fc1.weight"] = state["layers.0.ffn.fc1.weight"][:, :16]
    state["layers.0.ffn.gate.weight"] = torch.zeros(1)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    torch.save(state, tmp_path / "broken.pt")
    assert lex(["convert-torchscale", str(tmp_path / "broken.pt"), str(tmp_path / "out"),
                "--config", str(tmp_path / "config.json")]) == 2
    error = capsys.readouterr().err
    assert "missing keys: layers.1.ffn.fc2.bias" in error
    assert "unexpected keys: layers.0.ffn.gate.weight" in error
    assert "layers.0.ffn.fc1.weight is (48, 16), the options need (48, 32)" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.pt", "config.json"]


def test_failure_while_writing_leaves_the_previous_output_untouched(tmp_path, monkeypatch):
    from convert.checkpoint import ConversionError
    from convert.torchscale import convert_from_torchscale
    from modeling_lex import LexForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(BASE))
    torch.save(torchscale_decoder(BASE, seed=2).state_dict(), tmp_path / "c.pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous")

    def half_written(self, folder, **kwargs):
        (Path(folder) / "config.json").write_text("{")
        raise ConversionError("disk full")

    monkeypatch.setattr(LexForCausalLM, "save_pretrained", half_written)
    with pytest.raises(ConversionError, match="disk full"):
        convert_from_torchscale(tmp_path / "c.pt", out, tmp_path / "config.json", force=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "config.json", "out"]


@pytest.mark.parametrize("options, named", [
    (dict(moe_freq=2, moe_expert_count=4), "moe_freq"),
    (dict(multiway=True), "multiway"),
    (dict(rel_pos_buckets=32, max_rel_pos=128), "rel_pos_buckets"),
    (dict(no_output_layer=True), "no_output_layer"),
    (dict(activation_fn="gelu_fast"), "activation_fn"),
])
def test_refused_options_name_themselves(options, named, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **options}))
    torch.save(torchscale_decoder(BASE, seed=2).state_dict(), tmp_path / "c.pt")
    assert lex(["convert-torchscale", str(tmp_path / "c.pt"), str(tmp_path / "out"),
                "--config", str(tmp_path / "config.json")]) == 2
    assert f"option {named}=" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_learned_positions_and_unresolved_options_are_refused_by_name(tmp_path, capsys):
    hyper = {**FAIRSEQ_BASE, "no_token_positional_embeddings": True}
    checkpoint = fairseq_checkpoint(fairseq_lm(hyper, seed=4), hyper, "cfg")
    checkpoint["model"]["decoder.embed_positions.weight"] = torch.zeros(LENGTH + 2, 32)
    checkpoint["cfg"]["model"]["no_token_positional_embeddings"] = False
    checkpoint["cfg"]["model"]["decoder_learned_pos"] = True
    torch.save(checkpoint, tmp_path / "learned.pt")
    assert lex(["convert-torchscale", str(tmp_path / "learned.pt"), str(tmp_path / "out")]) == 2
    assert "decoder_learned_pos" in capsys.readouterr().err

    checkpoint["cfg"]["model"].update(decoder_learned_pos=False, decoder_layers="${model.layers}")
    del checkpoint["model"]["decoder.embed_positions.weight"]
    torch.save(checkpoint, tmp_path / "unresolved.pt")
    assert lex(["convert-torchscale", str(tmp_path / "unresolved.pt"), str(tmp_path / "out")]) == 2
    assert "decoder_layers=${model.layers}" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_existing_output_needs_force_and_dtype_and_tokenizer_are_saved(tmp_path, capsys):
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 5)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   eos_token="t2", pad_token="t1")
    fast.save_pretrained(tmp_path / "tok")
    folder = convert(tmp_path, torchscale_decoder(BASE, seed=4).state_dict(), BASE)
    args = ["convert-torchscale", str(tmp_path / "checkpoint.pt"), str(folder), "--config",
            str(tmp_path / "config.json"), "--tokenizer", str(tmp_path / "tok"), "--dtype", "bfloat16"]
    assert lex(args) == 2 and "--force" in capsys.readouterr().err
    assert lex([*args, "--force"]) == 0
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.bfloat16 and (model.config.eos_token_id, model.config.pad_token_id) == (2, 1)
    assert len(AutoTokenizer.from_pretrained(folder)) == VOCAB - 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
