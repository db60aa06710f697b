"""The real operator process watching an API emulator that serves the PDService CRD, driven by kubectl."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator, Sequence

from .harness import REPO_ROOT, Kubectl, OperatorProcess, eventually, is_operator_request
from .server import EmulatedCluster

CRD = REPO_ROOT / "crds" / "pdservices.inference.pdoperator.dev.yaml"


def watching_pdservices(cluster: EmulatedCluster, since: int = 0) -> bool:
    return any(
        is_operator_request(r) and r.params.get("watch") == "true" and r.url.path.endswith("/pdservices")
        for r in cluster.requests()[since:]
    )


@contextlib.contextmanager
def operator_on_emulator(
    kubectl: pathlib.Path, workdir: pathlib.Path, args: Sequence[str]
) -> Iterator[tuple[EmulatedCluster, Kubectl, OperatorProcess]]:
    """The emulator with the CRD applied, kubectl on it, and the operator (``args``) watching PDServices. On
    exit the operator is stopped and must have exited cleanly, no handler having raised; its log's tail is
    printed (pytest shows it when a test failed)."""
    with EmulatedCluster() as cluster:
        kubeconfig = cluster.write_kubeconfig(workdir / "kubeconfig")
        cli = Kubectl(kubectl, kubeconfig)
        cli.run("apply", "--validate=false", "-f", str(CRD))
        operator = OperatorProcess(kubeconfig, workdir / "operator.log", args)
        operator.start()
        try:
            eventually(lambda: watching_pdservices(cluster), "the operator to watch PDServices", timeout=30)
            yield cluster, cli, operator
        finally:
            code = operator.stop()
            print(operator.log()[-6000:])
    assert code == 0, f"the operator exited with {code}"
    assert "failed with an exception" not in operator.log(), "a handler raised (see the log above)"
