"""Certificates made in the tests with the openssl CLI: a CA, a server, clients."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    """A client certificate signed by another CA."""
    stranger_key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _key_and_csr(directory: Path, name: str, subject: str) -> tuple[Path, Path]:
    key, csr = directory / f"{name}.key", directory / f"{name}.csr"
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", key, "-out", csr, "-subj", subject)  # fmt: skip
    return key, csr


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", key, "-out", cert, "-days", "2",
             "-subj", f"/CN={name}")  # fmt: skip
    return cert, key


def _signed(
    directory: Path, name: str, ca: tuple[Path, Path], extensions: str
) -> tuple[Path, Path]:
    key, csr = _key_and_csr(directory, name, f"/CN={name}")
    ext, cert = directory / f"{name}.ext", directory / f"{name}.pem"
    ext.write_text(extensions)
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
             "-out", cert, "-days", "2", "-extfile", ext)  # fmt: skip
    return cert, key


def make_certs(directory: Path) -> Certs:
    """A CA, a server certificate for localhost and 127.0.0.1, a client certificate it signed,
    and a client certificate another CA signed."""
    ca = _ca(directory, "genq-test-ca")
    server = _signed(
        directory,
        "localhost",
        ca,
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    client = _signed(directory, "test-client", ca, "extendedKeyUsage=clientAuth\n")
    stranger = _signed(
        directory, "stranger", _ca(directory, "other-ca"), "extendedKeyUsage=clientAuth\n"
    )
    return Certs(ca[0], *server, *client, *stranger)


def channel_credentials(certs: Certs, *, client: bool = True) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.client_key.read_bytes() if client else None,
        certificate_chain=certs.client_cert.read_bytes() if client else None,
    )


def tls_env(certs: Certs, *, mutual: bool) -> dict[str, str]:
    env = {"GENQ_TLS_CERT_FILE": str(certs.server_cert), "GENQ_TLS_KEY_FILE": str(certs.server_key)}
    if mutual:
        env["GENQ_TLS_CLIENT_CA_FILE"] = str(certs.ca)
    return env
