"""strata-worker --join tcp://HOST:PORT --stage K: ask a launch that waits for stage K
(strata-launch --external-stage K --listen HOST:PORT) for the stage's place, and return the
strata-worker arguments it would have been spawned with, so that the stage then starts as a
spawned one does.

Two questions (protocol/join.py): JoinAsk -> the launch's model file and fingerprint; the
stage checks its own model file (--model, else the launch's path, on a shared file system)
and says its fingerprint and endpoint (JoinConfirm) -> the arguments. A model file with
another fingerprint is refused on both sides.

With keys (--keys DIR: this stage's secret and the launch's coordinator.key) the questions go
over CurveZMQ; the arguments the launch hands over carry no keys, the stage adds its own
--keys or --insecure. Its endpoint is checked before it asks: a tcp bind beyond loopback
needs one of them.
"""
from __future__ import annotations

import time

from strata.model.gguf_file import ModelFile
from strata.model.registry import resolve_model
from strata.protocol.join import (JoinHandshakeError, address_toward, ask, free_ports,
                                  parse_tcp)
from strata.protocol.keys import CurveKeys
from strata.protocol.messages import (PROTOCOL_VERSION, JoinAsk, JoinConfirm, JoinModel,
                                      JoinPlan, JoinRefused, JoinWait)
from strata.protocol.transport import check_tcp

RETRY_S = 1.0   # how soon a stage told to wait asks again
TELL_S = 5.0    # how long a stage that will not join waits for the launch to hear why


class JoinError(ValueError):
    """The stage cannot join; the message says what to change."""


def join_launch(endpoint: str, stage: int, model: str | None, listen: str | None,
                timeout_s: float, keys: CurveKeys | None = None, insecure: bool = False,
                say=print) -> list[str]:
    """The strata-worker arguments for `stage` of the launch at `endpoint`, with `model` (None:
    the launch's path) and `listen` (None: tcp://this host's address toward the launch:a free
    port), asked with `keys` (this stage's identity) if given. The arguments carry neither
    --keys nor --insecure. Raises JoinError, or OpenEndpointError for a listen endpoint beyond
    loopback without keys or insecure."""
    host, port = parse_tcp(endpoint)
    if listen is None:
        try:
            address = address_toward(host, port)
        except OSError as e:   # the host does not resolve, or has no route from here
            raise JoinError(f"cannot reach the launch at {endpoint} ({e.strerror or e}); check "
                            f"its host and port") from None
        listen = f"tcp://{address}:{free_ports(address)[0]}"
    check_tcp(listen, bind=True, keyed=keys is not None, insecure=insecure, warn=False)
    deadline = time.monotonic() + timeout_s
    told = set()
    while True:
        offer = _ask(endpoint, JoinAsk(PROTOCOL_VERSION, stage), stage, deadline, timeout_s,
                     keys)
        if isinstance(offer, JoinWait):
            _wait(offer, told, say)
            continue
        _expect(offer, JoinModel)
        path = resolve_model(model or offer.model)
        mine = ModelFile(path).fingerprint()
        if mine != offer.fingerprint:   # told too, so that the launch says so on its side
            ask(endpoint, JoinConfirm(stage, mine, listen), TELL_S, keys)
            raise JoinError(f"the model file {path} is not the launch's (fingerprint {mine}; "
                            f"the launch runs {offer.model}, fingerprint {offer.fingerprint}); "
                            f"pass --model with a copy of that file")
        answer = _ask(endpoint, JoinConfirm(stage, mine, listen), stage, deadline, timeout_s,
                      keys)
        if isinstance(answer, JoinWait):
            _wait(answer, told, say)
            continue
        _expect(answer, JoinPlan)
        return with_flag(answer.args, "--model", str(path))


def _ask(endpoint: str, question, stage: int, deadline: float, timeout_s: float,
         keys: CurveKeys | None):
    """The launch's answer; JoinError for a refusal, a failed handshake, or when none comes
    by the deadline."""
    try:
        answer = ask(endpoint, question, max(0.0, deadline - time.monotonic()), keys)
    except JoinHandshakeError:
        raise JoinError(
            f"the CurveZMQ handshake with {endpoint} failed: give --keys with a copy of the "
            f"launch's keys directory (stage{stage}'s secret, its coordinator.key), and check "
            f"that a strata launch listens there"
            if keys is not None else
            f"the handshake with {endpoint} failed: the launch there wants CurveZMQ keys (give "
            f"--keys with a copy of its keys directory), or what listens there is no strata "
            f"launch (check the address)") from None
    if answer is None:
        raise JoinError(f"no launch answered at {endpoint} within {timeout_s:g}s; start "
                        f"strata-launch --external-stage {stage} --listen HOST:PORT with that "
                        f"address first, or give a longer --join-timeout")
    if isinstance(answer, JoinRefused):
        raise JoinError(f"the launch refused the join: {answer.message}")
    return answer


def _expect(answer, kind: type) -> None:
    if not isinstance(answer, kind):
        raise JoinError(f"the launch answered with a {type(answer).__name__} where a "
                        f"{kind.__name__} comes; run the same strata version on both hosts")


def _wait(answer: JoinWait, told: set[str], say) -> None:
    if answer.message not in told:
        say(f"waiting: {answer.message}")
        told.add(answer.message)
    time.sleep(RETRY_S)


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """args with flag's value replaced (appended when absent)."""
    args = list(args)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    return args
