"""LexConfig: the LEX Transformer (xPos + blockwise causal attention) as a transformers v5 config.

The architecture switches (pre/post norm, subln, deepnorm, embedding layer norm and scale, activation,
biases, an optional fairseq sinusoidal absolute embedding) are here so that every dense TorchScale
`Decoder` language model maps onto a LexConfig without loss.
"""

from transformers import PreTrainedConfig

POSITION_EMBEDDING_TYPES = ("xpos", "rope", "decay", "alibi", "kerple", "sandwich", "sinusoidal", "none")
ATTENTION_MODES = ("blockwise", "sliding", "full")
HIDDEN_ACTS = ("gelu", "relu", "swish")
ABSOLUTE_POSITION_EMBEDDINGS = (None, "sinusoidal")


class LexConfig(PreTrainedConfig):
    r"""
    Configuration of a LEX Transformer decoder.

    Args:
        max_position_embeddings: the training length l. Inputs may be far longer: blockwise and sliding
            attention only ever look at `attention_window` keys.
        position_embedding_type: "xpos" (default, the paper's), "rope", "decay" (xPos without rotation),
            "alibi", "kerple" (log variant, learned per head), "sandwich" (sinusoidal inner-product bias),
            "sinusoidal" (absolute, fairseq's table added to the embeddings: the paper's "Transformer" row) or
            "none" (no position information; TorchScale decoders without xpos).
        attention_mode: "blockwise" (BCA: blocks of `attention_window // 2`, a query sees its block and
            the previous one), "sliding" (the last `attention_window` keys) or "full".
        attention_window: w; defaults to `max_position_embeddings`. Must be even and at least 4.
        xpos_scale_base: B in zeta^(n/B). xpos_gamma: gamma in zeta_i = (2i + gamma d) / ((1 + gamma) d).
        normalize_before: pre-norm layers with a final layer norm (True) or post-norm (False).
        subln: TorchScale's sub-LayerNorms (on the attention output before out_proj and on the FFN
            activation before fc2).
        deepnorm: DeepNet residual scaling alpha = (2N)^(1/4) (post-norm in TorchScale's Decoder; fairseq's
            `lm_base --deepnorm` keeps pre-norm, so both combinations are allowed).
        layernorm_embedding: a LayerNorm on the scaled embeddings.
        embedding_scale: multiplier of the token embeddings (TorchScale: 1 or sqrt(hidden_size)).
        sandwich_dim: d' of the sinusoidal vectors whose inner products make the Sandwich bias.
        absolute_position_embedding: None, or "sinusoidal" for fairseq's sinusoidal table added to the
            token embeddings (fairseq-trained TorchScale LMs); positions start at
            `absolute_position_offset` (fairseq: padding_idx + 1).
    """

    model_type = "lex"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    hidden_act: str = "gelu"
    max_position_embeddings: int = 1024
    position_embedding_type: str = "xpos"
    attention_mode: str = "blockwise"
    attention_window: int | None = None
    xpos_scale_base: float = 512.0
    xpos_gamma: float = 0.4
    rope_theta: float = 10000.0
    sandwich_dim: int = 128
    layer_norm_eps: float = 1e-5
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    initializer_range: float = 0.02
    normalize_before: bool = True
    subln: bool = False
    deepnorm: bool = False
    layernorm_embedding: bool = False
    embedding_scale: float = 1.0
    attention_bias: bool = True
    mlp_bias: bool = True
    absolute_position_embedding: str | None = None
    absolute_position_offset: int = 2
    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.attention_window is None:
            self.attention_window = self.max_position_embeddings
        self._validate()
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def block_size(self) -> int:
        """BCA block length b = w / 2."""
        return self.attention_window // 2

    def _validate(self) -> None:
        def allowed(field: str, value, choices) -> None:
            if value not in choices:
                raise ValueError(f"LexConfig.{field}={value!r} is not one of {list(choices)}")

        def positive(field: str, value) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LexConfig.{field}={value!r} must be a positive number")

        allowed("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDING_TYPES)
        allowed("attention_mode", self.attention_mode, ATTENTION_MODES)
        allowed("hidden_act", self.hidden_act, HIDDEN_ACTS)
        allowed("absolute_position_embedding", self.absolute_position_embedding, ABSOLUTE_POSITION_EMBEDDINGS)
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "max_position_embeddings", "xpos_scale_base", "rope_theta", "sandwich_dim",
                      "layer_norm_eps", "embedding_scale"):
            positive(field, getattr(self, field))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"LexConfig.hidden_size={self.hidden_size} must be divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LexConfig.hidden_size / num_attention_heads = {self.head_dim} (the head dim) must be even: "
                "rotary encodings rotate pairs of dimensions"
            )
        window = self.attention_window
        if not isinstance(window, int) or isinstance(window, bool) or window < 4 or window % 2:
            raise ValueError(f"LexConfig.attention_window={window!r} must be an even integer >= 4")
        if not 0.0 <= self.xpos_gamma:
            raise ValueError(f"LexConfig.xpos_gamma={self.xpos_gamma!r} must be >= 0")
        for field in ("hidden_dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, field)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"LexConfig.{field}={value!r} must lie in [0, 1)")
        if self.absolute_position_offset < 0:
            raise ValueError(
                f"LexConfig.absolute_position_offset={self.absolute_position_offset!r} must be >= 0"
            )


__all__ = ["LexConfig"]
