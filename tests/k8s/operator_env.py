"""The real operator process in the one world of the tests: the emulator in front (core, apps, policy,
networking...) forwarding the PDService CRD and its objects to the real CRD-serving API server, which
validates, defaults and stores them; kubectl and the operator talk to the front only."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterable, Iterator, Sequence

import yaml

from .harness import REPO_ROOT, Kubectl, OperatorProcess, eventually, is_operator_request
from .real_server import RealApiServer
from .server import EmulatedCluster

CRD = REPO_ROOT / "crds" / "pdservices.inference.pdoperator.dev.yaml"
PDSERVICES_DISCOVERY = "/apis/inference.pdoperator.dev/v1alpha1"


def watching_pdservices(cluster: EmulatedCluster, since: int = 0) -> bool:
    return any(
        is_operator_request(r) and r.params.get("watch") == "true" and r.url.path.endswith("/pdservices")
        for r in cluster.requests()[since:]
    )


def create_namespaces(cli: Kubectl, names: Iterable[str]) -> None:
    """A real cluster needs a namespace before anything is created in it (the emulator checks it too)."""
    documents = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in names]
    if documents:
        cli.run("apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump_all(documents))


def install_crd(cli: Kubectl, real: RealApiServer, manifest: pathlib.Path, discovery: str) -> None:
    """``kubectl create`` through the front (``apply`` would store the whole CRD again in an annotation, over
    the real server's 256 KiB limit for big schemas), then wait until the real server serves the group."""
    cli.run("create", "--validate=false", "-f", str(manifest))
    eventually(lambda: real.request("GET", discovery)[0] == 200, f"{discovery} served", timeout=30)


@contextlib.contextmanager
def one_world(
    kubectl: pathlib.Path, workdir: pathlib.Path, namespaces: Iterable[str] = ()
) -> Iterator[tuple[RealApiServer, EmulatedCluster, Kubectl]]:
    """A real API server of its own (an operator watching all namespaces must not meet other tests'
    PDServices), the emulator in front of it with ``namespaces`` created and the PDService CRD installed, and
    kubectl on the front."""
    with RealApiServer(workdir / "apiserver") as real, EmulatedCluster(upstream=real) as cluster:
        cli = Kubectl(kubectl, cluster.write_kubeconfig(workdir / "kubeconfig"))
        create_namespaces(cli, namespaces)
        install_crd(cli, real, CRD, PDSERVICES_DISCOVERY)
        yield real, cluster, cli


@contextlib.contextmanager
def running_operator(
    cluster: EmulatedCluster, cli: Kubectl, log: pathlib.Path, args: Sequence[str]
) -> Iterator[OperatorProcess]:
    """The operator (``args``) on the front, watching PDServices. On exit it is stopped and must have exited
    cleanly (SIGTERM, code 0), no handler having raised; its log's tail is printed (pytest shows it when a
    test failed)."""
    operator = OperatorProcess(cli.kubeconfig, log, args)
    mark = len(cluster.requests())
    operator.start()
    try:
        eventually(lambda: watching_pdservices(cluster, mark), "the operator to watch PDServices", timeout=30)
        yield operator
    finally:
        code = operator.stop()  # None: the test stopped it already (and checked how it went)
        print(operator.log()[-6000:])
    assert code in (0, None), f"the operator exited with {code}"
    assert "failed with an exception" not in operator.log(), "a handler raised (see the log above)"


@contextlib.contextmanager
def operator_in_one_world(
    kubectl: pathlib.Path, workdir: pathlib.Path, args: Sequence[str], namespaces: Iterable[str] = ()
) -> Iterator[tuple[EmulatedCluster, Kubectl, OperatorProcess]]:
    """``one_world`` with the operator (``args``) running in it (``running_operator``)."""
    with (
        one_world(kubectl, workdir, namespaces) as (_, cluster, cli),
        running_operator(cluster, cli, workdir / "operator.log", args) as operator,
    ):
        yield cluster, cli, operator
