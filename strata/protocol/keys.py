"""CurveZMQ keys: who a process is on its ZeroMQ endpoints, and whom it lets in.

A keys directory (made by `strata-keys DIR --name coordinator --name stage0 ...`, mode 0700)
holds one pair per process of a launch: NAME.key (the public key) and NAME.key_secret (both
keys, mode 0600), written by pyzmq's zmq.auth. A process named NAME (`coordinator`, or
`stage<K>` for stage K) loads its own secret and trusts every NAME.key in the directory:

  - its PULL socket (the stage's input, the coordinator's inbox) is a CURVE server: a ZAP
    handler (zmq.auth's ThreadAuthenticator) lets in only a peer whose public key is there,
    and drops everything from any other (no key, a wrong key);
  - its PUSH sockets are CURVE clients that know their peer's public key (stage<K+1>.key,
    coordinator.key), so they send nothing to a listener that cannot prove it holds that
    peer's secret, and every message is encrypted on the wire.

A host of a launch needs the public keys of all and only its own processes' secrets.
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import click

log = logging.getLogger("strata.keys")

COORDINATOR = "coordinator"
DIR_MODE = 0o700
SECRET_MODE = 0o600


def stage_name(stage: int) -> str:
    """The key name of stage `stage`."""
    return f"stage{stage}"


class KeysError(ValueError):
    """A keys directory or key file that cannot be used; the message says what to change."""


def make_keys(directory: Path, names: list[str]) -> list[Path]:
    """Write a key pair for each name into `directory` (made 0700 if new); returns the secret
    files. Never overwrites a pair: a secret already handed out would stop matching."""
    import zmq.auth
    directory = Path(directory)
    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise KeysError(f"--name {name!r} is not a plain file name; use e.g. "
                            f"{COORDINATOR} or {stage_name(1)}")
        if (directory / f"{name}.key_secret").exists() or (directory / f"{name}.key").exists():
            raise KeysError(f"{directory / name}.key already exists; remove the pair or "
                            f"choose another --name")
    if directory.is_dir() and stat.S_IMODE(directory.stat().st_mode) & 0o077:
        raise KeysError(f"{directory} is open to other users; name a new directory (made "
                        f"0700) or run chmod 700 {directory} first")
    try:
        directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        written = []
        for name in names:
            _, secret = zmq.auth.create_certificates(directory, name)
            os.chmod(secret, SECRET_MODE)
            written.append(Path(secret))
    except OSError as e:
        raise KeysError(f"cannot write keys into {directory} ({e.strerror or e}); name a "
                        f"directory you can create and write") from None
    return written


def _public_key(directory: Path, name: str) -> bytes:
    import zmq.auth
    path = directory / f"{name}.key"
    if not path.is_file():
        raise KeysError(f"{path} is missing; make it with strata-keys {directory} --name {name} "
                        f"(and copy it beside the other public keys)")
    return zmq.auth.load_certificate(path)[0]


@dataclass(frozen=True)
class CurveKeys:
    """One process's CURVE identity and the public keys it trusts (z85-encoded bytes)."""
    directory: Path
    name: str
    public: bytes
    secret: bytes
    trusted: frozenset[bytes]

    @classmethod
    def load(cls, directory: str | Path, name: str) -> CurveKeys:
        import zmq.auth
        directory = Path(directory)
        if not directory.is_dir():
            raise KeysError(f"--keys {directory} is not a directory; make one with "
                            f"strata-keys {directory} --name {name}")
        if stat.S_IMODE(directory.stat().st_mode) & 0o022:  # who writes there picks the peers
            raise KeysError(f"--keys {directory} can be written by other users, who could add "
                            f"keys it trusts; run chmod 700 {directory}")
        path = directory / f"{name}.key_secret"
        if not path.is_file():
            raise KeysError(f"{path} is missing: this process ({name}) has no secret key; make "
                            f"it with strata-keys {directory} --name {name}")
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            raise KeysError(f"{path} can be read by other users; run chmod 600 {path}")
        public, secret = zmq.auth.load_certificate(path)
        if secret is None:
            raise KeysError(f"{path} holds no secret key; make the pair again with strata-keys")
        trusted = frozenset(zmq.auth.load_certificates(directory))
        return cls(directory, name, public, secret, trusted)

    def peer(self, name: str) -> bytes:
        """The public key of the process named `name`, which a client checks the server by."""
        return _public_key(self.directory, name)

    def serve(self, sock) -> None:
        """Make `sock` a CURVE server with this identity (before it binds)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def connect_to(self, sock, peer: str) -> None:
        """Make `sock` a CURVE client of the process named `peer` (before it connects)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.peer(peer)

    def authenticator(self, context):
        """A started ZAP handler for `context`'s CURVE servers: lets in the trusted keys only,
        and logs a warning for each peer it refuses. Stop it before the context terminates."""
        from zmq.auth.thread import ThreadAuthenticator
        auth = ThreadAuthenticator(context, log=logging.getLogger("strata.keys.zap"))
        auth.start()
        auth.configure_curve_callback("*", _Trusted(self))
        return auth


class _Trusted:
    """zmq.auth's credentials provider: a client key is let in iff it is trusted."""

    def __init__(self, keys: CurveKeys):
        self.keys = keys
        self.refused = 0   # peers refused so far (read by whoever holds the sockets)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys.trusted:
            return True
        self.refused += 1
        log.warning("refused a peer whose key %s is not among the public keys in %s",
                    key.decode(errors="replace"), self.keys.directory)
        return False


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="strata", prog_name="strata-keys")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", "names", multiple=True,
              help=f"A process to make a key pair for: {COORDINATOR}, or {stage_name(0)}, "
                   f"{stage_name(1)}, ... (repeatable).")
@click.option("--stages", type=int, default=0,
              help=f"Also make pairs for {COORDINATOR} and {stage_name(0)} .. stage<N-1>.")
def main(directory: Path, names: tuple[str, ...], stages: int) -> None:
    """Make CurveZMQ key pairs into DIRECTORY (created 0700), for `--keys DIRECTORY` on
    strata-launch and strata-worker. Copy the directory to every host of a launch; a host
    needs every NAME.key and only the NAME.key_secret of the processes it runs."""
    wanted = list(dict.fromkeys([*names, *([COORDINATOR, *map(stage_name, range(stages))]
                                           if stages else [])]))
    if not wanted:
        raise click.UsageError(f"name the key pairs to make: --name {COORDINATOR} --name "
                               f"{stage_name(0)} ..., or --stages N")
    try:
        for secret in make_keys(directory, wanted):
            click.echo(f"strata-keys: wrote {secret.with_suffix('.key')} and {secret}", err=True)
    except KeysError as e:
        click.echo(f"strata-keys: {e}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
