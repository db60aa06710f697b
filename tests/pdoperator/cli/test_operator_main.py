"""``pd-operator`` command line: how its options reach kopf (kopf.run is replaced; no cluster needed)."""

from __future__ import annotations

import sys
from typing import Any

import kopf
import pytest
from pdoperator.cli import operator_main
from pdoperator.reconcile.handlers import HandlerSettings, apply_kopf_settings
from pdoperator.reconcile.kube import KubernetesApi


@pytest.fixture
def kopf_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: calls.append({"configure": kwargs}))
    monkeypatch.setattr(
        KubernetesApi, "from_environment", classmethod(lambda cls, user_agent, timeout_seconds: object())
    )
    return calls


def run_kwargs(calls: list[dict[str, Any]]) -> dict[str, Any]:
    (kwargs,) = [c for c in calls if "configure" not in c]
    return kwargs


def test_namespaces_scope_kopf_and_one_replica_runs_standalone(kopf_calls: list[dict[str, Any]]) -> None:
    assert operator_main.main(["--namespace", "team-a", "--namespace=team-b"]) == 0
    kwargs = run_kwargs(kopf_calls)
    assert (kwargs["clusterwide"], kwargs["namespaces"]) == (False, ["team-a", "team-b"])
    assert (kwargs["standalone"], kwargs["peering_name"], kwargs["priority"]) == (True, None, None)
    assert isinstance(kwargs["registry"], kopf.OperatorRegistry)


def test_all_namespaces_with_peering_and_liveness(kopf_calls: list[dict[str, Any]]) -> None:
    assert (
        operator_main.main(
            ["--all-namespaces", "--peering", "pd-operator", "--liveness", "http://0.0.0.0:8080/healthz"]
        )
        == 0
    )
    kwargs = run_kwargs(kopf_calls)
    assert (kwargs["clusterwide"], kwargs["namespaces"]) == (True, [])
    assert (kwargs["standalone"], kwargs["peering_name"]) == (False, "pd-operator")
    assert kwargs["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    assert 1 <= kwargs["priority"] < 2**31  # drawn at random: replicas never tie (kopf would pause them all)


def test_an_explicit_peering_priority_is_kept(kopf_calls: list[dict[str, Any]]) -> None:
    operator_main.main(["--peering", "p", "--priority", "7"])
    assert run_kwargs(kopf_calls)["priority"] == 7


def test_no_scope_means_all_namespaces(kopf_calls: list[dict[str, Any]]) -> None:
    operator_main.main([])
    assert run_kwargs(kopf_calls)["clusterwide"] is True


@pytest.mark.parametrize(
    ("flag", "expected"),
    [("json", kopf.LogFormat.JSON), ("plain", kopf.LogFormat.PLAIN), ("full", kopf.LogFormat.FULL)],
)
def test_log_format_and_verbosity_reach_kopf_logging(
    kopf_calls: list[dict[str, Any]], flag: str, expected: kopf.LogFormat
) -> None:
    operator_main.main(["--log-format", flag, "--verbose"])
    (configure,) = [c["configure"] for c in kopf_calls if "configure" in c]
    assert configure == {"verbose": True, "log_format": expected}


def test_namespace_and_all_namespaces_are_mutually_exclusive(
    kopf_calls: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        operator_main.main(["--namespace", "a", "--all-namespaces"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert kopf_calls == []


def test_a_non_positive_interval_is_rejected_with_a_message(
    kopf_calls: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert operator_main.main(["--kv-check-interval", "0"]) == 2
    assert "--kv-check-interval" in capsys.readouterr().err
    assert kopf_calls == []


def test_without_any_kubernetes_configuration_it_exits_with_a_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(kopf, "run", lambda **kwargs: pytest.fail("kopf must not start"))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: None)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    assert operator_main.main([]) == 1
    assert "no Kubernetes configuration" in capsys.readouterr().err


def test_the_router_image_comes_from_the_chart_environment() -> None:
    assert (
        operator_main.render_defaults("cluster.local", {"PD_OPERATOR_ROUTER_IMAGE": "r:1"}).router_image
        == "r:1"
    )
    assert operator_main.render_defaults("example.org", {}).cluster_domain == "example.org"
    assert operator_main.render_defaults(None, {}).cluster_domain == "cluster.local"
    chart_env = {
        "PD_OPERATOR_ENGINE_IMAGE": "e:1",
        "PD_OPERATOR_MOCK_ENGINE_IMAGE": "m:1",
        "PD_OPERATOR_CLUSTER_DOMAIN": "corp.local",
    }
    from_chart = operator_main.render_defaults(None, chart_env)
    assert (from_chart.engine_image, from_chart.mock_engine_image, from_chart.cluster_domain) == (
        "e:1",
        "m:1",
        "corp.local",
    )


def test_the_watch_timeout_reaches_kopf_as_whole_seconds(
    kopf_calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf sends it as the watch's timeoutSeconds, which kube-apiserver parses as an integer (300.0: 400)."""
    settings = kopf.OperatorSettings()
    apply_kopf_settings(settings, HandlerSettings())
    assert str(settings.watching.server_timeout) == "300"
    handed: list[HandlerSettings] = []
    monkeypatch.setattr(operator_main, "register", lambda *args: handed.append(args[-1]))
    operator_main.main(["--watch-timeout", "7"])
    apply_kopf_settings(settings, handed[0])
    assert str(settings.watching.server_timeout) == "7"


def test_a_fractional_watch_timeout_is_refused(
    kopf_calls: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        operator_main.main(["--watch-timeout", "2.5"])
    assert exit_info.value.code == 2
    assert "--watch-timeout" in capsys.readouterr().err
    assert operator_main.main(["--watch-timeout", "0"]) == 2


class ApiAnswered(Exception):
    """Stands for kopf's API errors, which carry the HTTP status of the answer."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def kopf_ends_with(monkeypatch: pytest.MonkeyPatch, error: Exception) -> list[list[str]]:
    def run(**_: Any) -> None:
        raise error

    execs: list[list[str]] = []
    monkeypatch.setattr(kopf, "run", run)
    monkeypatch.setattr(kopf, "configure", lambda **_: None)
    monkeypatch.setattr(
        KubernetesApi, "from_environment", classmethod(lambda cls, user_agent, timeout_seconds: object())
    )
    monkeypatch.setattr(operator_main.time, "sleep", lambda _: None)
    monkeypatch.setattr(operator_main.os, "execv", lambda path, args: execs.append([path, *args]))
    return execs


def test_a_watched_resource_the_api_server_does_not_serve_yet_starts_the_operator_over(monkeypatch):
    # a restarted API server answers 404 for a CRD's resource until it serves the CRD again; kopf's reactor
    # ends on it (seen against the real server): the operator starts over with the same arguments
    execs = kopf_ends_with(monkeypatch, ApiAnswered(404))
    operator_main.main(["--namespace", "team-a"])
    ((path, python, flag, module, *args),) = execs
    assert path == python == sys.executable
    assert (flag, module, args) == ("-m", "pdoperator.cli.operator_main", ["--namespace", "team-a"])


def test_any_other_end_of_kopf_is_the_operator_s_end(monkeypatch):
    execs = kopf_ends_with(monkeypatch, ApiAnswered(403))
    with pytest.raises(ApiAnswered):
        operator_main.main([])
    assert execs == []
