"""Who may talk to an engine: ZMQ CURVE keys derived from one shared secret, and where an engine
may listen without one.

The secret (a key file's content, or MINIVLLM_ENGINE_KEY) never crosses the wire. Both sides
derive two CURVE keypairs from it: the engine's (its ROUTER is a CURVE server) and the clients'
(every frontend that holds the secret uses the same one). The engine accepts only the derived
client public key (a ZAP check), so a peer without the secret cannot finish the handshake: it
sends nothing the engine decodes. CURVE also encrypts the traffic.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import stat

import zmq

ENGINE_KEY_ENV = "MINIVLLM_ENGINE_KEY"
# The ZMQ monitor events of a failed CURVE handshake, as both ends explain them.
HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the two ends' keys differ",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "one end uses an engine key and the other does not",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the engine rejected the client's key",
}
HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
MIN_SECRET_LENGTH = 16
_SERVER_LABEL = b"minivllm engine server key\0"
_CLIENT_LABEL = b"minivllm engine client key\0"


class CurveKeys:
    """The two keypairs derived from one secret, z85-encoded as pyzmq's options take them."""

    def __init__(self, secret: str) -> None:
        from zmq.utils import z85

        if not isinstance(secret, str) or len(secret.strip()) < MIN_SECRET_LENGTH:
            raise ValueError(f"the engine key must be at least {MIN_SECRET_LENGTH} characters "
                             "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`).")
        if not zmq.has("curve"):
            raise RuntimeError("this pyzmq's libzmq has no CURVE support; an engine key cannot be used.")
        raw = secret.strip().encode()
        self.server_secret = z85.encode(hashlib.sha256(_SERVER_LABEL + raw).digest())
        self.server_public = zmq.curve_public(self.server_secret)
        self.client_secret = z85.encode(hashlib.sha256(_CLIENT_LABEL + raw).digest())
        self.client_public = zmq.curve_public(self.client_secret)

    def make_server(self, socket) -> None:
        """Make `socket` (the engine's ROUTER) a CURVE server; call before bind."""
        socket.curve_secretkey = self.server_secret
        socket.curve_publickey = self.server_public
        socket.curve_server = True

    def make_client(self, socket) -> None:
        """Make `socket` (a frontend's DEALER) a CURVE client of the engine; call before connect."""
        socket.curve_secretkey = self.client_secret
        socket.curve_publickey = self.client_public
        socket.curve_serverkey = self.server_public


def start_client_key_authenticator(ctx: zmq.Context, allowed_client_key: bytes, log_name: str):
    """ZAP on `ctx`: a CURVE handshake completes only for a peer presenting this client public key
    (holding the secret is not enough to be any client: it must be ours). Stop it on shutdown."""
    import hmac
    import logging

    from zmq.auth.thread import ThreadAuthenticator

    class _OnlyThisClient:
        def callback(self, domain: str, key: bytes) -> bool:
            return hmac.compare_digest(key, allowed_client_key)

    authenticator = ThreadAuthenticator(ctx, log=logging.getLogger(log_name))
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=_OnlyThisClient())
    return authenticator


def read_engine_key_file(path: str) -> str:
    """The secret in a key file (surrounding whitespace dropped). A file other users can read is
    refused: the secret would not be one."""
    info = os.stat(path)
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"engine key file {path} is readable by other users (mode {stat.filemode(info.st_mode)}); "
                         f"`chmod 600 {path}`.")
    with open(path) as f:
        return f.read().strip()


def resolve_engine_key(key_file: str | None = None, key: str | None = None) -> str | None:
    """The secret to use: an explicit key, else the key file, else $MINIVLLM_ENGINE_KEY, else None."""
    if key is not None:
        return key
    if key_file is not None:
        return read_engine_key_file(key_file)
    return os.environ.get(ENGINE_KEY_ENV) or None


def is_local_address(address: str) -> bool:
    """Whether only this host can reach `address`: ipc://, inproc://, or TCP on a loopback address
    (127.0.0.0/8, ::1, localhost). A wildcard (*, 0.0.0.0) or any other interface is not."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name or a hostname: it may be reachable from outside
        return False


def check_bind_allowed(address: str, engine_key: str | None, insecure: bool) -> None:
    """An engine reachable from other hosts must authenticate its clients: without a key it
    refuses to bind a non-loopback address unless told --insecure."""
    if engine_key is None and not insecure and not is_local_address(address):
        raise ValueError(
            f"refusing to serve at {address} without an engine key: anyone who can reach it could submit work "
            f"or shut the engine down. Give --engine-key-file FILE (or set {ENGINE_KEY_ENV}); frontends then "
            "attach with the same key (engine_key=... or the same variable). Or bind a loopback address, or "
            "pass --insecure if the network is trusted."
        )
