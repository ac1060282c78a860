"""llama.cpp's `llama-batched-bench` as the arm strata is compared with: the command line for a
GGUF, prompt and generated lengths and client counts, and its table read back as rows.

llama-batched-bench reads B prompts of PP tokens in one batch (T_PP s), then decodes TG steps
of B tokens (T_TG s). Its rates: S_PP = B*PP / T_PP, S_TG = B*TG / T_TG (the decode rate) and
S = B*(PP + TG) / (T_PP + T_TG) (the rate of prompt and generated tokens together). `strata-bench
sweep --prompt-tokens PP --tokens TG` reports the same two rates under the same keys."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

BINARY = "llama-batched-bench"
BUILD = ("build it from the llama.cpp source (https://github.com/ggml-org/llama.cpp) with CUDA: "
         "cmake -B build -DGGML_CUDA=ON -DCMAKE_BUILD_TYPE=Release && cmake --build build "
         f"--target {BINARY}, then pass --bin build/bin")

# llama-batched-bench's column -> the key strata's benches use for the same figure
COLUMNS = {"PP": "prompt_tokens", "TG": "tokens", "B": "clients", "N_KV": "positions",
           "T_PP s": "prompt_seconds", "S_PP t/s": "prompt_tok_s", "T_TG s": "decode_seconds",
           "S_TG t/s": "decode_tok_s", "T s": "seconds", "S t/s": "prompt_and_generated_tok_s"}
INT_COLUMNS = ("PP", "TG", "B", "N_KV")


def binary(bin_dir: str | os.PathLike) -> Path:
    """DIR/llama-batched-bench, checked; a sentence saying how to get it otherwise."""
    path = Path(bin_dir) / BINARY
    if not path.is_file():
        raise ValueError(f"--bin {bin_dir}: there is no {BINARY} in it; {BUILD}")
    if not os.access(path, os.X_OK):
        raise ValueError(f"--bin {bin_dir}: {path} is not executable; chmod +x it or {BUILD}")
    return path


def llama_devices(devices: str) -> list[str]:
    """'cuda:0,cuda:1' -> llama.cpp's device names ['CUDA0', 'CUDA1']; 'cpu' -> []."""
    names = [d.strip() for d in devices.split(",") if d.strip()]
    if names == ["cpu"]:
        return []
    if not names or not all(d.startswith("cuda:") and d[5:].isdigit() for d in names):
        raise ValueError(f"--devices {devices!r}: give cpu or CUDA devices, e.g. cuda:0 or "
                         f"cuda:0,cuda:1")
    return [f"CUDA{d[5:]}" for d in names]


def context_size(prompt_tokens: int, tokens: int, clients: list[int]) -> int:
    """Positions the KV cache needs: every client's prompt and tokens at the largest count
    (llama-batched-bench skips, silently, a count whose positions do not fit), rounded up to
    llama.cpp's 256."""
    need = max(clients) * (prompt_tokens + tokens)
    return -(-need // 256) * 256


def command(bin_dir: str | os.PathLike, model: str | os.PathLike, prompt_tokens: int,
            tokens: int, clients: list[int], devices: str) -> list[str]:
    """The llama-batched-bench command line: every layer on the devices (-ngl 99), split by
    layer over several (-sm layer), prompts not shared between clients."""
    gpus = llama_devices(devices)
    cmd = [str(binary(bin_dir)), "-m", str(model), "-ngl", "99" if gpus else "0",
           "-c", str(context_size(prompt_tokens, tokens, clients)),
           "-npp", str(prompt_tokens), "-ntg", str(tokens),
           "-npl", ",".join(str(c) for c in clients)]
    cmd += ["-dev", ",".join(gpus)] if gpus else ["-dev", "none"]
    if len(gpus) > 1:
        cmd += ["-sm", "layer"]
    return cmd


def parse_table(text: str) -> list[dict]:
    """The rows of llama-batched-bench's markdown table (its header names the columns), each
    as {key of COLUMNS: value}, in the order printed."""
    header: list[str] | None = None
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
            continue
        if header is None or len(cells) != len(header) or set(line.strip()) <= set("|- "):
            continue
        try:
            values = {name: int(cell) if name in INT_COLUMNS else float(cell)
                      for name, cell in zip(header, cells)}
        except ValueError:
            continue
        rows.append({COLUMNS[name]: v for name, v in values.items() if name in COLUMNS})
    return rows


def last_errors(text: str, n: int = 6) -> str:
    """The last lines that say what went wrong (those naming an error, else the last lines)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "failed" in line.lower()]
    return "\n".join("  " + line for line in (errors or lines)[-n:])


def run(cmd: list[str], clients: list[int]) -> tuple[list[dict], str]:
    """Run the command; (its rows, one per client count, in the order asked; its output).
    A failure or a missing count raises a ValueError with llama.cpp's last error lines."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise ValueError(f"llama.cpp's {BINARY} failed (exit {done.returncode}) on "
                         f"{cmd[cmd.index('-m') + 1]}; its last lines:\n{last_errors(output)}")
    by_clients = {r["clients"]: r for r in parse_table(done.stdout)}
    missing = [c for c in clients if c not in by_clients]
    if missing:
        raise ValueError(f"llama.cpp's {BINARY} printed no row for {missing} client(s); its "
                         f"last lines:\n{last_errors(output)}")
    return [by_clients[c] for c in clients], output
