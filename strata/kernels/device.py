"""Host values onto the device without stalling the queue: the index and parameter tensors a
window's kernels read (sampling, the head, the drafter, the history)."""
import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host tensor (or a list for one) on `device`; on CUDA through pinned memory without
    waiting (a pageable copy would wait for every kernel queued before it)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.contiguous().pin_memory().to(device, non_blocking=True)
