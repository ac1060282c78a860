"""Host values onto the device, and results back, without stalling the queue: the index and
parameter tensors a window's kernels read (sampling, the head, the drafter), the tokens and
log-probabilities the head gives."""
import numpy as np
import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host tensor (or a list for one) on `device`; on CUDA through pinned memory without
    waiting (a pageable copy would wait for every kernel queued before it)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of t on the host, made without waiting (into pinned memory) when t is on CUDA:
    read it once the device is past this point."""
    pinned = t.is_cuda
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
    host.copy_(t, non_blocking=pinned)
    return host


def to_device_many(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Host arrays on `device` in one copy (to_device of their values as float64, in which
    every integer below 2^53 and every fp32 value is exact), each back in its shape and dtype
    there: the arrays of one dtype lie together and are cast in one kernel."""
    arrays = {name: np.asarray(a) for name, a in arrays.items()}
    kinds: dict[torch.dtype, list[str]] = {}
    for name, a in arrays.items():
        kinds.setdefault(_DTYPES[a.dtype.kind, a.dtype.itemsize], []).append(name)
    order = [name for names in kinds.values() for name in names]
    flat = np.concatenate([arrays[n].astype(np.float64).ravel() for n in order] or [np.zeros(0)])
    on, out, at = to_device(torch.from_numpy(flat), device, torch.float64), {}, 0
    for dtype, names in kinds.items():
        size = sum(arrays[n].size for n in names)
        part, start = on[at:at + size].to(dtype), 0
        for n in names:
            out[n] = part[start:start + arrays[n].size].view(arrays[n].shape)
            start += arrays[n].size
        at += size
    return out


_DTYPES = {("i", 8): torch.long, ("i", 4): torch.int32, ("f", 4): torch.float32,
           ("f", 8): torch.float64, ("b", 1): torch.bool}
