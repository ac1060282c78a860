"""Shared fixtures: the embedded SmolLM2 file, tiny random GGUF models, process checks."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from strata.model.mkmodel import SHAPES, write_random_gguf
from strata.model.registry import resolve_model

# The stage processes the tests start (they inherit the environment) run one torch thread each:
# on a small machine, several stages and this process share the cores, and a second thread per
# stage costs a quarter more CPU for no shorter a run. Tokens do not depend on it (every test
# compares runs of one configuration, or allows transformers' tolerance). This process keeps
# the thread count torch chose for it (read before the variable is set).
torch.get_num_threads()
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Property tests draw the same examples on every run (a clean clone has no example database,
# so a random search would test other cases each time CI runs); `python -m pytest
# --hypothesis-profile explore` searches anew and keeps what fails in .hypothesis/.
settings.register_profile("strata", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, max_examples=2000)
settings.load_profile("strata")

# Under Triton's interpreter (the kernel tests' child runs, test_triton_interpreter.py), a jit
# helper's call does not patch triton.language again where the kernel's launch did
# (interpreter_calls.py says why)
if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_calls import patch_once
    patch_once()


@pytest.fixture(scope="module")
def one_torch_thread():
    """The test machine is small and shared: with 2 threads each tiny op's OpenMP barrier can
    wait for a descheduled thread (a 10x slowdown under load). Comparisons stay like for like.
    A module opts in with pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def triton_devices() -> list:
    """Where the Triton kernels can be tested: CUDA, and the CPU under TRITON_INTERPRET=1."""
    out = []
    if os.environ.get("TRITON_INTERPRET") == "1":
        out.append("cpu")
    if torch.cuda.is_available():
        out.append(pytest.param("cuda", marks=pytest.mark.gpu))
    return out or [pytest.param("cpu", marks=pytest.mark.skip(
        reason="needs CUDA, or TRITON_INTERPRET=1 for Triton's interpreter"))]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return resolve_model("smollm2-135m")


@contextmanager
def fast_transformers_gguf():
    """transformers' GGUF loading, with what it builds unchanged: the file parsed by ModelFile's
    reader (gguf-py's fields, parsed in 0.3 s instead of 3 for SmolLM2, which transformers opens
    twice), and gguf's tensor name map built once (transformers builds the same map for each of
    the model's ~400 modules)."""
    import functools

    import gguf

    from strata.model.gguf_file import Reader
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", Reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def hf_model(smollm2):
    """The embedded SmolLM2 in transformers' own modeling code (fp32, CPU): the reference that
    parity and log-probability tests compare with (loaded once: their cases share the
    session's launches, so they run in one process under xdist)."""
    transformers = pytest.importorskip("transformers")
    with fast_transformers_gguf():
        return transformers.AutoModelForCausalLM.from_pretrained(
            smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32).eval()


SMOLLM2_SPLIT = "10,20"  # 3 stages: a middle stage, as well as the first and the last
SMOLLM2_SLOTS = 4
SMOLLM2_CTX = 512


@pytest.fixture(scope="session")
def smollm2_stages(smollm2):
    """SmolLM2 served by 3 CPU stages with SMOLLM2_SLOTS slots of SMOLLM2_CTX positions, launched
    once for the session: the cases that need the real model served (batching, parity, the
    HTTP server's references) share it instead of each loading SmolLM2's stages. Tokens do not
    depend on the slot count or the context size, so each case runs its own SchedulerConfig
    within them."""
    from strata.launch.plan import plan_stages
    from strata.launch.session import launch_stages
    from strata.model.gguf_file import ModelFile

    file = ModelFile(smollm2)
    plan = plan_stages(SMOLLM2_SPLIT, ["cpu"], file.config.n_layers)
    own = tempfile.mkdtemp(prefix="sts", dir="/tmp")  # short: ipc paths are limited to 107 bytes
    with ExitStack() as stack:
        with pytest.MonkeyPatch.context() as mp:  # the run directory under `own`, only
            mp.setattr(tempfile, "tempdir", own)
            run = stack.enter_context(launch_stages(file, plan, slots=SMOLLM2_SLOTS,
                                                    ctx=SMOLLM2_CTX, say=lambda s: None))
        yield run
    shutil.rmtree(own, ignore_errors=True)


STAGE_TIMEOUT = 6.0   # a stopped stage is taken for hung past this (a busy CI host: not less)


@pytest.fixture(scope="session")
def smollm2_drafting_stages(smollm2):
    """SmolLM2 on 2 CPU stages (split at layer 15), SMOLLM2_SLOTS slots of SMOLLM2_CTX
    positions, the shipped NextN head on the last stage (MTP drafts where a case asks for
    them), and a stage taken for hung after STAGE_TIMEOUT: launched once for the session for
    test_parity's 2 stages, test_sampling_exact and test_stage_restart. The last kills and
    stops its stages (they are started again, as they would be for any user); it runs after
    the other two (module order)."""
    from strata.launch.plan import plan_stages
    from strata.launch.session import launch_stages
    from strata.model.gguf_file import ModelFile
    from strata.model.nextn import shipped_head

    file = ModelFile(smollm2)
    plan = plan_stages("15", ["cpu"], file.config.n_layers)
    own = tempfile.mkdtemp(prefix="std", dir="/tmp")  # short: ipc paths are limited to 107 bytes
    with ExitStack() as stack:
        with pytest.MonkeyPatch.context() as mp:  # the run directory under `own`, only
            mp.setattr(tempfile, "tempdir", own)
            run = stack.enter_context(launch_stages(
                file, plan, slots=SMOLLM2_SLOTS, ctx=SMOLLM2_CTX,
                mtp_head=shipped_head(file).path, stage_timeout=STAGE_TIMEOUT,
                say=lambda s: None))
        yield run
    shutil.rmtree(own, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_server(tiny_model, tmp_path_factory):
    """`strata-launch` serving the tiny model over HTTP (test_server.Serving): 2 stages, 4 slots
    in 2 groups, 512 positions; for the session (test_server's `tiny`)."""
    from test_server import CTX, Serving
    s = Serving(["--model", str(tiny_model), "--layer-split", "2", "--batch", "4",
                 "--batch-groups", "2", "--ctx-size", str(CTX)], tmp_path_factory.mktemp("logs"))
    yield s
    s.close()


@pytest.fixture(scope="session")
def smollm2_server(smollm2, tmp_path_factory):
    """`strata-launch` serving SmolLM2 over HTTP (a child process, test_server.Serving): 2
    stages, 4 slots in 2 pipelined groups, 3 MTP drafts a slot with the shipped head, an API
    key (Serving's clients send it); started once for the session, for the HTTP cases of
    test_server and test_structured_smollm2 and test_page's browser."""
    from test_server import Serving
    s = Serving(["--model", "smollm2-135m", "--layer-split", "15", "--batch",
                 str(SMOLLM2_SLOTS), "--batch-groups", "2", "--draft-tokens", "3", "--ctx-size",
                 str(SMOLLM2_CTX)], tmp_path_factory.mktemp("smollm2-server"),
                key="smollm2-test-key")
    yield s
    s.close()


SMOLLM2_REQUESTS = 8  # harness.prompt_set(8): short and long prompts, code, chat, French
SMOLLM2_TOKENS = 12


def smollm2_params(i: int):
    """Request i's sampling: even requests greedy, odd ones seeded (harness.request_params)."""
    from strata.bench import harness
    return harness.request_params(i, i % 2 == 1, SMOLLM2_TOKENS)


@pytest.fixture(scope="session")
def smollm2_alone(smollm2_stages):
    """The SmolLM2 reference of the batching and HTTP server cases: harness.prompt_set(8) with
    smollm2_params, each request alone (one slot, one request at a time) on the session's
    launch. Returns (tokenizer, prompts, params, requests)."""
    from strata.bench import harness
    from strata.coordinator.engine.scheduler import SchedulerConfig
    from strata.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_stages.file.reader)
    prompts = [tok.encode(t) for t in harness.prompt_set(SMOLLM2_REQUESTS)]
    params = [smollm2_params(i) for i in range(SMOLLM2_REQUESTS)]
    alone = harness.run_alone(smollm2_stages, SchedulerConfig(slots=1, ctx=SMOLLM2_CTX), tok,
                              prompts, params)
    texts = [r.seq.generated for r in alone]
    # the comparisons see real, varied output: most run to the end, no two alike
    assert sum(len(t) == SMOLLM2_TOKENS for t in texts) >= SMOLLM2_REQUESTS // 2, texts
    assert len({tuple(t) for t in texts}) == SMOLLM2_REQUESTS, texts
    return tok, prompts, params, alone


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 4-layer random llama GGUF in F32 with a byte-level vocabulary."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    return write_random_gguf(path, SHAPES["tiny"], seed=1)


@pytest.fixture(scope="session")
def varied_model(tmp_path_factory) -> Path:
    """The tiny shape with an untied head and weights of std 0.2 instead of 0.02. Its tokens
    depend on the whole context (tiny_model's greedy text repeats the last token), so greedy
    and seeded texts are long and varied, and a row that reads a wrong position, slot or cache
    entry changes them: for exactness tests that must be able to fail."""
    path = tmp_path_factory.mktemp("models") / "varied.gguf"
    return write_random_gguf(path, SHAPES["tiny"], seed=1, std=0.2, tied=False)


def stage_processes(marker: str = "") -> list[int]:
    """Pids of running strata stage workers (whose command line holds `marker`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        is_worker = b"strata.stage_worker" in cmd or any(c.endswith(b"strata-worker") for c in cmd)
        if is_worker and any(marker.encode() in c for c in cmd):
            pids.append(int(entry))
    return pids


@pytest.fixture
def no_stage_left(monkeypatch):
    """Fails the test if it leaves a stage worker process behind. The test's launches put their
    run directories (named in every worker's command line) under a directory of its own, so
    strata runs elsewhere on the machine don't count."""
    own = tempfile.mkdtemp(prefix="st", dir="/tmp")  # short: ipc paths are limited to 107 bytes
    monkeypatch.setenv("TMPDIR", own)
    monkeypatch.setattr(tempfile, "tempdir", own)
    yield own
    deadline = time.monotonic() + 5  # a worker told to shut down may take a moment to exit
    while stage_processes(own) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = stage_processes(own)
    shutil.rmtree(own, ignore_errors=True)
    assert not left, f"stage processes left behind: {left}"


@pytest.fixture(scope="session")
def _tiny_stages(tiny_model):
    """One launch of the tiny model: 2 CPU stages, 16 slots, 256 positions, for the session."""
    from strata.launch.options import prepare

    prep = prepare(model=str(tiny_model), layer_split="2", devices="cpu", ctx_size=256, batch=16,
                   batch_groups="1", window_rows=8, chunk_rows=32)
    own = tempfile.mkdtemp(prefix="stb", dir="/tmp")  # short: ipc paths are limited to 107 bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "tempdir", own)
        stages = prep.launch(say=lambda s: None)
        run = stages.__enter__()
    yield prep, run
    stages.__exit__(None, None, None)
    shutil.rmtree(own, ignore_errors=True)


@pytest.fixture
def shared_stages(_tiny_stages, monkeypatch):
    """Commands run in-process (click's CliRunner) reuse the session's launch of the tiny model
    wherever they would launch the same stages with no more slots or positions than it has, the
    same NextN head (none), no trace and no keys; any other launch is their own. Yields the
    plans that were served by it."""
    from contextlib import nullcontext

    from strata.launch.options import Prepared

    prep, run = _tiny_stages
    own_launch = Prepared.launch
    served = []

    def launch(self, **kwargs):
        if (self.file.path == prep.file.path and self.plan == prep.plan
                and self.sched.slots <= run.slots and self.sched.ctx <= run.ctx
                and (self.link, self.transport) == (prep.link, prep.transport)
                and self.mtp_head == prep.mtp_head and not kwargs.get("trace_dir")
                and not kwargs.get("keys")):
            served.append(self.plan)
            return nullcontext(run)
        return own_launch(self, **kwargs)

    monkeypatch.setattr(Prepared, "launch", launch)
    yield served


@pytest.fixture
def one_launch(monkeypatch):
    """The commands a test runs in-process (click's CliRunner) share one launch: the first
    Prepared.launch starts the stages and keeps them until the test ends, and every later one
    must ask for the same stages (model file, plan, link, NextN head; no more slots or
    positions) and is given those. Yields the list of the plans asked for."""
    from contextlib import nullcontext

    from strata.launch.options import Prepared

    own_launch, asked, first = Prepared.launch, [], []

    def launch(self, **kwargs):
        asked.append(self.plan)
        if not first:
            first.append((self, stack.enter_context(own_launch(self, **kwargs))))
        prep, run = first[0]
        assert (self.file.path, self.plan, self.link, self.transport, self.mtp_head) == (
            prep.file.path, prep.plan, prep.link, prep.transport, prep.mtp_head), self.plan
        assert self.sched.slots <= run.slots and self.sched.ctx <= run.ctx, self.sched
        return nullcontext(run)

    with ExitStack() as stack:
        monkeypatch.setattr(Prepared, "launch", launch)
        yield asked


# The cases that share the session's SmolLM2 launches (or transformers' SmolLM2) run in one
# process when the suite runs in several (pytest-xdist, `-n 2 --dist loadgroup` as the
# README's command has it), so that the launches and their references are made once; every
# other module runs whole in one process, so that its module fixtures are made once too. A
# module that takes the launch at run time (request.getfixturevalue) names the group itself:
# pytestmark = pytest.mark.xdist_group(SHARED_GROUP).
SHARED_LAUNCHES = ("smollm2_stages", "smollm2_alone", "smollm2_drafting_stages", "hf_model",
                   "smollm2_server")
SHARED_GROUP = "smollm2"


# The groups of half a minute or more on a 2-core machine, longest first. Under xdist they are
# handed out first, and the many short groups after them fill in, so that both processes end
# together (xdist's own order, most cases first, leaves the long one-case groups to the end).
LONG_GROUPS = (SHARED_GROUP, "test_triton_interpreter", "test_join", "test_ray_cluster",
               "test_families", "test_launch_errors", "test_shutdown")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):   # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def _group(item) -> str:
    return item.get_closest_marker("xdist_group").args[0]


@pytest.hookimpl(tryfirst=True)   # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        shared = any(f in item.fixturenames for f in SHARED_LAUNCHES)
        item.add_marker(pytest.mark.xdist_group(SHARED_GROUP if shared else item.module.__name__))
    if os.environ.get("PYTEST_XDIST_WORKER"):   # the order xdist hands the groups out in
        rank = {g: i for i, g in enumerate(LONG_GROUPS)}
        items.sort(key=lambda item: rank.get(_group(item), len(rank)))
