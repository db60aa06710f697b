"""Hypothesis strategies for PDService specs near the edges of the API's rules.

Each part of a spec is drawn from a few values chosen around the inputs of the CEL rules in
``pdoperator.api.rules`` and ``parallel_rules`` and the schema's bounds, enums and patterns: values on
both sides of a bound, every enum member plus one that is not, TP sizes that divide and ones that do
not. Most parts are left out most of the time, so that a spec usually breaks no rule or one rule
(neighbours of the boundary), and a fair share of specs is accepted.
"""

from __future__ import annotations

from typing import Any, TypeVar

from hypothesis import strategies as st

T = TypeVar("T")
Draw = st.DrawFn

SPECULATIVE_ARGS = (
    '--speculative-config={"method":"ngram","num_speculative_tokens":2}',
    "--speculative_config",
    "--speculative-config.method=ngram",
    # Not the flag: a prefix of it, and a value that only mentions it.
    "--speculative",
    "speculative-config",
)
PLAIN_ARGS = ("--enforce-eager", "--gpu-memory-utilization=0.8", "x" * 4096)
# Flags the operator sets or refuses: rejected by pdctl only (the CRD does not list them).
OPERATOR_ARGS = ("--tensor-parallel-size=2", "-dp", "--port=9000", "--block-size=32")


def sometimes(draw: Draw, strategy: st.SearchStrategy[T], chance: int) -> T | None:
    """A value from ``strategy`` in about ``chance`` of 10 draws, else None (the field is left out)."""
    return draw(strategy) if draw(st.integers(0, 9)) < chance else None


def chance(draw: Draw, tenths: int) -> bool:
    """True in about ``tenths`` of 10 draws."""
    return draw(st.integers(0, 9)) < tenths


def put(target: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        target[key] = value


def one(*values: T) -> st.SearchStrategy[T]:
    return st.sampled_from(values)


def edge(valid: tuple[T, ...], invalid: tuple[T, ...], odds: int = 120) -> st.SearchStrategy[T]:
    """A value the schema accepts or, in about one of ``odds`` draws, one it refuses (out of bounds, not in
    the enum, not matching the pattern): rare, as a spec has some 30 such fields and most should reach the CEL
    rules."""
    return st.tuples(st.integers(0, odds - 1), st.sampled_from(valid), st.sampled_from(invalid)).map(
        lambda drawn: drawn[2] if drawn[0] == 0 else drawn[1]
    )


@st.composite
def tolerations(draw: Draw) -> list[dict[str, Any]]:
    items = []
    for _ in range(draw(st.integers(1, 2))):
        toleration: dict[str, Any] = {}
        put(toleration, "key", sometimes(draw, one("gpu", "gpu", "gpu", ""), 8))
        put(toleration, "operator", sometimes(draw, edge(("Exists", "Equal"), ("In",)), 6))
        put(toleration, "value", sometimes(draw, one("", "yes"), 4))
        put(toleration, "effect", sometimes(draw, one("NoSchedule", "PreferNoSchedule", "NoExecute"), 5))
        put(toleration, "tolerationSeconds", sometimes(draw, edge((0, 30, 2**53 - 1), (-1, 2**53, 2**63)), 2))
        items.append(toleration)
    return items


ENV = (
    [{"name": "A", "value": "1"}],
    [{"name": "A"}, {"name": "A", "value": "2"}],
    [{"name": "POD_NAME", "value": "x"}],
    [{"name": "FI_PROVIDER", "value": "efa"}],
    [{"name": "PYTHONHASHSEED", "value": "0"}],
)


@st.composite
def roles(draw: Draw, upstream: bool, hybrid: bool, efa_on: bool) -> dict[str, Any]:
    """One role; ``upstream`` (connector vllm), ``hybrid`` and ``efa_on`` steer the draws towards what the
    rules allow, leaving a chance of the neighbour that breaks them."""
    role: dict[str, Any] = {}
    put(role, "replicas", sometimes(draw, edge((0, 1, 2, 1024), (-1, 1025)), 3))
    put(role, "tensorParallelSize", sometimes(draw, edge((1, 2, 4, 8, 3, 6, 16, 64), (0, 65)), 6))
    put(role, "pipelineParallelSize", sometimes(draw, edge((1, 2, 4), (0, 65)), 4 if upstream else 1))
    put(role, "gpusPerNode", sometimes(draw, edge((8, 4, 2, 1, 3), (0, 65)), 2))
    put(role, "enablePrefixCaching", sometimes(draw, st.booleans(), 1 if hybrid else 3))
    # 256.0: an integer to the API server's schema (no rule reads this one), not to pdctl (BEYOND_CRD).
    put(role, "maxNumSeqs", sometimes(draw, edge((1, 65536, 256.0), (0, 65537)), 1))
    resources: dict[str, Any] = {}
    put(resources, "gpus", sometimes(draw, edge((0, 1, 2, 4, 8, 16, 64), (65, -1)), 2))
    put(
        resources,
        "memory",
        sometimes(draw, edge(("64Gi", "64Gi", "1Gi", "0"), ("lots",)), 8 if efa_on else 1),
    )
    put(resources, "cpu", sometimes(draw, one("8", "500m"), 1))
    put(role, "resources", resources or None)
    args = []
    if chance(draw, 2 if hybrid else 1):
        args.append(draw(one(*SPECULATIVE_ARGS)))
    if chance(draw, 1):
        args.append(draw(edge((*PLAIN_ARGS, *OPERATOR_ARGS), ("y" * 4097,))))
    put(role, "extraArgs", draw(st.permutations(args)) if args else None)
    put(role, "tolerations", sometimes(draw, tolerations(), 2))
    put(role, "env", sometimes(draw, edge(ENV, ([{"name": "1BAD"}],)), 1))
    return role


@st.composite
def ssm(draw: Draw) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    put(spec, "family", sometimes(draw, edge(("mamba2", "gdn", "mamba2", "mamba1"), ("rwkv",)), 9))
    put(spec, "convStateLayout", sometimes(draw, edge(("DS", "SD"), ("sd",)), 5))
    return spec


PATHS = ("models/qwen", "qwen", "..", "a/../b", "a/..b", "../a", "a/..", "...", "a/.", "..a", ".")


@st.composite
def model_source(draw: Draw) -> dict[str, Any]:
    pvc = {
        "claimName": draw(edge(("weights", "w"), ("Weights", "-w"))),
        "path": draw(edge(PATHS, ("/abs", ""))),
    }
    return draw(
        one(
            {"huggingFace": {}}, {"pvc": pvc}, {"pvc": pvc}, {"pvc": pvc}, {"huggingFace": {}, "pvc": pvc}, {}
        )
    )


@st.composite
def engine(draw: Draw, runtime: str | None, connector: str | None, efa_on: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    put(spec, "runtime", runtime)
    put(spec, "connector", connector)
    if runtime == "mock":
        backends = ("mock", "UCX") if chance(draw, 8) else ("LIBFABRIC",)
    else:
        backends = ("LIBFABRIC",) if efa_on else ("UCX", "LIBFABRIC", "UCX", "mock")
    backend = edge(backends, ("ucx",))
    put(spec, "transport", sometimes(draw, st.builds(dict, backend=backend), 9 if efa_on or runtime else 3))
    ports = edge((1024, 5600, 8000, 65535), (1023, 65536))
    put(spec, "port", sometimes(draw, ports, 1))
    put(spec, "sideChannelPort", sometimes(draw, ports, 1))
    engine_ids = edge(("prefill-0", "p", "a" * 128), ("a" * 129, "-p", "p 0"))
    put(spec, "prefillEngineId", sometimes(draw, engine_ids, 8 if connector == "vllm" else 1))
    return spec


@st.composite
def efa(draw: Draw, enabled: bool | None) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    put(spec, "enabled", enabled)
    devices = edge((1, 4, 64, 0) if enabled else (0, 0, 0, 1), (65,))
    put(spec, "prefillDevices", sometimes(draw, devices, 8))
    put(spec, "decodeDevices", sometimes(draw, devices, 8))
    put(spec, "privileged", sometimes(draw, st.booleans(), 4 if enabled else 1))
    # Whole 2Mi pages or not: the CRD checks the quantity syntax, pdctl also the page size.
    put(spec, "hugepages", sometimes(draw, edge(("0", "5Gi", "3Mi"), ("5G B",)), 2))
    return spec


@st.composite
def replica_range(draw: Draw) -> dict[str, Any]:
    bounds: dict[str, Any] = {}
    put(bounds, "minReplicas", sometimes(draw, edge((0, 1, 2, 1, 2, 5, 1024), (-1, 1025)), 6))
    put(bounds, "maxReplicas", sometimes(draw, edge((4, 8, 1024, 2, 1), (0, 1025)), 19))
    return bounds


@st.composite
def autoscaling(draw: Draw) -> dict[str, Any]:
    spec: dict[str, Any] = {"prefill": draw(replica_range()), "decode": draw(replica_range())}
    engine = sometimes(draw, edge(("builtin", "hpa", "keda"), ("vpa",)), 7)
    put(spec, "engine", engine)
    latency = engine != "hpa" or chance(draw, 1)
    targets: dict[str, Any] = {}
    put(targets, "ttftMilliseconds", sometimes(draw, edge((1000, 1, 3_600_000), (0, 3_600_001)), 8 * latency))
    put(targets, "tpotMilliseconds", sometimes(draw, edge((50, 60_000), (0, 60_001)), 8 * latency))
    put(targets, "waitingRequestsPerPrefill", sometimes(draw, edge((4, 65536), (0, 65537)), 5))
    put(targets, "runningRequestsPerDecode", sometimes(draw, edge((32, 1), (65537,)), 5))
    put(targets, "percentile", sometimes(draw, edge((50, 99), (49, 100)), 1))
    spec["targets"] = targets
    ratio = {"maxPercent": draw(edge((200, 50, 1, 102400), (0, 102401)))}
    put(ratio, "minPercent", sometimes(draw, edge((0, 50, 100, 300), (-1, 102401)), 6))
    put(spec, "prefillPerDecode", sometimes(draw, st.just(ratio), 3 if engine in (None, "builtin") else 1))
    windows = edge((0, 30, 300, 3600, 3601, 86400), (-1, 86401))
    put(spec, "scaleUpWindowSeconds", sometimes(draw, windows, 3))
    put(spec, "scaleDownWindowSeconds", sometimes(draw, windows, 3))
    address = edge(("http://prometheus.monitoring.svc:9090", "https://p"), ("ftp://p", ""))
    put(
        spec,
        "prometheus",
        sometimes(draw, st.builds(dict, serverAddress=address), 9 if engine == "keda" else 1),
    )
    return spec


SCRAPERS = (
    [{}],
    [{"namespaceLabels": {}}],
    [{"podLabels": {"app": "prometheus"}}],
    [{"namespaceLabels": {"team": "ml"}, "podLabels": {"a/b/c": "x"}}],
)


# Parts of a spec; each spec focuses on one (drawn freely) and mostly leaves the others out, so that a spec
# breaks a rule or two rather than many at once, and a fair share breaks none.
AREAS = ("model", "roles", "engine", "network", "router", "monitoring", "autoscaling", "kvCache")


@st.composite
def specs(draw: Draw) -> dict[str, Any]:
    """A PDService spec as a user writes it (wire names, defaults left out). The choices that most rules
    read (architecture, runtime, connector, EFA) come first and steer the rest towards valid values, with a
    chance of a neighbour across each rule's boundary."""
    focus = draw(one(*AREAS))

    def drawn(area: str, tenths: int) -> bool:
        return area == focus or chance(draw, tenths)

    architecture = sometimes(draw, edge(("dense", "hybrid-ssm", "mla"), ("moe",)), 7)
    hybrid = architecture == "hybrid-ssm"
    model: dict[str, Any] = {"name": draw(edge(("Qwen/Qwen3-32B", "m", "x" * 256), ("x" * 257, "")))}
    put(model, "architecture", architecture)
    if drawn("model", 1):
        put(model, "source", sometimes(draw, model_source(), 7))
        put(model, "maxModelLen", sometimes(draw, edge((16, 4096), (15,)), 3))
    spec: dict[str, Any] = {"model": model}
    # An ssm block mostly where the architecture asks for one, sometimes where it must not be.
    put(spec, "ssm", sometimes(draw, ssm(), 9 if hybrid else int(focus == "model")))
    put(spec, "mode", sometimes(draw, edge(("push", "pull"), ("PUSH",)), 6))
    runtime, connector, efa_on = None, None, None
    if drawn("engine", 3):
        runtime = sometimes(draw, edge(("vllm", "mock"), ("sglang",)), 5)
        connector = sometimes(draw, one("vllm", "builtin"), 1 if runtime == "mock" else 5)
    if drawn("network", 2):
        efa_on = sometimes(draw, st.booleans(), 1 if runtime == "mock" else 8)
    if drawn("roles", 3):
        for role in ("prefill", "decode"):
            put(spec, role, draw(roles(connector == "vllm", hybrid, bool(efa_on))) or None)
    put(spec, "engine", draw(engine(runtime, connector, bool(efa_on))) or None)
    if efa_on is not None or focus == "network":
        put(spec, "network", {"efa": draw(efa(efa_on))})
    if drawn("router", 2):
        router: dict[str, Any] = {}
        policies = edge(("least-loaded", "round-robin", "cache-aware"), ("random",))
        put(router, "policy", sometimes(draw, policies, 2 if hybrid else 7))
        put(router, "replicas", sometimes(draw, edge((0, 64), (65,)), 2))
        put(spec, "router", router or None)
    if drawn("monitoring", 0):
        put(spec, "monitoring", {"scrapers": draw(one(*SCRAPERS))})
    if drawn("autoscaling", 1):
        spec["autoscaling"] = draw(autoscaling())
    if drawn("kvCache", 1):
        # mostly with the pod memory the tier needs, sometimes without; sizes across the least one
        memory = edge(("64Gi", "1Mi", "3Mi", "4096Mi"), ("0", "lots", "-1Gi"))
        tiered = draw(one(("decode",), ("prefill",), ("prefill", "decode")))
        put(spec, "kvCache", {"offload": {role: {"hostMemory": draw(memory)} for role in tiered}})
        for role in tiered:
            if chance(draw, 8):
                spec.setdefault(role, {}).setdefault("resources", {})["memory"] = "96Gi"
    return spec


NAMES = edge(("svc", "a" * 44), ("a" * 45, "Svc", "1svc", "svc-", "s.v"))
