"""Every console script answers -h and --version; strata-bench's subcommands answer -h; the
runtime's command line does not load the benchmarks; and strata-bench peer, which needs HF
transformers, says how to install it where it is missing."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points, version

import pytest
from click.testing import CliRunner

from strata.bench.cli import main as bench

COMMANDS = ("strata-launch", "strata-worker", "strata-bench", "strata-mkmodel", "strata-keys")


def command(name: str):
    (entry,) = [e for e in entry_points(group="console_scripts") if e.name == name]
    return entry.load()


@pytest.mark.parametrize("name", COMMANDS)
def test_help_and_version(name):
    main = command(name)
    for flag in ("-h", "--help"):
        r = CliRunner().invoke(main, [flag], prog_name=name)
        assert r.exit_code == 0, r.output
        assert r.output.startswith(f"Usage: {name} "), r.output
    r = CliRunner().invoke(main, ["--version"], prog_name=name)
    assert r.exit_code == 0, r.output
    assert r.output == f"{name}, version {version('strata')}\n"


@pytest.mark.parametrize("sub", sorted(bench.commands))
def test_bench_subcommand_help(sub):
    r = CliRunner().invoke(bench, [sub, "-h"], prog_name="strata-bench")
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"Usage: strata-bench {sub} [OPTIONS]"), r.output


def test_every_bench_subcommand_is_there():
    assert set(bench.commands) == {"exact", "throughput", "decode", "sweep", "prompt", "drafts",
                                   "peer", "loadtest", "soak", "grammar"}


def test_the_runtime_does_not_import_the_benchmarks():
    modules = ["strata.launch.cli", "strata.launch.session", "strata.stage_worker.main",
               "strata.coordinator.api.server"]
    code = (f"import sys; import {', '.join(modules)}; "
            f"print(sorted(m for m in sys.modules if m.startswith('strata.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[]\n"


def test_python_m_strata_bench_runs_strata_bench():
    out = subprocess.run([sys.executable, "-m", "strata.bench", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"strata-bench, version {version('strata')}\n"


def test_peer_without_transformers_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    r = CliRunner().invoke(bench, ["peer", "--device", "cpu"], prog_name="strata-bench")
    assert r.exit_code == 2, (r.output, r.exception)
    assert r.stderr.startswith("strata-bench peer: the peer arm runs HF transformers, which is "
                               "not installed here; install it with pip install"), r.stderr


def test_drafts_help_says_what_draft_tokens_means_there():
    """In the drafts bench --draft-tokens is the drafts arm's count: its help gives the default
    and none of the runtime's '0 = off'; 0 gets a sentence instead of a run without drafts."""
    r = CliRunner().invoke(bench, ["drafts", "-h"], prog_name="strata-bench")
    assert r.exit_code == 0, r.output
    option = r.output[r.output.index("--draft-tokens"):r.output.index("--clients")]
    assert "0 = off" not in option and "[default: 7]" in " ".join(option.split())
    assert r.output.count("--draft-tokens") == 1
    r = CliRunner().invoke(bench, ["drafts", "--draft-tokens", "0"], prog_name="strata-bench")
    assert r.exit_code == 2, (r.output, r.exception)
    assert r.stderr == ("strata-bench drafts: --draft-tokens 0 leaves the drafts arm without "
                        "drafts; give 1 to 7\n")
