"""`strata-launch`: start the stages, run the coordinator, print the generated text (with
--prompt) or serve the OpenAI-compatible HTTP API (without), clean up."""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace

import click

from strata.coordinator.api.openai_api import TextStream
from strata.coordinator.stages.pipeline import PipelineError
from strata.coordinator.sampling_params import SamplingParams
from strata.coordinator.engine.scheduler import Scheduler
from strata.coordinator.sequence import Sequence
from strata.launch.joins import parse_listen
from strata.launch.options import clean_errors, launch_options, prepare, say
from strata.launch.plan import PlanError, resolve_link
from strata.model.registry import DEFAULT_MODEL
from strata.model.tokenizer import Tokenizer
from strata.protocol.keys import COORDINATOR, CurveKeys, stage_name
from strata.protocol.transport import is_loopback


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata", prog_name="strata-launch")
@launch_options
@click.option("--prompt", default=None, help="The prompt text. Without it, serve HTTP.")
@click.option("--chat", is_flag=True, help="Render the prompt as one user message with the "
              "model's chat template.")
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off.")
@click.option("--min-p", type=float, default=0.0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=None, help="Seed of the sampling draws (random if unset).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="Divides a positive logit (multiplies a negative one) of each token in the "
                   "prompt or the output, as transformers and vLLM do; 1 = off.")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              help="Subtracted from a token's logit per occurrence in the output, in [-2, 2] "
                   "(OpenAI's); 0 = off.")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              help="Subtracted once from the logit of each token in the output, in [-2, 2] "
                   "(OpenAI's); 0 = off.")
@click.option("--logit-bias", multiple=True, metavar="ID=BIAS",
              help="Added to token ID's logit, in [-100, 100] (repeatable).")
@click.option("--min-tokens", type=int, default=0, show_default=True,
              help="The end-of-text and --stop-token-id tokens are held back until this many "
                   "tokens are generated.")
@click.option("--ignore-eos", is_flag=True,
              help="Go on past the model's end-of-text tokens (until --max-tokens).")
@click.option("--stop-token-id", type=int, multiple=True,
              help="A token id that ends the output, not part of it (repeatable).")
@click.option("--external-stage", type=int, multiple=True,
              help="Don't spawn stage K: print its strata-worker command and wait for it "
                   "(with --listen: for it to join from another host).")
@click.option("--listen", default=None, metavar="HOST:PORT",
              help="Wait for the --external-stage stages (with --cluster: every stage) to "
                   "join from other hosts here (strata-worker --join tcp://HOST:PORT --stage "
                   "K): HOST is this host's address as the others reach it; every endpoint "
                   "is then ZeroMQ tcp on it. Port 0: any free port (the command printed "
                   "names it).")
@click.option("--join-timeout", type=float, default=None,
              help="With --listen or --cluster: give up when the external stages have not "
                   "all joined (been placed) within this many seconds (default: wait for "
                   "ever).")
@click.option("--cluster", default=None, metavar="ray[://HOST:PORT]",
              help="Have Ray place the stages, one strata-worker each on a node with its "
                   "device (a GPU per CUDA stage, else a CPU), spread over the nodes; they "
                   "join this launch (the coordinator runs here) and talk over strata's own "
                   "protocol. ray: the cluster RAY_ADDRESS names, else the one running on "
                   "this host, else a local one started for the launch; ray://HOST:PORT: "
                   "through Ray client. Every node needs strata and the model file (and "
                   "--mtp-head, --keys) at the same path as here. The stages join at "
                   "--listen, by default 127.0.0.1 when every node is on this host, else "
                   "this host's address toward the cluster (which needs --keys or "
                   "--insecure). Needs pip install 'strata[ray]'.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Where each stage writes its log (default: the temporary run directory, "
                   "removed after a clean run, kept after a failure and named on stderr).")
@click.option("--keys", type=click.Path(file_okay=False), default=None,
              help="A keys directory made by strata-keys (coordinator and every stage<K>): "
                   "the ZeroMQ sockets of the launch authenticate and encrypt with CurveZMQ "
                   "and let in only those keys. Needs --transport zmq, or --listen (whose "
                   "endpoints are all ZeroMQ tcp).")
@click.option("--insecure", is_flag=True,
              help="With --listen beyond loopback and no --keys: bind the launch's tcp "
                   "endpoints anyway (any host that reaches them can send windows); the "
                   "stages spawned here are started with it too.")
@click.option("--restart-stages", is_flag=True,
              help="Serving: start a stage that dies or hangs (--stage-timeout) again; every "
                   "request in flight then rebuilds its KV from its tokens and ends with "
                   "exactly the tokens it would have had. Activations then go over ZeroMQ "
                   "frames (--stage-link zmq): a torch.distributed link cannot take a new "
                   "process.")
@click.option("-v", "--verbose", is_flag=True, help="Log the coordinator's decisions.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Serving (no --prompt): the address to listen on.")
@click.option("--port", type=int, default=8080, show_default=True,
              help="Serving: the TCP port (0 = any free port; the URL printed names it).")
@click.option("--api-key", default=None,
              help="Serving: every /v1 route, /tokenize and /detokenize then want "
                   "'Authorization: Bearer KEY'.")
@click.option("--served-model-name", multiple=True, metavar="NAME",
              help="Serving: the model's name in /v1/models and in every answer (default: "
                   "the --model name, or the file's name without .gguf); requests must name "
                   "it (or leave 'model' out). Repeat it for more accepted names: the first "
                   "is reported.")
@click.option("--allow-control-tokens-in-messages", is_flag=True,
              help="Read a control token's text written in a chat message ('<|im_end|>') as "
                   "that token, as transformers and llama.cpp do. Without it the text stays "
                   "text, so no message can close its turn and forge another (a system "
                   "turn); only the chat template's own control tokens are tokens.")
@click.option("--read-timeout", type=float, default=30.0, show_default=True,
              help="Serving: seconds a client has to send a request's headers, and again its "
                   "body; a connection idle that long between requests is closed.")
@click.option("--max-connections", type=int, default=512, show_default=True,
              help="Serving: open connections in all; more get a 503.")
@click.option("--max-client-connections", type=int, default=128, show_default=True,
              help="Serving: open connections from one client address; more get a 503.")
@clean_errors("strata-launch")
def main(prompt, chat, max_tokens, temperature, top_k, top_p, min_p, seed, stop,
         repetition_penalty, frequency_penalty, presence_penalty, logit_bias, min_tokens,
         ignore_eos, stop_token_id, external_stage, listen, join_timeout, cluster, log_dir,
         keys, insecure, restart_stages, verbose, host, port, api_key, served_model_name,
         allow_control_tokens_in_messages, read_timeout, max_connections,
         max_client_connections, **launch):
    """Run a GGUF model split across stage processes and print the generated text; without
    --prompt, serve the OpenAI-compatible HTTP API (sampling then comes with each request)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s coordinator %(levelname)s %(message)s")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=seed, max_tokens=max_tokens, stop=tuple(stop),
                            repetition_penalty=repetition_penalty,
                            frequency_penalty=frequency_penalty,
                            presence_penalty=presence_penalty,
                            logit_bias=parse_logit_bias(logit_bias), min_tokens=min_tokens,
                            ignore_eos=ignore_eos, stop_token_ids=stop_token_id).with_seed()
    if join_timeout is not None and not join_timeout > 0:
        raise PlanError(f"--join-timeout {join_timeout:g} is no duration; give a number of "
                        f"seconds above 0, or leave it out to wait for ever")
    if cluster is not None:
        if external_stage:
            raise PlanError("--cluster places every stage on the Ray cluster; leave "
                            "--external-stage out")
        from strata.launch.ray_cluster import prepare_on_cluster   # imports Ray
        prep, stages = prepare_on_cluster(cluster, listen, join_timeout, launch, say=say)
    else:
        prep, stages = prepare(**launch), dict(external=set(external_stage))
    for e in external_stage:
        if not 0 <= e < len(prep.plan):
            raise PlanError(f"--external-stage {e} does not exist: stages are "
                            f"0..{len(prep.plan) - 1}")
    if listen is not None and cluster is None:
        if not external_stage:
            raise PlanError("--listen waits for external stages to join from other hosts, and "
                            "there are none; add --external-stage K or leave --listen out")
        stages.update(listen=parse_listen(listen), join_timeout=join_timeout)
        prep = replace(prep, link=resolve_link(launch["stage_link"], prep.plan,
                                               across_hosts=True))
    elif join_timeout is not None and cluster is None:
        raise PlanError("--join-timeout limits the wait for stages joining at --listen; add "
                        "--listen HOST:PORT or leave --join-timeout out")
    if restart_stages:
        prep = restartable(prep, prompt, external_stage, launch["stage_link"])
    check_security(keys, insecure, prep, stages)
    stages.update(keys=keys, insecure=insecure)
    tok = Tokenizer.from_gguf(prep.file.reader)
    vocab = prep.file.config.vocab
    for flag, t in ([("--logit-bias", t) for t, _ in params.logit_bias]
                    + [("--stop-token-id", t) for t in params.stop_token_ids]):
        if t >= vocab:
            raise PlanError(f"{flag} names token {t}, outside the model's vocabulary [0, "
                            f"{vocab})")
    if prompt is None:
        limits = dict(read_timeout=read_timeout, max_connections=max_connections,
                      max_client_connections=max_client_connections,
                      allow_control_tokens_in_messages=allow_control_tokens_in_messages)
        return serve(prep, tok, launch["model"], served_model_name, host, port, api_key,
                     log_dir, stages, limits, restart_stages)
    if served_model_name:
        raise PlanError("--served-model-name names the model to HTTP clients, and --prompt "
                        "serves none; leave one of them out")
    ids = tok.encode_chat([{"role": "user", "content": prompt}],
                          control_in_content=allow_control_tokens_in_messages) if chat \
        else tok.encode(prompt)
    Sequence(ids, params, tok.stop_ids, prep.sched.ctx)  # refuses an empty or too long prompt
    with prep.launch(log_dir=log_dir, say=say, **stages) as run:
        say_stages(prep.plan, run.pipe)
        sched = Scheduler(run.pipe, prep.sched, tok.stop_ids, tok.decode)
        req, stamps = stream_one(sched, ids, params, tok.decode)
        counts = req.drafts.counts
        drafts = (f"{counts.accepted} of {counts.drafted} drafts ({prep.sched.drafter}) accepted, "
                  if prep.sched.draft_tokens else "")
        say(f"[{len(ids)} prompt tokens, {len(req.seq.generated)} generated, {drafts}"
            f"finish: {req.seq.finish_reason}, seed {params.seed}]")
        say(rates(len(ids), stamps))


def say_stages(plan, pipe) -> None:
    """A line a stage: its layers, its device, and what its hello says it made of the weights
    (kept in their blocks or widened, and with which activations decode windows take them)."""
    made = {row["stage"]: row["weights"] for row in pipe.stage_table()}
    for p in plan:
        what = f"; {made[p.index]}" if made.get(p.index) else ""
        say(f"stage {p.index}: layers [{p.layer_start}, {p.layer_end}) on {p.device}{what}")


def stream_one(sched: Scheduler, ids: list[int], params: SamplingParams, decode):
    """One request through `sched`, its text printed on stdout as its tokens come (held back
    where a stop string may begin, or a character is unfinished). Returns the request and the
    times (perf_counter) of its submission and of each token. On Ctrl-C the text so far stays
    printed, and the line is ended."""
    stamps = [time.perf_counter()]
    text = TextStream(decode, params.stop)

    def show(token: int) -> None:
        stamps.append(time.perf_counter())
        click.echo(text.push(token), nl=False)
        sys.stdout.flush()

    req = sched.submit(ids, params, on_token=show)
    try:
        sched.run()
    except KeyboardInterrupt:
        click.echo()
        raise
    if req.error:
        click.echo()
        raise PipelineError(req.error)
    click.echo(text.finish(req.seq.final_text()))
    return req, stamps


def rates(prompt_tokens: int, stamps: list[float]) -> str:
    """llama-cli's summary: the prompt read (submission to first token) and the decode (first
    token to last), each as tokens, seconds and tokens per second."""
    read = stamps[1] - stamps[0] if len(stamps) > 1 else 0.0
    decoded = max(len(stamps) - 2, 0)
    decode_s = stamps[-1] - stamps[1] if decoded else 0.0
    per_s = lambda n, s: f"{n / s:.2f} tok/s" if s > 0 else "- tok/s"   # noqa: E731
    return (f"[prompt: {prompt_tokens} tokens in {read:.3f} s, {per_s(prompt_tokens, read)}; "
            f"decode: {decoded} tokens in {decode_s:.3f} s, {per_s(decoded, decode_s)}]")


def parse_logit_bias(given: tuple[str, ...]) -> tuple[tuple[int, float], ...]:
    """--logit-bias ID=BIAS, repeatable, as SamplingParams.logit_bias."""
    out = []
    for item in given:
        token, _, bias = item.partition("=")
        try:
            out.append((int(token), float(bias)))
        except ValueError:
            raise PlanError(f"--logit-bias {item!r} is not ID=BIAS; give e.g. --logit-bias "
                            f"2=-100") from None
    return tuple(sorted(out))


def restartable(prep, prompt, external_stage, stage_link):
    """--restart-stages: a server whose stages this launch spawns, linked by ZeroMQ frames."""
    if external_stage:
        raise PlanError(f"--restart-stages starts failed stages again, and stage "
                        f"{external_stage[0]} is not this launch's to start "
                        f"(--external-stage); leave one of them out")
    if stage_link in ("nccl", "gloo") and len(prep.plan) > 1:
        raise PlanError(f"--stage-link {stage_link} joins the stages' processes once, so a "
                        f"stage started again could not rejoin it; use --stage-link zmq (or "
                        f"auto) with --restart-stages")
    if prompt is not None:
        raise PlanError("--restart-stages keeps a server going when a stage fails, and "
                        "--prompt runs one request; leave one of them out")
    return replace(prep, link="zmq")


def check_security(keys: str | None, insecure: bool, prep, stages: dict) -> None:
    """Before any process starts: keys go with ZeroMQ sockets, and the coordinator and every
    stage spawned here have their secret in the directory (an external stage brings its own)
    and every stage its public key; a launch that others join on an address beyond loopback
    has keys, or is told --insecure; a torch.distributed link between hosts has no keys."""
    listen = stages.get("listen")
    if insecure and keys:
        raise PlanError("--insecure opens the tcp endpoints that --keys would secure; give "
                        "one of them")
    if insecure and listen is None:
        raise PlanError("--insecure lets a launch that others join (--listen) bind beyond "
                        "loopback without keys, and there is no --listen; leave it out")
    if listen is not None and keys and prep.link in ("nccl", "gloo"):
        raise PlanError(f"--stage-link {prep.link} sends activations between hosts through "
                        f"torch.distributed, whose rendezvous and connections --keys cannot "
                        f"authenticate or encrypt; use --stage-link zmq (or auto) with --keys, "
                        f"or leave --keys out (beyond loopback: --insecure, on a network you "
                        f"trust)")
    if (listen is not None and not insecure and not is_loopback(listen[0])
            and prep.link in ("nccl", "gloo")):
        raise PlanError(f"--listen {listen[0]} with --stage-link {prep.link} would take windows "
                        f"and activations from any host that reaches it, and torch.distributed "
                        f"has no keys; on a network you trust give --insecure, else use "
                        f"--stage-link zmq (or auto) with --keys DIR")
    if listen is not None and not keys and not insecure and not is_loopback(listen[0]):
        raise PlanError(f"--listen {listen[0]} would take windows from any host that reaches "
                        f"it; give --keys DIR (key pairs made by strata-keys, its public keys "
                        f"on every host) or, on a network you trust, --insecure")
    if not keys:
        return
    if prep.transport != "zmq" and listen is None:
        raise PlanError(f"--keys secures ZeroMQ sockets, and --transport {prep.transport} has "
                        f"none (its sockets are reachable only through the launch's 0700 run "
                        f"directory); add --transport zmq or leave --keys out")
    external = stages["external"]
    coordinator = CurveKeys.load(keys, COORDINATOR)
    for p in prep.plan:
        if p.index in external:
            coordinator.peer(stage_name(p.index))   # its public key, which the inbox trusts
        else:
            CurveKeys.load(keys, stage_name(p.index))


def serve(prep, tok, model, served_names, host, port, api_key, log_dir, stages, limits,
          restart_stages):
    # the HTTP stack (aiohttp) is imported only to serve
    from strata.coordinator.api.connections import ServerConfig
    from strata.launch.serving import bind_socket, run_server

    if served_names:   # these names only, as vLLM's --served-model-name
        names = dict(model=served_names[0], aliases=tuple(served_names[1:]))
    else:
        names = dict(model=model if model == DEFAULT_MODEL else prep.file.path.stem,
                     aliases=(model, prep.file.path.name, str(prep.file.path)))
    cfg = ServerConfig(**names, host=host, port=port, api_key=api_key, **limits)
    sock = bind_socket(host, port)  # a taken port fails before any stage starts
    try:
        with prep.launch(log_dir=log_dir, say=say, **stages) as run:
            say_stages(prep.plan, run.pipe)
            failure = run_server(run.pipe, run.procs.check_alive, prep.sched, tok,
                                 prep.file.config.vocab, cfg, sock, say,
                                 restart=run.procs.restart if restart_stages else None)
            if failure:
                raise PipelineError(failure)
    finally:
        sock.close()
    say("strata: stopped; every stage has exited")


if __name__ == "__main__":
    main()
