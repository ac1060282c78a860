"""Rotary position embedding: on adjacent pairs (2i, 2i + 1), llama.cpp's layout of GGUF
llama Q/K weights, or on halves (i, i + rope_dim / 2), NEOX's (qwen2, qwen3, gemma3).

GGUF llama files store the Q and K rows permuted so that RoPE rotates pairs (2i, 2i+1);
transformers undoes the permutation and rotates halves. Both give the same attention scores.
The other families' files are not permuted: they rotate halves, as transformers does.
"""
import torch


def rope_table(rope_dim: int, base: float, max_pos: int, scale: float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_pos, rope_dim // 2], fp32, computed the way transformers computes them
    (scale: linear RoPE scaling, the positions divided by it)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim))
    inv_freq = inv_freq / scale
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               halves: bool = False) -> torch.Tensor:
    """x: [R, H, hd]; cos, sin: [R, rope_dim // 2] (already indexed by each row's position);
    halves: rotate (i, i + rope_dim / 2) rather than (2i, 2i + 1)."""
    rope_dim = cos.shape[-1] * 2
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if halves:
        x0, x1 = x[..., :rope_dim // 2], x[..., rope_dim // 2:rope_dim]
        rotated = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    else:
        pairs = x[..., :rope_dim].unflatten(-1, (-1, 2))  # [R, H, rope_dim/2, 2]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    if rope_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rope_dim:]), dim=-1)
