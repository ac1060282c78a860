"""Routed experts in place of a layer's feed-forward (qwen3moe, glm4moe), on the plain-torch
path.

A row's routing depends on that row alone: qwen3moe's top-k of a softmax over its own router
logits; glm4moe's top-k of sigmoid scores plus a correction bias, within the expert groups
whose best two scores sum highest, weighted by the scores; the k weights renormalised to sum to
1 (llama.cpp's qwen3moe and glm4moe; transformers' norm_topk_prob) and scaled.
Each expert is a SwiGLU of its own; the rows an expert takes are computed in blocks of
ROW_BLOCK rows, padded (fused.by_row_blocks: on a CPU a matmul's bits for a row depend on its
row count, never on the other rows' values), and a row's k outputs are summed in the order of
its ranking. So a row's result does not depend on which rows share its window or chunk, nor on
which experts they chose.

`moe_window` is the dispatch a layer calls: with the Triton kernels on (CUDA, or the
interpreter) the routing of kernels/moe_route.py and the routed experts of kernels/moe_triton.py
(fixed shapes, no host sync: inside a decode window's CUDA graph), else `moe_rows`, the
reference.
May import: kernels.moe_triton, kernels.fused, kernels.quant, kernels
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.fused import by_row_blocks, silu_mul_torch
from strata.kernels.policy import KernelPolicy
from strata.kernels.quant.weight import QuantWeight


def route(h: torch.Tensor, router: torch.Tensor, k: int, bias: torch.Tensor | None = None,
          scale: float = 1.0, groups: tuple[int, int] = (1, 1)
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [R, D], router [E, D] -> (weights [R, k] in h's dtype, experts [R, k] int64), best
    first. bias [E] (glm4moe): sigmoid scores, chosen by score + bias in the best groups."""
    logits = by_row_blocks(lambda b: F.linear(b.float(), router.float()), h)
    if bias is None:
        scores = choice = torch.softmax(logits, dim=-1)
    else:
        scores = logits.sigmoid()
        choice = scores + bias.float()
        n_groups, chosen = groups
        if n_groups > 1:   # the groups whose best two sum highest; the others out
            grouped = choice.view(choice.shape[0], n_groups, -1)
            best = grouped.topk(2, dim=-1)[0].sum(-1).topk(chosen, dim=-1)[1]
            keep = torch.zeros_like(grouped[..., 0]).scatter_(1, best, 1.0).bool()
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
    experts = torch.topk(choice, k, dim=-1)[1]
    weights = scores.gather(1, experts)
    weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if bias is not None else 0.0))
    return (weights * scale).to(h.dtype), experts


def moe_rows(h: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, k: int, bias: torch.Tensor | None = None, scale: float = 1.0,
             groups: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """h [R, D] (the normed rows), router [E, D], gate_up [E, 2F, D] ([gate; up] of each
    expert), down [E, D, F] -> [R, D]: each row's experts' outputs, weighted and summed
    (routing: `route`)."""
    weights, experts = route(h, router, k, bias, scale, groups)
    outs = torch.zeros(h.shape[0], k, h.shape[1], dtype=h.dtype, device=h.device)
    for e in experts.unique().tolist():
        rows, ranks = (experts == e).nonzero(as_tuple=True)

        def expert(b: torch.Tensor) -> torch.Tensor:
            return F.linear(silu_mul_torch(F.linear(b, gate_up[e])), down[e])
        outs[rows, ranks] = by_row_blocks(expert, h[rows])
    out = outs[:, 0] * weights[:, :1]
    for rank in range(1, k):      # in each row's ranking order, the same for every row
        out = out + outs[:, rank] * weights[:, rank:rank + 1]
    return out


def router_logits(h: torch.Tensor, router: torch.Tensor, policy: KernelPolicy,
                  decode: bool) -> torch.Tensor:
    """fp32 [R, E] = h @ router^T, a row's bits the same whatever R is: a decode window by the
    skinny kernel (fp32 out; its blocks from the router's shape) where they divide it, else in
    blocks of 8 rows; a prompt chunk (a fixed shape) in one matmul."""
    blocks = policy.skinny(h, router, "plain", decode)
    if blocks is not None:
        from strata.kernels.skinny_triton import skinny_mm
        return skinny_mm(h, router, out_dtype=torch.float32, **blocks)
    if decode:
        return by_row_blocks(lambda b: F.linear(b.float(), router.float()), h)
    if h.dtype != torch.float32 and policy.mm_fp32_out:
        return torch.mm(h, router.t(), out_dtype=torch.float32)
    return F.linear(h.float(), router.float())


def moe_window(x: torch.Tensor, h: torch.Tensor, router: torch.Tensor,
               gate_up: torch.Tensor | QuantWeight, down: torch.Tensor | QuantWeight, k: int,
               *, bias: torch.Tensor | None = None, scale: float = 1.0,
               groups: tuple[int, int] = (1, 1), policy: KernelPolicy, decode: bool,
               act: str = "silu") -> torch.Tensor:
    """x [R, D] + the routed experts' weighted sum of h [R, D] (x's rows normed). gate_up:
    [E, 2F, D] or packed (every expert's gate rows, then their up rows); down: [E, D, F] or
    packed [E * D, F]. The Triton kernels where the policy runs them, else moe_rows."""
    if not policy.triton:
        assert not isinstance(gate_up, QuantWeight) and not isinstance(down, QuantWeight), \
            "packed experts need the Triton kernels (a CUDA device or the interpreter)"
        assert act == "silu", "moe_rows computes SwiGLU experts"
        return x + moe_rows(h, router, gate_up, down, k, bias, scale, groups)
    from strata.kernels import moe_route, moe_triton
    pairs = (decode and policy.int8_activations and isinstance(gate_up, QuantWeight)
             and isinstance(down, QuantWeight))   # a pair's GEMVs with int8 activations
    experts, weights, counts = moe_route.route(router_logits(h, router, policy, decode), k,
                                               bias, scale, groups, count=not pairs)
    if pairs:
        outs = moe_triton.experts_a8(h, experts, gate_up, down, router.shape[0], act)
        return moe_triton.weighted_sum(outs, weights, res=x)
    blocks = policy.moe_blocks()
    slots, block_expert, n_blocks = moe_route.align(experts, counts, blocks["block_m"])
    outs = moe_triton.experts(h, slots, block_expert, n_blocks, k, gate_up, down,
                              router.shape[0], blocks, act)
    return moe_triton.weighted_sum(outs, weights, res=x)
