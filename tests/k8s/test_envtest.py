"""``KubeApiServer`` (tests/k8s/envtest.py) as far as it can be proven without a kube-apiserver.

Pure parts: the skip reason, the flags, the kubeconfig, the credentials (both key tools). Process handling
(spawn, readiness by /readyz with the token and a verified TLS connection, restart, stop by PID, the failure
path) runs for real against this repository's etcd and pd-apiserver: the assets folder holds that etcd and,
as ``kube-apiserver``, a shim that records the flags it was given and execs pd-apiserver with the ones both
servers share (``--etcd-servers``, ``--bind-address``, ``--secure-port``, ``--cert-dir``; the token file is
translated). What only a real kube-apiserver can show (that it accepts every flag) is left to the envtest run.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import pathlib
import ssl
import stat
import subprocess
import sys
import urllib.request

import pytest
import yaml

from tests.k8s.envtest import (
    ADMIN,
    ASSETS_ENV,
    AssetsMissing,
    KeyTool,
    KubeApiServer,
    assets_missing,
    token_auth_line,
    write_credentials,
)
from tests.k8s.harness import Kubectl
from tests.k8s.real_server import BINARIES, ApiServerMissing

SHIM = """#!{python}
# kube-apiserver's command line in, pd-apiserver's out (see tests/k8s/test_envtest.py)
import os, pathlib, sys

here = pathlib.Path(__file__).parent
(here / "argv").write_text("\\n".join(sys.argv[1:]))
shared = ("--etcd-servers=", "--bind-address=", "--secure-port=", "--cert-dir=")
args = [a for a in sys.argv[1:] if a.startswith(shared)]
for arg in sys.argv[1:]:
    if arg.startswith("--token-auth-file="):
        token = pathlib.Path(arg.split("=", 1)[1]).read_text().split(",")[0]
        (here / "token").write_text(token)
        args.append(f"--token-file={{here / 'token'}}")
os.execv({server!r}, [{server!r}, *args])  # same PID: the harness stops what it started
"""


def executable(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# ---------------------------------------------------------------- skip reason


def test_without_kubebuilder_assets_the_reason_says_so_and_how_to_run_with_them() -> None:
    reason = assets_missing({})
    assert reason is not None
    assert reason.startswith("KUBEBUILDER_ASSETS is unset: this machine has no full kube-apiserver and etcd")
    assert reason.endswith("KUBEBUILDER_ASSETS=$(setup-envtest use -p path 1.35.x) make test")


def test_a_folder_without_both_binaries_is_named_with_what_it_lacks(tmp_path: pathlib.Path) -> None:
    executable(tmp_path / "etcd", "#!/bin/sh\n")
    (tmp_path / "kube-apiserver").write_text("not executable")
    reason = assets_missing({ASSETS_ENV: str(tmp_path)})
    assert reason is not None
    assert reason.startswith(f"KUBEBUILDER_ASSETS={tmp_path} holds no executable kube-apiserver;")
    assert assets_missing({ASSETS_ENV: str(tmp_path / "absent")}) == (
        f"KUBEBUILDER_ASSETS={tmp_path / 'absent'} holds no executable kube-apiserver and no etcd; "
        "point it at the folder `setup-envtest use -p path` prints: "
        "KUBEBUILDER_ASSETS=$(setup-envtest use -p path 1.35.x) make test"
    )
    executable(tmp_path / "kube-apiserver", "#!/bin/sh\n")
    assert assets_missing({ASSETS_ENV: str(tmp_path)}) is None


def test_without_assets_the_server_refuses_to_start_with_the_reason(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ASSETS_ENV, raising=False)
    with pytest.raises(AssetsMissing, match="KUBEBUILDER_ASSETS is unset"):
        KubeApiServer(tmp_path)


# ---------------------------------------------------------------- flags and kubeconfig


def test_flags_are_envtests_for_kubernetes_1_30_and_later_with_a_static_admin_token(
    tmp_path: pathlib.Path,
) -> None:
    server = KubeApiServer(tmp_path / "work", assets=tmp_path)
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in server.server_args())
    assert len(flags) == len(server.server_args())  # no flag twice
    work = tmp_path / "work"
    assert flags == {
        "etcd-servers": server.etcd_url,
        "cert-dir": str(work / "certs"),
        "secure-port": str(server.port),
        "bind-address": "127.0.0.1",
        "service-cluster-ip-range": "10.0.0.0/24",
        "service-account-issuer": f"https://127.0.0.1:{server.port}/",
        "service-account-key-file": str(work / "certs" / "sa.pub"),
        "service-account-signing-key-file": str(work / "certs" / "sa.key"),
        "authorization-mode": "RBAC",
        "token-auth-file": str(work / "tokens.csv"),
        "disable-admission-plugins": "ServiceAccount",
        "allow-privileged": "true",
    }
    etcd = server.etcd_args()
    assert f"--listen-client-urls={server.etcd_url}" in etcd
    assert f"--data-dir={work / 'etcd'}" in etcd
    assert "--unsafe-no-fsync=true" in etcd
    ports = {server.port, *(int(a.rsplit(":", 1)[1]) for a in etcd if a.startswith("--listen-"))}
    assert len(ports) == 3  # API, etcd client, etcd peer: three distinct free ports


def test_the_token_file_makes_the_admin_a_member_of_system_masters() -> None:
    (row,) = csv.reader([token_auth_line("s3cret")])
    assert row == ["s3cret", ADMIN, ADMIN, "system:masters"]
    (row,) = csv.reader([token_auth_line("t", "u", ("a", "b"))])
    assert row == ["t", "u", "u", "a,b"]  # several groups: one quoted field


def test_the_kubeconfig_trusts_the_written_certificate_and_carries_the_token(
    tmp_path: pathlib.Path, kubectl: pathlib.Path
) -> None:
    server = KubeApiServer(tmp_path / "work", assets=tmp_path)
    path = server.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a")
    view = Kubectl(kubectl, path).run("config", "view", "--minify", "--raw", "-o", "yaml").stdout
    config = yaml.safe_load(view)
    (cluster,) = config["clusters"]
    assert cluster["cluster"] == {
        "server": f"https://127.0.0.1:{server.port}",
        "certificate-authority": str(tmp_path / "work" / "certs" / "apiserver.crt"),
    }
    assert config["users"][0]["user"] == {"token": server.token}
    assert config["contexts"][0]["context"]["namespace"] == "team-a"


# ---------------------------------------------------------------- credentials


def openssl(*args: str) -> str:
    return subprocess.run(["openssl", *args], check=True, capture_output=True, text=True).stdout


NO_CRYPTOGRAPHY = importlib.util.find_spec("cryptography") is None


@pytest.mark.parametrize(
    "tool",
    [
        pytest.param(
            "cryptography",
            marks=pytest.mark.skipif(NO_CRYPTOGRAPHY, reason="no cryptography: openssl is used"),
        ),
        "openssl",
    ],
)
def test_credentials_serve_127_0_0_1_and_sign_service_account_tokens(
    tmp_path: pathlib.Path, tool: KeyTool
) -> None:
    write_credentials(tmp_path, tool)
    crt, key = str(tmp_path / "apiserver.crt"), str(tmp_path / "apiserver.key")
    names = openssl("x509", "-in", crt, "-noout", "-ext", "subjectAltName").splitlines()[1]
    assert sorted(n.strip() for n in names.split(",")) == ["DNS:localhost", "IP Address:127.0.0.1"]
    usage = openssl("x509", "-in", crt, "-noout", "-ext", "extendedKeyUsage")
    assert "TLS Web Server Authentication" in usage
    # its own trust anchor: the file is the kubeconfig's certificate-authority
    assert openssl("verify", "-CAfile", crt, crt).strip() == f"{crt}: OK"
    assert openssl("x509", "-in", crt, "-noout", "-pubkey") == openssl("pkey", "-in", key, "-pubout")
    sa_key = str(tmp_path / "sa.key")
    assert openssl("pkey", "-in", sa_key, "-pubout") == (tmp_path / "sa.pub").read_text()
    assert openssl("pkey", "-in", sa_key, "-noout", "-text").startswith("Private-Key: (2048 bit")
    assert "Modulus:" in openssl("pkey", "-pubin", "-in", str(tmp_path / "sa.pub"), "-noout", "-text")  # RSA
    ssl.create_default_context(cafile=crt)  # Python's TLS stack loads it as a trust store


# ---------------------------------------------------------------- process handling, for real


def shim_assets(folder: pathlib.Path, server: pathlib.Path) -> pathlib.Path:
    folder.mkdir()
    if not (BINARIES / "pd-apiserver").exists():
        raise ApiServerMissing(f"{BINARIES / 'pd-apiserver'} is missing: run scripts/build-apiserver.sh")
    (folder / "etcd").symlink_to(BINARIES / "etcd")
    executable(folder / "kube-apiserver", SHIM.format(python=sys.executable, server=str(server)))
    return folder


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_readiness_restart_and_stop_by_pid_against_pd_apiserver_through_a_flag_shim(
    tmp_path: pathlib.Path, kubectl: pathlib.Path
) -> None:
    assets = shim_assets(tmp_path / "assets", BINARIES / "pd-apiserver")
    with KubeApiServer(tmp_path / "work", assets=assets) as server:
        # the binary got exactly the flag list, and it served the certificate written for it
        assert (assets / "argv").read_text().splitlines() == server.server_args()
        written = ssl.PEM_cert_to_DER_cert((tmp_path / "work" / "certs" / "apiserver.crt").read_text())
        assert ssl.PEM_cert_to_DER_cert(ssl.get_server_certificate(("127.0.0.1", server.port))) == written
        strict = ssl.create_default_context(cafile=str(server.certificate))  # hostname checked
        request = urllib.request.Request(
            f"{server.url}/readyz", headers={"Authorization": f"Bearer {server.token}"}
        )
        with urllib.request.urlopen(request, context=strict, timeout=10) as response:
            assert response.status == 200
        assert server.request("GET", "/apis")[0] == 200
        server.token, token = "wrong", server.token
        assert server.request("GET", "/apis")[0] == 401
        server.token = token
        # kubectl through the written kubeconfig (Go's TLS verifying the same certificate)
        cli = Kubectl(kubectl, server.write_kubeconfig(tmp_path / "kubeconfig"))
        assert cli.run("get", "--raw", "/readyz").stdout.strip() == "ok"

        pids = server.pids
        assert set(pids) == {"etcd", "kube-apiserver"}
        server.restart()  # same port, same etcd
        assert server.pids["etcd"] == pids["etcd"]
        assert server.pids["kube-apiserver"] != pids["kube-apiserver"]
        assert not alive(pids["kube-apiserver"])
        assert cli.run("get", "--raw", "/readyz").stdout.strip() == "ok"
        pids = server.pids
    assert server.pids == {}
    assert not any(alive(pid) for pid in pids.values())


def test_a_server_that_exits_at_start_is_reported_with_its_log_and_etcd_is_stopped(
    tmp_path: pathlib.Path,
) -> None:
    failing = executable(tmp_path / "fails", "#!/bin/sh\necho 'Error: unknown flag: --bogus' >&2\nexit 3\n")
    assets = shim_assets(tmp_path / "assets", failing)
    server = KubeApiServer(tmp_path / "work", assets=assets)
    with pytest.raises(RuntimeError, match=r"kube-apiserver exited with 3:\nError: unknown flag: --bogus"):
        server.__enter__()
    etcd = server._etcd
    assert etcd is not None and etcd.poll() is not None and not alive(etcd.pid)
