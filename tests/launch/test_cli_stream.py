"""strata-launch --prompt as a user sees it: the text streams on stdout as its tokens come (read
here as the process writes it), then a line of rates on stderr, as llama-cli prints them."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from strata.launch.cli import rates

LAUNCH = (shutil.which("strata-launch", path=os.path.dirname(sys.executable))
          or shutil.which("strata-launch"))


def test_the_text_streams_before_the_last_token(tiny_model, no_stage_left):
    """The tiny model repeats the prompt's last character: 200 of them take the two CPU stages
    a second or more, and the first is read while the process is still decoding."""
    proc = subprocess.Popen([LAUNCH, "--model", str(tiny_model), "--layer-split", "2",
                             "--ctx-size", "256", "--prompt", "say a", "--max-tokens", "200",
                             "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    try:
        first = proc.stdout.read(1)
        running = proc.poll() is None
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert first and running, "the first text came only when the process had ended"
    text = (first + rest).decode()
    assert text.endswith("\n") and len(text) > 100
    found = re.search(r"\[prompt: (\d+) tokens in [\d.]+ s, [\d.]+ tok/s; decode: (\d+) tokens "
                      r"in [\d.]+ s, [\d.]+ tok/s\]", err.decode())
    assert found, err.decode()
    assert int(found.group(2)) == 199            # the tokens after the first


def test_rates_count_as_llama_cli_does():
    # submitted at 0, the first token at 0.5 (the prompt read), then 4 tokens in 2 s
    assert rates(100, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]) == (
        "[prompt: 100 tokens in 0.500 s, 200.00 tok/s; decode: 4 tokens in 2.000 s, "
        "2.00 tok/s]")
    assert rates(3, [0.0]) == ("[prompt: 3 tokens in 0.000 s, - tok/s; decode: 0 tokens in "
                               "0.000 s, - tok/s]")
