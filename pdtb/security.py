"""Optional authentication and encryption between processes: ZeroMQ CURVE.

`pdtb keys --out DIR` writes two key pairs in ZeroMQ's certificate format: `server.key` /
`server.key_secret` (every binding socket: node control sockets, KV receivers) and
`client.key` / `client.key_secret` (every connecting socket: the router, KV senders). A
process started with `--curve-dir DIR` encrypts its sockets, and its binding sockets accept
only peers holding the client secret key (a ZAP authenticator checks the client public key).
Without the flag everything runs in the clear, bound to loopback by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq


class SecurityError(ValueError):
    """Keys missing or unreadable."""


@dataclass(frozen=True)
class CurveKeys:
    directory: str  # holds server.key[_secret] and client.key[_secret]
    server_public: bytes
    server_secret: bytes | None
    client_public: bytes
    client_secret: bytes | None

    @classmethod
    def load(cls, directory: str | Path) -> "CurveKeys":
        import zmq.auth

        d = Path(directory)

        def pair(name: str) -> tuple[bytes, bytes | None]:
            secret = d / f"{name}.key_secret"
            try:
                return zmq.auth.load_certificate(secret if secret.exists() else d / f"{name}.key")
            except (OSError, ValueError) as e:
                raise SecurityError(f"cannot read CURVE {name} key in {d}: {e}") from None

        sp, ss = pair("server")
        cp, cs = pair("client")
        return cls(str(d), sp, ss, cp, cs)


def generate(directory: str | Path) -> Path:
    """Write a server and a client key pair into `directory` (created, mode 700)."""
    import zmq.auth

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in ("server", "client"):
        zmq.auth.create_certificates(str(d), name)
        (d / f"{name}.key_secret").chmod(0o600)  # secret keys: owner only, whatever the umask
    return d


def _own_pair(sock: zmq.Socket, public: bytes, secret: bytes | None, side: str, verb: str) -> None:
    """Give a socket its own CURVE key pair; `side`'s secret key must have been loaded."""
    if secret is None:
        raise SecurityError(f"the {side} secret key is needed to {verb} a secured socket")
    sock.curve_secretkey = secret
    sock.curve_publickey = public


def secure_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make a binding socket a CURVE server (call before bind)."""
    if keys is None:
        return
    _own_pair(sock, keys.server_public, keys.server_secret, "server", "bind")
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make a connecting socket a CURVE client of the server key (call before connect)."""
    if keys is None:
        return
    _own_pair(sock, keys.client_public, keys.client_secret, "client", "connect")
    sock.curve_serverkey = keys.server_public


def start_authenticator(ctx: zmq.Context, keys: CurveKeys | None):
    """ZAP handler in `ctx`: binding CURVE sockets accept only the client public key. Returns
    the authenticator (stop() it on shutdown) or None without keys."""
    if keys is None:
        return None
    from zmq.auth.asyncio import AsyncioAuthenticator

    pub = Path(keys.directory) / "authorized"
    pub.mkdir(exist_ok=True)
    (pub / "client.key").write_bytes((Path(keys.directory) / "client.key").read_bytes())
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(pub))
    return auth
