"""RMSNorm and the SwiGLU feed-forward: row-wise, so a row never sees its neighbours."""
import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [R, D]; computed in fp32 whatever the activation dtype (as transformers does)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
           w_down: torch.Tensor) -> torch.Tensor:
    # x: [R, D]; w_gate, w_up: [F, D]; w_down: [D, F]
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
