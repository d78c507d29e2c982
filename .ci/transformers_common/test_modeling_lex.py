"""transformers' shared CausalLM model tests (tests/causal_lm_tester.py) run against LEX, out of tree.

Copied by run.sh into the checkout built by /work/shared/transformers-common-tests/setup.sh as
tests/models/lex/test_modeling_lex.py, the way tests/models/llama/test_modeling_llama.py is written in transformers.
The environment variable LEX_COMMON_CONFIG picks the configuration under test:
  default       the tester's defaults (seq_length 7; attention_window = max_position_embeddings = 512)
  small_window  attention_window=4, seq_length=11: the window is shorter than the sequence (bounded cache)
  llama         a Llama-shaped LEX: 4 heads / 2 KV heads (GQA), RMSNorm, gated SiLU MLP, RoPE with llama3 scaling
  qwen3         what convert.hf.lex_from_hf makes of a Qwen3ForCausalLM: GQA, RMSNorm, gated SiLU MLP, RoPE
                (theta 10^6), per-head q/k norms (qk_norm), no biases, full attention
  qwen3_sliding that Qwen3 converted with --attention_mode sliding --attention_window 4 --attention_sinks 2
                (seq_length 11: the cache is bounded)
  gemma3        what it makes of a Gemma3ForCausalLM (text): Gemma's RMSNorm (1 + w), GeGLU (gelu_pytorch_tanh),
                post-sublayer norms, query_pre_attn_scalar, sqrt(hidden)-scaled embeddings in the lookup, q/k norms,
                tied embeddings, a local layer (window 4, its own rope) then a global one (full attention)
"""

import os
import unittest

from transformers import is_torch_available
from transformers.testing_utils import require_torch

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester

from configuration_lex import LexConfig

if is_torch_available():
    from modeling_lex import LexForCausalLM, LexModel

LEX_COMMON_CONFIG = os.environ.get("LEX_COMMON_CONFIG", "default")

# The tester's attributes whose names are LexConfig fields go into the config (CausalLMModelTester.get_config);
# the others (seq_length, batch_size, ...) shape the inputs.
_MAX_POSITION_EMBEDDINGS = 512  # transformers.testing_utils._TEXT_MODEL_TESTER_DEFAULTS["max_position_embeddings"]
_HIDDEN_SIZE = 32  # and its "hidden_size"
CONFIG_OVERRIDES = {
    "default": {},
    "small_window": {"attention_window": 4, "seq_length": 11},
    "llama": {
        "max_position_embeddings": _MAX_POSITION_EMBEDDINGS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "norm_type": "rmsnorm",
        "mlp_type": "gated",
        "hidden_act": "silu",
        "position_embedding_type": "rope",
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": _MAX_POSITION_EMBEDDINGS // 4,
        },
    },
    # What convert.hf.lex_from_hf makes of a Qwen3ForCausalLM (lex_config_from_hf with its defaults: full
    # attention, the window defaulted to the length), every field it sets that differs from the tester's default
    # LexConfig; the sizes stay the tester's. head_dim stays hidden_size // num_attention_heads (a real Qwen3's is
    # its own field, which the conversion copies); rope_theta is the checkpoints' 10^6.
    "qwen3": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "attention_mode": "full",
        "attention_sink_positions": "cache",
        "norm_type": "rmsnorm",
        "mlp_type": "gated",
        "attention_bias": False,
        "attention_output_bias": False,
        "mlp_bias": False,
        "qk_norm": True,
        "hf_model_type": "qwen3",
    },
    # What a Gemma3ForCausalLM (text) converts to: Gemma's norms (1 + w), embeddings scaled by sqrt(hidden) in the
    # lookup, post-attention and post-MLP norms, query_pre_attn_scalar (Gemma3TextConfig's 256), GeGLU with
    # gelu_pytorch_tanh, q/k norms, tied embeddings, and Gemma 3's layer pattern at two layers: a sliding_attention
    # layer (local, window 4 < seq_length, with the local rope theta 10^4), then a full_attention one (global rope
    # theta 10^6). No soft-capping: Gemma 3 has none.
    "gemma3": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "attention_mode": "full",
        "attention_sink_positions": "cache",
        "norm_type": "gemma_rmsnorm",
        "mlp_type": "gated",
        "attention_bias": False,
        "attention_output_bias": False,
        "mlp_bias": False,
        "qk_norm": True,
        "sublayer_output_norms": True,
        "embedding_scale": _HIDDEN_SIZE**0.5,
        "embedding_scale_in_lookup": True,
        "query_pre_attn_scalar": 256,
        "local_layers": [True, False],
        "local_attention_window": 4,
        "local_rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
        "hf_model_type": "gemma3_text",
    },
}
# A Qwen3 converted to read past its length: lex convert-hf --attention_mode sliding --attention_window 4
# --attention_sinks 2 (sinks at cache positions, the default); seq_length 11 > the window, the cache is bounded.
CONFIG_OVERRIDES["qwen3_sliding"] = {**CONFIG_OVERRIDES["qwen3"], "attention_mode": "sliding", "attention_window": 4,
                                     "attention_sinks": 2, "seq_length": 11}
if LEX_COMMON_CONFIG not in CONFIG_OVERRIDES:
    raise ValueError(f"LEX_COMMON_CONFIG={LEX_COMMON_CONFIG!r}: expected one of {', '.join(CONFIG_OVERRIDES)}")


class LexModelTester(CausalLMModelTester):
    config_class = LexConfig
    if is_torch_available():
        base_model_class = LexModel
        causal_lm_class = LexForCausalLM

    def __init__(self, parent, **kwargs):
        # copies, so that no test can change the table (rope_parameters is a dict)
        overrides = {k: (dict(v) if isinstance(v, dict) else v) for k, v in CONFIG_OVERRIDES[LEX_COMMON_CONFIG].items()}
        overrides.update(kwargs)
        super().__init__(parent, **overrides)


@require_torch
class LexModelTest(CausalLMModelTest, unittest.TestCase):
    model_tester_class = LexModelTester

    def test_model_rope_scaling_from_config_1_dynamic(self):  # the "dynamic" case of the base's parameterized test
        self.skipTest("LEX refuses length-dependent rope types by name: a windowed model re-encodes positions in "
                      "every window (LexConfig.validate_rope_type; positions.Rotary checks again)")
