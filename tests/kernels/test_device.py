"""kernels/device.py: host values onto the device in one copy, each back in its dtype."""
from __future__ import annotations

import numpy as np
import torch

from strata.kernels.device import to_device_many


def test_many_arrays_come_back_whole_in_their_dtypes():
    arrays = {"rows": np.array([3, 0, 2**40], dtype=np.int64),
              "words": np.array([[-1, 2**31 - 1, -2**31]], dtype=np.int32),
              "bias": np.array([[1.5, -np.inf], [np.float32(0.1), -0.0]], dtype=np.float32),
              "none": np.zeros((2, 0), dtype=np.int64),
              "u": np.array([[0.1], [1 - 2**-53]]),
              "more": np.array([7], dtype=np.int64)}
    out = to_device_many(arrays, torch.device("cpu"))
    assert list(out) == ["rows", "none", "more", "words", "bias", "u"]   # by dtype
    for name, a in arrays.items():
        back = out[name].numpy()
        assert back.dtype == a.dtype and back.shape == a.shape and back.tobytes() == a.tobytes()
    assert to_device_many({}, torch.device("cpu")) == {}
