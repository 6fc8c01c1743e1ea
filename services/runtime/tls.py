"""TLS and mutual TLS for the gRPC listeners and channels of the stages, the gateway and its clients.

Serving (every stage; the gateway's Converse port with its own --ssl-* flags):
  --tls-cert / --tls-key      PEM certificate chain and private key: serve TLS instead of plaintext
  --tls-client-ca             PEM CA bundle: also require a client certificate signed by it (mTLS)

Calling (a stage's next stage, the gateway's thinker / code2wav, `voxpipe say`):
  --tls-ca                    PEM CA bundle the servers' certificates must chain to: dial TLS
  --tls-client-cert / --tls-client-key   present this certificate (for servers with --tls-client-ca)
  --tls-server-name           the name every server certificate is checked against (default: the
                              host of each address; for a dns:///name:port entry, `name`, although
                              its replicas are dialled by IP address)

Every flag has an environment twin (VOXPIPE_TLS_CERT, VOXPIPE_TLS_KEY, VOXPIPE_TLS_CLIENT_CA,
VOXPIPE_TLS_CA, VOXPIPE_TLS_CLIENT_CERT, VOXPIPE_TLS_CLIENT_KEY, VOXPIPE_TLS_SERVER_NAME): certificates
mounted from a Kubernetes Secret. Without any of them everything stays plaintext; a half-given set
(a certificate without its key, a client CA without a server certificate, a client certificate
without a CA ...) is refused at start with TLSConfigError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:       # grpc is imported where it is used: the flag functions here stay light (`--help`)
    import grpc


class TLSConfigError(ValueError):
    """TLS flags that do not make a usable configuration (the message names the flags)."""


def _read_pem(path: str, flag: str) -> bytes:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TLSConfigError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise TLSConfigError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class ServerTLS:
    """A listener's TLS: its certificate chain and key (PEM bytes), and optionally the CA client
    certificates must chain to (then a client without such a certificate is refused: mTLS)."""
    cert: bytes
    key: bytes
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: str | None, key: str | None, client_ca: str | None = None, *,
                   flags: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-client-ca")) -> "ServerTLS | None":
        """None when no file is given (plaintext); TLSConfigError when only part of a pair is."""
        cert_flag, key_flag, ca_flag = flags
        if not (cert or key or client_ca):
            return None
        if not cert or not key:
            given, missing = (cert_flag, key_flag) if cert else (key_flag, cert_flag)
            if not cert and not key:
                raise TLSConfigError(f"{ca_flag} (mutual TLS) needs {cert_flag} and {key_flag}: the server must "
                                     "serve TLS before it can ask for client certificates")
            raise TLSConfigError(f"{given} is given without {missing}: serving TLS needs both the certificate "
                                 "and its private key")
        return cls(_read_pem(cert, cert_flag), _read_pem(key, key_flag),
                   _read_pem(client_ca, ca_flag) if client_ca else None)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


@dataclass(frozen=True)
class ClientTLS:
    """A client's TLS: the CA server certificates must chain to, optionally a client certificate
    and key to present, optionally one name to check every server certificate against."""
    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_files(cls, ca: str | None, cert: str | None = None, key: str | None = None,
                   server_name: str | None = None) -> "ClientTLS | None":
        """None when no file is given (plaintext); TLSConfigError for a partial set."""
        if not (ca or cert or key):
            if server_name:
                raise TLSConfigError("--tls-server-name is given without --tls-ca: it names the servers' "
                                     "certificate, which only a TLS client checks")
            return None
        if bool(cert) != bool(key):
            given, missing = ("--tls-client-cert", "--tls-client-key") if cert else ("--tls-client-key",
                                                                                     "--tls-client-cert")
            raise TLSConfigError(f"{given} is given without {missing}: a client certificate needs both the "
                                 "certificate and its private key")
        if not ca:
            raise TLSConfigError("--tls-client-cert/--tls-client-key are given without --tls-ca: name the CA "
                                 "the servers' certificates are checked against")
        return cls(_read_pem(ca, "--tls-ca"), _read_pem(cert, "--tls-client-cert") if cert else None,
                   _read_pem(key, "--tls-client-key") if key else None, server_name or None)

    def credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self, server_name: str | None = None) -> list[tuple[str, Any]]:
        """The name to check the server certificate against, when it is not the dialled host
        (--tls-server-name first, then `server_name`: the name of a dns:/// entry)."""
        name = self.server_name or server_name
        return [("grpc.ssl_target_name_override", name)] if name else []


def aio_channel(address: str, tls: ClientTLS | None, options: list[tuple[str, Any]] | None = None,
                server_name: str | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `address`: plaintext without `tls`, else TLS (see ClientTLS)."""
    import grpc

    options = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options + tls.channel_options(server_name))


def channel(address: str, tls: ClientTLS | None, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """The blocking twin of `aio_channel` (for `voxpipe health`)."""
    import grpc

    options = list(options or [])
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.credentials(), options=options + tls.channel_options())


def add_port(server: grpc.Server | grpc.aio.Server, address: str, tls: ServerTLS | None) -> int:
    """Bind `address` on `server`, with TLS when given; returns the port (0: not bound)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.credentials())


# ----------------------------------------------------------------------------- command line

ENV = {"tls_cert": "VOXPIPE_TLS_CERT", "tls_key": "VOXPIPE_TLS_KEY", "tls_client_ca": "VOXPIPE_TLS_CLIENT_CA",
       "tls_ca": "VOXPIPE_TLS_CA", "tls_client_cert": "VOXPIPE_TLS_CLIENT_CERT",
       "tls_client_key": "VOXPIPE_TLS_CLIENT_KEY", "tls_server_name": "VOXPIPE_TLS_SERVER_NAME"}


def _env(dest: str) -> str | None:
    return os.environ.get(ENV[dest]) or None


def add_server_tls_arguments(parser) -> None:
    g = parser.add_argument_group("TLS (serving)")
    g.add_argument("--tls-cert", default=_env("tls_cert"),
                   help="PEM certificate chain: serve TLS (with --tls-key; env VOXPIPE_TLS_CERT; default: plaintext)")
    g.add_argument("--tls-key", default=_env("tls_key"), help="PEM private key of --tls-cert (env VOXPIPE_TLS_KEY)")
    g.add_argument("--tls-client-ca", default=_env("tls_client_ca"),
                   help="PEM CA bundle: require a client certificate signed by it, mutual TLS "
                        "(env VOXPIPE_TLS_CLIENT_CA)")


def add_client_tls_arguments(parser, who: str = "the next stage") -> None:
    g = parser.add_argument_group(f"TLS (calling {who})")
    g.add_argument("--tls-ca", default=_env("tls_ca"),
                   help=f"PEM CA bundle {who}'s certificates must chain to: dial TLS (env VOXPIPE_TLS_CA; "
                        "default: plaintext)")
    g.add_argument("--tls-client-cert", default=_env("tls_client_cert"),
                   help="PEM client certificate to present, for servers with --tls-client-ca (with "
                        "--tls-client-key; env VOXPIPE_TLS_CLIENT_CERT)")
    g.add_argument("--tls-client-key", default=_env("tls_client_key"),
                   help="PEM private key of --tls-client-cert (env VOXPIPE_TLS_CLIENT_KEY)")
    g.add_argument("--tls-server-name", default=_env("tls_server_name"),
                   help="check every server certificate against this name (default: the dialled host; for "
                        "dns:///name:port entries, name) (env VOXPIPE_TLS_SERVER_NAME)")


def server_tls_from_args(args) -> ServerTLS | None:
    return ServerTLS.from_files(getattr(args, "tls_cert", None), getattr(args, "tls_key", None),
                                getattr(args, "tls_client_ca", None))


def client_tls_from_args(args) -> ClientTLS | None:
    return ClientTLS.from_files(getattr(args, "tls_ca", None), getattr(args, "tls_client_cert", None),
                                getattr(args, "tls_client_key", None), getattr(args, "tls_server_name", None))
