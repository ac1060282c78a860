"""strata-worker --join tcp://HOST:PORT --stage K: ask a launch that waits for stage K
(strata-launch --external-stage K --listen HOST:PORT) for the stage's place, and return the
strata-worker arguments it would have been spawned with, so that the stage then starts as a
spawned one does.

Two questions (protocol/join.py): JoinAsk -> the launch's model file and fingerprint; the
stage checks its own model file (--model, else the launch's path, on a shared file system)
and says its fingerprint and endpoint (JoinConfirm) -> the arguments. A model file with
another fingerprint is refused on both sides.
"""
from __future__ import annotations

import time

from strata.model.gguf_file import ModelFile
from strata.model.registry import resolve_model
from strata.protocol.join import address_toward, ask, free_ports, parse_tcp
from strata.protocol.messages import (PROTOCOL_VERSION, JoinAsk, JoinConfirm, JoinModel,
                                      JoinPlan, JoinRefused, JoinWait)

RETRY_S = 1.0   # how soon a stage told to wait asks again
TELL_S = 5.0    # how long a stage that will not join waits for the launch to hear why


class JoinError(ValueError):
    """The stage cannot join; the message says what to change."""


def join_launch(endpoint: str, stage: int, model: str | None, listen: str | None,
                timeout_s: float, say=print) -> list[str]:
    """The strata-worker arguments for `stage` of the launch at `endpoint`, with `model` (None:
    the launch's path) and `listen` (None: tcp://this host's address toward the launch:a free
    port). Raises JoinError."""
    host, port = parse_tcp(endpoint)
    deadline = time.monotonic() + timeout_s
    told = set()
    while True:
        offer = _ask(endpoint, JoinAsk(PROTOCOL_VERSION, stage), stage, deadline, timeout_s)
        if isinstance(offer, JoinWait):
            _wait(offer, told, say)
            continue
        _expect(offer, JoinModel)
        path = resolve_model(model or offer.model)
        mine = ModelFile(path).fingerprint()
        if listen is None:
            address = address_toward(host, port)
            listen = f"tcp://{address}:{free_ports(address)[0]}"
        if mine != offer.fingerprint:   # told too, so that the launch says so on its side
            ask(endpoint, JoinConfirm(stage, mine, listen), TELL_S)
            raise JoinError(f"the model file {path} is not the launch's (fingerprint {mine}; "
                            f"the launch runs {offer.model}, fingerprint {offer.fingerprint}); "
                            f"pass --model with a copy of that file")
        answer = _ask(endpoint, JoinConfirm(stage, mine, listen), stage, deadline, timeout_s)
        if isinstance(answer, JoinWait):
            _wait(answer, told, say)
            continue
        _expect(answer, JoinPlan)
        return with_flag(answer.args, "--model", str(path))


def _ask(endpoint: str, question, stage: int, deadline: float, timeout_s: float):
    """The launch's answer; JoinError for a refusal, or when none comes by the deadline."""
    answer = ask(endpoint, question, max(0.0, deadline - time.monotonic()))
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
