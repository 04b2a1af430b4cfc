"""The shape of a Llama-family decoder: every number the model code needs, in one place."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, SmolLM, Qwen2 with ``attention_bias``).

    Attributes:
        vocab_size: rows of the embedding table.
        hidden_size: width of the residual stream (d_model).
        n_layers: decoder blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads; ``n_heads // n_kv_heads`` query heads share each one (GQA).
        head_dim: width of one head.
        intermediate_size: width of the SwiGLU feed-forward layer.
        rope_theta: base of the rotary position frequencies.
        rms_norm_eps: epsilon inside RMSNorm.
        max_position: longest sequence the position tables cover.
        tie_embeddings: the output projection reuses the embedding table.
        attention_bias: the q/k/v projections carry a bias (Qwen2; Llama's ``attention_bias``).
        output_bias: the attention output projection carries a bias (Llama's ``attention_bias``
            sets both; Qwen2 has none here).
        bos_token_id / eos_token_id: the special tokens that start and end a turn.
    """

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = True
    attention_bias: bool = False
    output_bias: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.output_bias and not self.attention_bias:
            raise ValueError("output_bias without attention_bias matches no known model")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads that share one key/value head."""
        return self.n_heads // self.n_kv_heads

    def parameter_count(self) -> int:
        """Weights in the model, counting a tied embedding once."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attention = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.attention_bias else 0)
        attention += d if self.output_bias else 0
        block = attention + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.n_layers * block + d + head

    def kv_bytes_per_token(self, bytes_per_element: float = 4) -> float:
        """Cache bytes one token costs: K and V, every layer, every KV head."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_element

    # --- Hugging Face config.json --------------------------------------------------------------

    def to_hf_dict(self) -> dict:
        """The ``config.json`` a ``transformers`` LlamaForCausalLM would read."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.attention_bias,  # a Llama config puts it on o_proj as well
            "mlp_bias": False,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "LlamaConfig":
        """Read a Hugging Face ``config.json`` of a Llama, Mistral-style or Qwen2 model."""
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2", "smollm"):
            raise ValueError(
                f"config.json describes a {model_type!r} model; this loader reads llama, mistral and qwen2 decoders"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
        scaling = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
            raise ValueError(f"rope scaling {scaling!r} is not supported by this readable model")
        try:
            n_heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
            eos = hf.get("eos_token_id", 2)
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                n_layers=hf["num_hidden_layers"],
                n_heads=n_heads,
                n_kv_heads=hf.get("num_key_value_heads") or n_heads,
                head_dim=hf.get("head_dim") or hidden // n_heads,
                intermediate_size=hf["intermediate_size"],
                rope_theta=float(theta),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position=hf.get("max_position_embeddings", 2048),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
                output_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
                bos_token_id=hf.get("bos_token_id") if hf.get("bos_token_id") is not None else 1,
                eos_token_id=eos[0] if isinstance(eos, list) else (eos if eos is not None else 2),
            )
        except KeyError as missing:
            raise ValueError(f"config.json lacks the field {missing}") from None

    def replace(self, **changes) -> "LlamaConfig":
        values = asdict(self)
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"LlamaConfig has no field(s) {sorted(unknown)}")
        values.update(changes)
        return LlamaConfig(**values)
