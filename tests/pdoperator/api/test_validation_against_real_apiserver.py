"""Differential test: the real API server (with the committed CRD) and ``pdctl validate`` judge PDService
specs alike.

Hypothesis builds specs around every rule's inputs (``spec_strategies``); each one is created with
``dryRun=All`` on the real CRD-serving API server (``tests/k8s/real_server.py``) and parsed by
``parse_pdservice``, what ``pdctl validate`` runs. For everything the CRD expresses (schema bounds, enums,
patterns, list-map keys and the CEL rules) both must accept or reject together, report the same field paths,
and the server's message for a CEL rule must carry the rule's own message (which says what to do).

pdctl checks more than the CRD says; ``BEYOND_CRD`` lists those checks by their message, and only they may
make pdctl reject a spec the server accepts.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from pdoperator.api import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    PDServiceSpec,
    SpecError,
    parse_pdservice,
)
from pdoperator.api.cel import CelRule
from pdoperator.api.errors import FieldError
from pdoperator.api.parse import spec_field_errors
from pdoperator.api.rules import CEL_RULES
from pdoperator.api.validation import cel_rule_violations
from pydantic import ValidationError

from tests.k8s.real_server import RealApiServer
from tests.pdoperator.api.spec_strategies import NAMES, specs
from tests.pdoperator.api.test_cel_rules import RULE_SAMPLES

REPO = Path(__file__).resolve().parents[3]
CRD_FILE = REPO / "crds" / f"{PLURAL}.{GROUP}.yaml"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
NAMESPACE = "validation-differential"
COLLECTION = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
EXAMPLES = 800

# What pdctl checks beyond the CRD, by the message of the check in pdoperator.api.validation; a spec the
# server accepts may fail only these. Why each stays out of the CRD:
BEYOND_CRD: dict[str, re.Pattern[str]] = {
    # The flags the operator sets depend on the runtime and routing policy and come as free-form strings in
    # any of vLLM's spellings (--flag, --flag=value, --flag.key=value, underscores): a long CEL table to
    # keep in step with vLLM; the operator owns the list (MANAGED_FLAGS, UNSUPPORTED_FLAGS).
    "flag set by the operator": re.compile(r"^--?[-\w]+ is set by the operator; "),
    "unsupported flag": re.compile(r"^--?[-\w]+ is not supported: "),
    # Same for the environment variables the operator sets (some only with EFA on).
    "env set by the operator": re.compile(r"^\w+ is set by the operator; "),
    # Label key and value syntax of nodeSelector and scraper selectors (core/v1's own validation, which a
    # CRD does not reuse).
    "label syntax": re.compile(r"^(key must be a label key|value must be a label value): "),
    # Quantity arithmetic: positive, shmSize within memory, whole 2Mi pages, a cpu or memory request beside
    # hugepages (what the kubelet and core/v1 would refuse later, on the pods).
    "positive quantity": re.compile(r"^must be a positive Kubernetes quantity such as "),
    "shm within memory": re.compile(r"^must not exceed spec\.\w+\.resources\.memory "),
    "hugepage size": re.compile(r"^must be a whole number of 2Mi pages such as 5Gi"),
    # A tier's least size depends on the ranks of a decode pod (tensor x pipeline parallel over its nodes).
    "tier size": re.compile(r"^must be a Kubernetes quantity of at least \d+Mi \(1Mi for each of the "),
    "hugepages need a request": re.compile(
        r"^must set cpu or memory when spec\.network\.efa requests hugepages"
    ),
    # Whether the replica bounds and the ratio range admit any pair is a search (pdoperator.autoscale).
    "autoscaling admits no replicas": re.compile(
        r"^no prefill replicas in \[\d+, \d+\] and decode replicas in "
    ),
    # PYTHONHASHSEED of both roles under cache-aware routing: env is a list-map, CEL could compare it but
    # the rule compares an absent and a present variable, which the operator's renderer resolves.
    "hash seed": re.compile(r"^PYTHONHASHSEED must equal spec\.prefill's "),
    # A number like 2.0 where an integer belongs: the server's schema takes it (an integral JSON number), and
    # then a CEL rule reading the field fails with "invalid data, expected int, got float64 evaluating rule";
    # pdctl refuses it on every field alike, which no schema keyword can say.
    "integral float": re.compile(r"^must be an integer \(got -?\d+\.0\)$"),
}

RULES_SKIPPED = "some validation rules were not checked because the object was invalid"
# How the server words a failed CEL rule of each reason (the cause's message starts with it).
REASON_WORDS = {
    "FieldValueInvalid": "Invalid value: ",
    "FieldValueForbidden": "Forbidden: ",
    "FieldValueRequired": "Required value: ",
}


def _established(crd: dict[str, Any] | None) -> bool:
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


@pytest.fixture(scope="module")
def server(real_apiserver: RealApiServer) -> Iterator[RealApiServer]:
    """The session's real API server with the committed PDService CRD installed and established."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    status, body, _ = real_apiserver.request("POST", CRDS, crd)
    # Another module may have installed the same file first.
    assert status in (201, 409), body
    deadline = time.monotonic() + 30
    while not _established(real_apiserver.request("GET", f"{CRDS}/{crd['metadata']['name']}")[1]):
        assert time.monotonic() < deadline, "the PDService CRD was not established in 30 s"
        time.sleep(0.1)
    # Discovery of a new group lags its Established condition by a moment; wait until creates are served.
    while real_apiserver.request("GET", COLLECTION)[0] != 200:
        assert time.monotonic() < deadline, "the PDService collection is not served"
        time.sleep(0.1)
    yield real_apiserver


def document(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


def server_causes(server: RealApiServer, obj: dict[str, Any]) -> tuple[bool, list[dict[str, str]], str]:
    """(accepted, causes, message) of a dry-run create; Strict field validation, as kubectl asks for."""
    status, body, _ = server.request(
        "POST", COLLECTION, obj, params={"dryRun": "All", "fieldValidation": "Strict"}
    )
    if status == 201:
        return True, [], ""
    assert status == 422, f"unexpected answer {status}: {body}"
    # After an enum or type error the server skips the CEL rules, as pdctl does, and says so in a cause of
    # its own that names no field.
    causes = [cause for cause in body["details"]["causes"] if RULES_SKIPPED not in cause["message"]]
    return False, causes, body["message"]


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(child) for key, child in value.items() if child is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def our_verdict(name: str, spec: dict[str, Any]) -> tuple[list[FieldError], set[tuple[str, CelRule]], bool]:
    """(every pdctl error, the CEL rules broken with their paths, whether the spec parsed at all)."""
    try:
        parse_pdservice(document(name, spec))
        errors: list[FieldError] = []
    except SpecError as error:
        errors = error.errors
    try:
        parsed = PDServiceSpec.model_validate_json(json.dumps(_without_nulls(spec)), strict=True)
    except ValidationError as error:
        # pdctl reports the structural problems and stops there: no model, no rules.
        assert set(spec_field_errors(error)) <= set(errors)
        return errors, set(), False
    return errors, set(cel_rule_violations(parsed)), True


def beyond_crd(error: FieldError) -> str | None:
    """Which of the BEYOND_CRD checks ``error`` comes from, if any."""
    for kind, pattern in BEYOND_CRD.items():
        if pattern.search(error.message):
            return kind
    return None


def compare(server: RealApiServer, name: str, spec: dict[str, Any], tally: Counter[str]) -> None:
    accepted, causes, message = server_causes(server, document(name, spec))
    errors, broken, parsed = our_verdict(name, spec)
    rule_errors = {FieldError(path, rule.message) for path, rule in broken}
    beyond = {error: kind for error in errors if error not in rule_errors and (kind := beyond_crd(error))}
    expressed = [error for error in errors if error not in beyond]
    verdict = "accepted" if accepted else json.dumps(causes)
    where = f"spec {json.dumps(spec)} named {name!r}: server {verdict}; pdctl {[str(e) for e in errors]}"
    tally["specs"] += 1
    tally["server accepted" if accepted else "server rejected"] += 1
    tally.update(f"beyond the CRD: {kind}" for kind in set(beyond.values()))
    tally.update(f"rule: {rule.name}" for _, rule in broken)

    server_paths = {cause["field"] for cause in causes}
    our_paths = {error.path for error in expressed}
    rule_messages = [rule.message for rule in CEL_RULES]

    def found_later(cause: dict[str, Any]) -> bool:
        """A cause pdctl never reaches when it stops at the structural errors: the server goes on to the CEL
        rules (after a bound, not after an enum) and the list-map keys on what it could read, which pdctl
        checks on the parsed model."""
        return not parsed and (
            cause["reason"] == "FieldValueDuplicate" or any(m in cause["message"] for m in rule_messages)
        )

    if parsed or expressed:
        assert accepted == (not expressed), where
    else:
        # Only checks beyond the CRD stopped pdctl before its rules (a float where an integer belongs): the
        # server judges by the rest, and refuses by rules pdctl did not reach, if at all.
        assert all(found_later(cause) for cause in causes), where
    spec_checked = any(not path.startswith("metadata.") for path in server_paths)
    if any(path.startswith("metadata.") for path in server_paths):
        # A name too long ends the server's validation before the spec; a name breaking the CRD's pattern does
        # not. pdctl goes on past either and reports both.
        assert all(c["field"] in our_paths or found_later(c) for c in causes), where
    elif parsed:
        assert server_paths == our_paths, where
    else:
        assert our_paths <= server_paths, where
        assert all(c["field"] in our_paths or found_later(c) for c in causes), where
    if not accepted and not spec_checked:
        return  # the server never read the spec, so it names none of the rules pdctl found broken
    # A broken rule: the server names its field, with the rule's reason and the rule's own words (the fix).
    for path, rule in broken:
        matching = [c for c in causes if c["field"] == path and rule.message in c["message"]]
        assert matching, f"{rule.name} at {path}: {where}"
        assert all(c["reason"] == rule.reason.value for c in matching), f"{rule.name}: {matching}"
        assert all(c["message"].startswith(REASON_WORDS[rule.reason.value]) for c in matching), where
        assert f"{path}: " in message, where


def test_server_and_pdctl_agree_on_generated_specs(server: RealApiServer) -> None:
    tally: Counter[str] = Counter()
    started = time.monotonic()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(name=NAMES, spec=specs())
    def check(name: str, spec: dict[str, Any]) -> None:
        compare(server, name, spec, tally)

    check()
    elapsed = time.monotonic() - started
    accepted, rejected = tally["server accepted"], tally["server rejected"]
    print(f"\n{tally['specs']} specs in {elapsed:.1f} s: {accepted} accepted, {rejected} rejected")
    for key, count in sorted(tally.items()):
        if key.startswith(("rule: ", "beyond")):
            print(f"  {count:4d}  {key}")
    assert tally["specs"] >= EXAMPLES
    # Neither verdict may dominate so far that the comparison says little about the other.
    assert accepted >= EXAMPLES // 5 and rejected >= EXAMPLES // 5, tally
    # The generated specs reach nearly every CEL rule; the samples below cover each one on both sides.
    reached = {key.removeprefix("rule: ") for key in tally}
    assert len(reached & {rule.name for rule in CEL_RULES}) >= 0.8 * len(CEL_RULES), tally


@pytest.mark.parametrize("rule", sorted(RULE_SAMPLES))
def test_server_and_pdctl_agree_on_both_sides_of_every_rule(server: RealApiServer, rule: str) -> None:
    """Each rule's pair of neighbouring specs (``test_cel_rules.RULE_SAMPLES``): the first is accepted by
    both, the second rejected by both, at the same field, with the rule's message."""
    good, bad = RULE_SAMPLES[rule]
    tally: Counter[str] = Counter()
    compare(server, "svc", good, tally)
    compare(server, "svc", bad, tally)
    assert tally["server accepted"] == 1 and tally[f"rule: {rule}"] == 1, tally
