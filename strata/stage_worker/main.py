"""`strata-worker`: one stage process. strata-launch starts these; a user can start one by hand
(under a debugger, on another host) with the command `strata-launch --external-stage K` prints,
or have it join a launch that waits for it with `--join tcp://HOST:PORT --stage K` (join.py:
the launch sends the arguments it would have spawned the stage with, and they run here)."""
import faulthandler
import logging
import os
import signal
import sys

import click

from strata.config_error import ConfigError
from strata.model.gguf_file import ModelError
from strata.model.registry import DEFAULT_MODEL, resolve_model
from strata.protocol.keys import COORDINATOR, CurveKeys, stage_name
from strata.protocol.messages import Error
from strata.protocol.transport import Sockets, send
from strata.stage_worker.join import JoinError, join_launch, with_flag
from strata.stage_worker.worker import StageWorker, WorkerConfig

# WorkerConfig's fields as this command's options
FLAGS = {"slots": "--slots", "ctx": "--ctx-size", "graph_cache": "--graph-cache",
         "weights": "--weights", "activations": "--activations",
         "link": "--link", "link_init": "--link-init", "mtp_head": "--mtp-head",
         "keys": "--keys", "insecure": "--insecure"}


def parse_layers(text: str) -> tuple[int, int]:
    try:
        start, end = (int(x) for x in text.split(":"))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not START:END, e.g. 0:12") from None
    return start, end


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata", prog_name="strata-worker")
@click.option("--model", default=None,
              help=f"A model name ({DEFAULT_MODEL}) or the path of a GGUF file (with --join: "
                   f"default, the launch's path).")
@click.option("--stage", type=int, required=True, help="This stage's index.")
@click.option("--join", default=None, metavar="tcp://HOST:PORT",
              help="Join the launch waiting there (strata-launch --external-stage K --listen "
                   "HOST:PORT): it gives the layers, the endpoints and the settings; --model, "
                   "--device, --listen and --mtp-head may still be given.")
@click.option("--join-timeout", type=float, default=300.0, show_default=True,
              help="With --join: seconds to wait for the launch to answer and place this "
                   "stage (a stage whose next stage joins too waits for it).")
@click.option("--layers", default=None, help="Layer range START:END (END exclusive).")
@click.option("--listen", default=None,
              help="Endpoint to bind for input: unix://PATH (Unix sockets, one host) or "
                   "ipc://, tcp:// (ZeroMQ). With --join: default tcp://ADDRESS:PORT, this "
                   "host's address toward the launch and a free port.")
@click.option("--coordinator", default=None, help="The coordinator's inbox endpoint.")
@click.option("--next", "next_", default=None, help="The next stage's endpoint (not on the last).")
@click.option("--device", default=None, help="cpu (the default) or cuda:N; with --join: "
              "default, the launch's --devices for this stage.")
@click.option("--slots", type=int, default=1, show_default=True)
@click.option("--ctx-size", type=int, default=2048, show_default=True)
@click.option("--graph-cache", type=int, default=16, show_default=True,
              envvar="STRATA_GRAPH_CACHE",
              help="CUDA graphs kept per stage, one per window shape (0: always eager). "
                   "Also read from STRATA_GRAPH_CACHE.")
@click.option("--weights", type=click.Choice(["quantized", "bf16"]), default="bf16",
              show_default=True, envvar="STRATA_WEIGHTS",
              help="On a CUDA device: quantized keeps the file's Q4_0, Q4_1, Q5_0, Q5_1, "
                   "Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS matrices in their blocks (other "
                   "types are "
                   "widened to bf16); "
                   "bf16 widens every matrix. CPU stages widen to fp32. strata-launch "
                   "chooses for its stages (--weights auto). Also read from STRATA_WEIGHTS.")
@click.option("--activations", type=click.Choice(["float", "int8"]), default="float",
              show_default=True, envvar="STRATA_ACTIVATIONS",
              help="On a CUDA device with --weights quantized: what decode windows multiply "
                   "the quantized weights with: float, the rows in bf16; int8, each row "
                   "quantized to int8 (a scale per 32 values) and integer block sums. Also "
                   "read from STRATA_ACTIVATIONS.")
@click.option("--link", type=click.Choice(["zmq", "nccl", "gloo"]), default="zmq",
              show_default=True,
              help="How activations come from / go to the neighbouring stages: ZeroMQ frames, "
                   "or torch.distributed (nccl between GPUs of one host; gloo between CPU "
                   "processes). Every stage of a launch uses the same.")
@click.option("--link-init", default="", help="Where the link's stages meet, the same for "
              "every stage: file:///tmp/strata-x/link, or tcp://HOST:PORT (a TCPStore the "
              "launch hosts, for stages on several hosts).")
@click.option("--link-world", type=int, default=1, show_default=True,
              help="Stages in the link (all stages of the launch; rank = --stage).")
@click.option("--trace", default="", help="Write a timeline of this stage's windows (host marks, "
              "GPU spans) to this JSON file on exit; `python -m strata.bench.tracereport` "
              "reads it.")
@click.option("--mtp-head", default=None,
              help="A NextN (MTP) head GGUF made for this model: the last stage drafts with "
                   "it (Window.propose). Without it, the model file's own NextN layer if it "
                   "has one; other stages ignore it.")
@click.option("--keys", type=click.Path(file_okay=False), default=None,
              help="A keys directory made by strata-keys: this stage (stage<K>.key_secret) "
                   "authenticates and encrypts every ZeroMQ endpoint and lets in only peers "
                   "whose public key (NAME.key) is there. With --join, its questions to the "
                   "launch too (the launch's coordinator.key checked).")
@click.option("--insecure", is_flag=True,
              help="Without --keys, listen on a tcp:// endpoint beyond loopback anyway (any "
                   "host that reaches it can send windows).")
@click.option("--joined", is_flag=True, hidden=True,
              help="Started by --join: a failure while starting is also told to the "
                   "coordinator, which cannot see this process.")
@click.pass_context
def main(ctx, model, stage, join, join_timeout, layers, listen, coordinator, next_, device, slots,
         ctx_size, graph_cache, weights, activations, link, link_init, link_world, trace,
         mtp_head, keys, insecure, joined):
    """Serve one stage of a layer-split model."""
    if join is not None:
        return run_joined(ctx, stage, join, join_timeout, model, listen, device, mtp_head, keys,
                          insecure)
    missing = [flag for flag, value in (("--model", model), ("--layers", layers),
                                        ("--listen", listen), ("--coordinator", coordinator))
               if value is None]
    if missing:
        raise click.UsageError(f"{' '.join(missing)} missing: give them, or --join "
                               f"tcp://HOST:PORT to take them from a launch that waits for "
                               f"stage {stage}")
    device = device or "cpu"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s stage{stage} %(levelname)s %(message)s")
    # `kill -USR1 PID` writes where each of the stage's threads is to its log (a stage that
    # hangs on its device, say), and the stage goes on
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):   # a stderr with no file (in a test's runner)
        pass
    start, end = parse_layers(layers)
    try:
        # Test hook: STRATA_FAULT=crash-at-start:K makes stage K fail while starting.
        if os.environ.get("STRATA_FAULT") == f"crash-at-start:{stage}":
            raise RuntimeError(f"stage {stage}: crash at start requested by STRATA_FAULT")
        path = resolve_model(model, say=lambda s: click.echo(f"strata-worker: {s}", err=True))
        cfg = WorkerConfig(model=str(path), stage=stage, layer_start=start, layer_end=end,
                           listen=listen, coordinator=coordinator, next=next_, device=device,
                           slots=slots, ctx=ctx_size, graph_cache=graph_cache,
                           weights=weights, activations=activations, link=link,
                           link_init=link_init, link_world=link_world,
                           trace=trace, mtp_head=mtp_head, keys=keys, insecure=insecure)
        worker = StageWorker(cfg)
    except (ModelError, ValueError) as e:
        text = e.render(FLAGS) if isinstance(e, ConfigError) else str(e)
        click.echo(f"strata-worker: stage {stage}: {text}", err=True)
        if joined:
            tell_coordinator(coordinator, stage, text, keys, insecure)
        sys.exit(2)
    except Exception as e:
        if joined:
            tell_coordinator(coordinator, stage, f"{type(e).__name__}: {e}", keys, insecure)
        raise
    worker.serve()
    # serve() closed the sockets, the link and the trace: the process has nothing left to do.
    # Python's own teardown of torch's modules would still take ~1 s of a core, which every
    # launch's shutdown waits for; flush what is buffered and end the process now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tell_coordinator(endpoint: str, stage: int, text: str, keys: str | None,
                     insecure: bool) -> None:
    """Send the coordinator at `endpoint` an Error saying why this stage could not start (it
    then ends the launch with that sentence instead of waiting for the hello); best effort:
    a coordinator that cannot be reached within a few seconds learns it from the timeout."""
    try:
        identity = CurveKeys.load(keys, stage_name(stage)) if keys else None
        sockets = Sockets(identity, insecure)
        send(sockets.push(endpoint, peer=COORDINATOR), Error(stage, -1, text))
        sockets.close(linger_ms=3000)
    except Exception as e:   # the stage's own stderr has said why it stops
        logging.getLogger("strata.worker").warning("stage %d: could not tell the coordinator "
                                                   "at %s: %s", stage, endpoint, e)


def run_joined(ctx, stage, join, join_timeout, model, listen, device, mtp_head, keys, insecure):
    """Join the launch at `join`, then start as a spawned stage does, with its arguments and
    this host's own keys (or --insecure)."""
    given = {"--layers", "--coordinator", "--next", "--slots", "--ctx-size", "--graph-cache",
             "--weights", "--activations",
             "--link", "--link-init", "--link-world", "--trace"}
    clash = sorted(p.opts[0] for p in ctx.command.params if p.opts[0] in given and
                   ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE)
    if clash:
        raise click.UsageError(f"{' '.join(clash)}: with --join the launch gives these; leave "
                               f"them out (--model, --device, --listen, --mtp-head, --keys "
                               f"and --insecure may be given)")

    def say(text: str) -> None:
        click.echo(f"strata-worker: stage {stage}: {text}", err=True)

    try:
        identity = CurveKeys.load(keys, stage_name(stage)) if keys else None
        args = join_launch(join, stage, model, listen, join_timeout, keys=identity,
                           insecure=insecure, say=say)
    except (JoinError, ModelError, ValueError) as e:
        say(str(e))
        sys.exit(2)
    for flag, value in (("--device", device), ("--mtp-head", mtp_head), ("--keys", keys)):
        if value is not None:   # this host's own
            args = with_flag(args, flag, value)
    if insecure:
        args.append("--insecure")
    say(f"joined {join}; starting with: {' '.join(args)}")
    args.append("--joined")
    main.main(args=args, prog_name="strata-worker")

if __name__ == "__main__":
    main()
