"""A full kube-apiserver and its etcd from ``KUBEBUILDER_ASSETS``: controller-runtime's envtest convention.

Where the machine has them (a laptop or a CI with internet: ``setup-envtest use -p path 1.35.x`` prints such a
folder), the operator's end-to-end tests run against the whole Kubernetes API (core, apps, policy,
networking, admission, RBAC) instead of the emulator. Elsewhere ``assets_missing()`` is the skip reason.

    with KubeApiServer(workdir) as server:
        kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")

Flags follow envtest's defaults for Kubernetes 1.30+ (controller-runtime's
``pkg/internal/testing/controlplane``): etcd and the secure port on loopback, the service-account issuer and
keys that 1.20+ requires, ``ServiceAccount`` admission off (no controller creates the default account), RBAC.
Where envtest provisions client certificates, this harness uses a static token of a ``system:masters`` member:
kubectl, kopf and ``request`` all speak bearer tokens, and nothing here needs a second user. The serving
certificate is written here (as envtest does) so that it names 127.0.0.1 whatever address the server
advertises, and every client verifies it, hostname included. No controllers run: nothing fills the status of
a StatefulSet and no garbage collector deletes dependents.
"""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
import os
import pathlib
import ssl
import subprocess
from collections.abc import Mapping
from typing import Literal

from .control_plane import ControlPlane

ASSETS_ENV = "KUBEBUILDER_ASSETS"
BINARIES = ("kube-apiserver", "etcd")
HOW_TO_RUN = f"{ASSETS_ENV}=$(setup-envtest use -p path 1.35.x) make test"
ADMIN = "pd-tests-admin"
ADMIN_GROUP = "system:masters"  # authorized for everything by kube-apiserver itself, before RBAC is consulted
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"  # envtest's: headless Services take none, the router's takes one
KeyTool = Literal["cryptography", "openssl"]


class AssetsMissing(RuntimeError):
    """``KUBEBUILDER_ASSETS`` names no folder with both binaries."""


def assets_missing(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why no full control plane can start here (the text tests skip with), or None when one can."""
    folder = environ.get(ASSETS_ENV, "")
    if not folder:
        return (
            f"{ASSETS_ENV} is unset: this machine has no full kube-apiserver and etcd (controller-runtime's "
            f"envtest convention); to run these tests against one: {HOW_TO_RUN}"
        )
    absent = [name for name in BINARIES if not os.access(pathlib.Path(folder) / name, os.X_OK)]
    if absent:
        return (
            f"{ASSETS_ENV}={folder} holds no executable {' and no '.join(absent)}; point it at the folder "
            f"`setup-envtest use -p path` prints: {HOW_TO_RUN}"
        )
    return None


def default_key_tool() -> KeyTool:
    # ``cryptography`` is no declared dependency of the project; openssl is on every machine envtest runs on
    return "cryptography" if importlib.util.find_spec("cryptography") else "openssl"


def write_credentials(certs: pathlib.Path, tool: KeyTool | None = None) -> None:
    """Into ``certs``: ``apiserver.crt``/``apiserver.key`` (the serving pair kube-apiserver picks up from its
    ``--cert-dir``; self-signed, naming localhost and 127.0.0.1, its own trust anchor) and
    ``sa.key``/``sa.pub`` (the RSA pair that signs and checks service-account tokens)."""
    certs.mkdir(parents=True, exist_ok=True)
    if (tool or default_key_tool()) == "cryptography":
        _credentials_with_cryptography(certs)
    else:
        _credentials_with_openssl(certs)


def _credentials_with_cryptography(certs: pathlib.Path) -> None:
    # imported here: the openssl path must work where the package is absent
    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import rsa  # noqa: PLC0415
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: PLC0415

    def private_pem(key: rsa.RSAPrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pd-tests-apiserver")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))  # tolerate clock skew between test processes
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    (certs / "apiserver.key").write_bytes(private_pem(key))
    (certs / "apiserver.crt").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    signer = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (certs / "sa.key").write_bytes(private_pem(signer))
    (certs / "sa.pub").write_bytes(
        signer.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def _credentials_with_openssl(certs: pathlib.Path) -> None:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=certs, check=True, capture_output=True, timeout=60)

    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "7", "-subj", "/CN=pd-tests-apiserver",
        "-keyout", "apiserver.key", "-out", "apiserver.crt",
        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        "-addext", "extendedKeyUsage=serverAuth",
    )  # fmt: skip
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key")
    openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub")


def token_auth_line(token: str, user: str = ADMIN, groups: tuple[str, ...] = (ADMIN_GROUP,)) -> str:
    """One line of kube-apiserver's ``--token-auth-file``: token, user name, uid, then the groups quoted."""
    quoted = '"' + ",".join(groups) + '"'
    return f"{token},{user},{user},{quoted}\n"


class KubeApiServer(ControlPlane):
    """etcd plus kube-apiserver from ``assets`` (default: ``$KUBEBUILDER_ASSETS``) on 127.0.0.1, state under
    ``workdir`` (kept across ``restart()``)."""

    server_name = "kube-apiserver"
    kubeconfig_name = "envtest"
    # envtest's choice too: etcd state of a test run is thrown away, so fsync only costs time
    etcd_extra_args = ("--unsafe-no-fsync=true",)
    verify_hostname = True

    def __init__(
        self, workdir: pathlib.Path, assets: pathlib.Path | None = None, *, key_tool: KeyTool | None = None
    ) -> None:
        if assets is None:
            reason = assets_missing()
            if reason is not None:
                raise AssetsMissing(reason)
            assets = pathlib.Path(os.environ[ASSETS_ENV])
        super().__init__(workdir, assets)
        self.key_tool = key_tool

    @property
    def certs(self) -> pathlib.Path:
        return self.workdir / "certs"

    @property
    def token_file(self) -> pathlib.Path:
        return self.workdir / "tokens.csv"

    @property
    def certificate(self) -> pathlib.Path:
        return self.certs / "apiserver.crt"

    def prepare(self) -> None:
        if not self.certificate.exists():  # a second __enter__ on the same workdir keeps what clients trust
            write_credentials(self.certs, self.key_tool)
        self.token_file.write_text(token_auth_line(self.token))
        # the certificate exists before the server does: readiness already goes through full verification
        self._ssl = ssl.create_default_context(cafile=str(self.certificate))

    def server_args(self) -> list[str]:
        return [
            f"--etcd-servers={self.etcd_url}",
            f"--cert-dir={self.certs}",
            f"--secure-port={self.port}",
            "--bind-address=127.0.0.1",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            f"--service-account-issuer={self.url}/",
            f"--service-account-key-file={self.certs / 'sa.pub'}",
            f"--service-account-signing-key-file={self.certs / 'sa.key'}",
            "--authorization-mode=RBAC",
            f"--token-auth-file={self.token_file}",
            "--disable-admission-plugins=ServiceAccount",
            "--allow-privileged=true",
        ]
