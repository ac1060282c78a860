"""Model shapes (the sizes of a real model or a test's, of any family) and the metadata keys
that state one in a GGUF file: what strata-mkmodel writes random weights of, and what tests
write transformers' weights under."""
from __future__ import annotations

from dataclasses import dataclass

from gguf import ExpertGatingFuncType, GGUFWriter

from strata.model.families import FAMILIES
from strata.model.synthetic_vocab import N_BASE_TOKENS


@dataclass(frozen=True)
class ModelShape:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ffn: int
    vocab: int
    ctx_len: int = 2048
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    arch: str = "llama"        # the family (model/families.py): its tensors and keys
    key_length: int = 0        # a head size other than d_model / n_heads (qwen3, gemma3)
    sliding_window: int = 0    # gemma3: the sliding layers' window
    rope_dim: int = 0          # partial rotary (glm4moe): the rotated dims of a head
    experts: tuple[int, int, int] = (0, 0, 0)   # MoE: experts, used a row, an expert's width
    dense_first: int = 0       # glm4moe: leading dense layers
    expert_scale: float = 1.0  # glm4moe: the routed weights' scale
    expert_groups: tuple[int, int] = (1, 1)     # glm4moe: groups of experts, groups chosen

    def __post_init__(self):
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ffn", "vocab", "ctx_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads and not self.key_length:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.arch not in FAMILIES:
            raise ValueError(f"unknown architecture {self.arch!r}; known: {', '.join(FAMILIES)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads "
                             f"{self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.vocab < N_BASE_TOKENS:
            raise ValueError(f"vocab {self.vocab} is below the {N_BASE_TOKENS} byte-level and "
                             f"special tokens every generated tokenizer has")

    @property
    def head_dim(self) -> int:
        return self.key_length or self.d_model // self.n_heads

    def routed(self, layer: int) -> bool:
        """Whether a layer's feed-forward is routed experts (past the leading dense ones)."""
        return FAMILIES[self.arch].moe and layer >= self.dense_first

    def layer_params(self, layer: int, active: bool = False) -> int:
        """A block's parameters (norms and biases not counted); active: those one row reads
        (its k experts of a routed block, beside the router and the shared expert)."""
        d, hd = self.d_model, self.head_dim
        attention = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2
        if not self.routed(layer):
            return attention + 3 * d * self.d_ffn
        count, used, width = self.experts
        shared = 3 * d * width if FAMILIES[self.arch].shared_expert else 0
        return attention + count * d + 3 * d * width * (used if active else count) + shared

    @property
    def n_params(self) -> int:
        """Parameter count with tied embeddings (add vocab*d_model for an untied head)."""
        return (self.vocab * self.d_model + self.d_model
                + sum(self.layer_params(i) + 2 * self.d_model for i in range(self.n_layers)))

    @property
    def active_params(self) -> int:
        """The parameters one token reads: its experts of each routed block, the head (the
        embedding is a gather)."""
        return (self.vocab * self.d_model
                + sum(self.layer_params(i, active=True) for i in range(self.n_layers)))


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ffn=128, vocab=320),
    "smollm2-135m": ModelShape(n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, d_ffn=1536,
                               vocab=49152, ctx_len=8192, rope_base=100000.0),
    "smollm2-360m": ModelShape(n_layers=32, d_model=960, n_heads=15, n_kv_heads=5, d_ffn=2560,
                               vocab=49152, ctx_len=8192, rope_base=100000.0),
    "llama3-1b": ModelShape(n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, d_ffn=8192,
                            vocab=128256, ctx_len=8192, rope_base=500000.0),
    "llama3-8b": ModelShape(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ffn=14336,
                            vocab=128256, ctx_len=8192, rope_base=500000.0),
    "qwen2-tiny": ModelShape(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ffn=128,
                             vocab=320, arch="qwen2"),
    "qwen3-tiny": ModelShape(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ffn=128,
                             vocab=320, arch="qwen3", key_length=32),
    "gemma3-tiny": ModelShape(n_layers=7, d_model=64, n_heads=4, n_kv_heads=2, d_ffn=128,
                              vocab=320, arch="gemma3", key_length=32, sliding_window=12,
                              rms_eps=1e-6, rope_base=1000000.0),
    "qwen2.5-7b": ModelShape(n_layers=28, d_model=3584, n_heads=28, n_kv_heads=4, d_ffn=18944,
                             vocab=152064, ctx_len=32768, rope_base=1000000.0, rms_eps=1e-6,
                             arch="qwen2"),
    "qwen3-8b": ModelShape(n_layers=36, d_model=4096, n_heads=32, n_kv_heads=8, d_ffn=12288,
                           vocab=151936, ctx_len=40960, rope_base=1000000.0, rms_eps=1e-6,
                           arch="qwen3", key_length=128),
    "qwen3moe-tiny": ModelShape(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ffn=128,
                                vocab=320, arch="qwen3moe", key_length=32,
                                experts=(8, 2, 32)),
    "glm4moe-tiny": ModelShape(n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, d_ffn=128,
                               vocab=320, arch="glm4moe", key_length=32, rope_dim=16,
                               experts=(8, 2, 32), dense_first=1, expert_scale=2.5,
                               expert_groups=(2, 1)),
    # Qwen3-30B-A3B: 48 routed layers of 128 experts, 8 a token, each 768 wide
    "qwen3-30b-a3b": ModelShape(n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4,
                                d_ffn=6144, vocab=151936, ctx_len=40960, rope_base=1000000.0,
                                rms_eps=1e-6, arch="qwen3moe", key_length=128,
                                experts=(128, 8, 768)),
    # GLM-4.5-Air's layers (a dense first layer, then 128 experts, 8 a token, 1408 wide,
    # beside a shared expert; partial RoPE; q, k, v biases), 12 of its 46 layers: with its
    # NextN layer (--nextn) 19.0 GB in Q4_K_M, 58 GB in BF16, on one GPU
    "glm4.5-air-12l": ModelShape(n_layers=12, d_model=4096, n_heads=96, n_kv_heads=8,
                                 d_ffn=10944, vocab=151552, ctx_len=131072,
                                 rope_base=1000000.0, arch="glm4moe", key_length=128,
                                 rope_dim=64, experts=(128, 8, 1408), dense_first=1),
    "gemma3-270m": ModelShape(n_layers=18, d_model=640, n_heads=4, n_kv_heads=1, d_ffn=2048,
                              vocab=262144, ctx_len=32768, rope_base=1000000.0, rms_eps=1e-6,
                              arch="gemma3", key_length=256, sliding_window=512),
}


def get_shape(name: str) -> ModelShape:
    """The named shape; a KeyError listing the known names otherwise."""
    try:
        return SHAPES[name]
    except KeyError:
        raise KeyError(f"unknown model shape {name!r}; known shapes: "
                       f"{', '.join(SHAPES)}") from None


def add_llama_config(writer: GGUFWriter, shape: ModelShape, vocab_size: bool = True,
                     nextn: bool = False) -> None:
    """The {arch}.* keys llama.cpp (and strata's ModelFile) read for a model of this shape,
    of any family; with nextn, a NextN layer after the blocks (block_count + 1,
    nextn_predict_layers 1, as llama.cpp's files count it)."""
    writer.add_block_count(shape.n_layers + int(nextn))
    if nextn:
        writer.add_nextn_predict_layers(1)
    writer.add_context_length(shape.ctx_len)
    writer.add_embedding_length(shape.d_model)
    writer.add_feed_forward_length(shape.d_ffn)
    writer.add_head_count(shape.n_heads)
    writer.add_head_count_kv(shape.n_kv_heads)
    writer.add_rope_freq_base(float(shape.rope_base))
    writer.add_rope_dimension_count(shape.rope_dim or shape.head_dim)
    writer.add_layer_norm_rms_eps(float(shape.rms_eps))
    if shape.key_length:
        writer.add_key_length(shape.key_length)
        writer.add_value_length(shape.key_length)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    count, used, width = shape.experts
    if count:
        writer.add_expert_count(count)
        writer.add_expert_used_count(used)
        writer.add_expert_feed_forward_length(width)
        if shape.dense_first:
            writer.add_leading_dense_block_count(shape.dense_first)
        if FAMILIES[shape.arch].shared_expert:   # the keys llama.cpp's glm4moe needs too
            writer.add_expert_shared_count(1)
            writer.add_expert_weights_norm(True)
            writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        if shape.expert_scale != 1.0 or FAMILIES[shape.arch].shared_expert:
            writer.add_expert_weights_scale(shape.expert_scale)
        if shape.expert_groups != (1, 1):
            writer.add_expert_group_count(shape.expert_groups[0])
            writer.add_expert_group_used_count(shape.expert_groups[1])
    if vocab_size:
        writer.add_vocab_size(shape.vocab)
