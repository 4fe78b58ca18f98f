"""deploy/kubernetes/ validated offline: every manifest against the Kubernetes API schema (strict, no unknown
fields), and the wiring between them (probes on real routes, tokens from the Secret, routers list every node,
only routers reach nodes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
VERSION = "1.30.0"  # native sidecars (init containers with restartPolicy: Always) need 1.29+


def _documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def _kind(kind: str, name: str) -> dict[str, Any]:
    return next(doc for _, doc in _documents() if doc["kind"] == kind and doc["metadata"]["name"] == name)


@pytest.mark.parametrize(("name", "doc"), _documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_is_valid_kubernetes(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_kustomization_lists_every_manifest_but_the_secret_example() -> None:
    listed = set(yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}


def test_nodes_and_routers_are_wired_together() -> None:
    nodes = _kind("StatefulSet", "nbexec-node")
    service = _kind("Service", nodes["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # headless: one address per node
    agent = nodes["spec"]["template"]["spec"]["containers"][0]
    assert _env(agent)["NBEXEC_NODE_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert _env(agent)["NBEXEC_API_TOKENS"]["secretKeyRef"] == {"name": "nbexec-tokens", "key": "node-token"}
    assert agent["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert agent["resources"]["requests"] and agent["resources"]["limits"]
    sidecar = nodes["spec"]["template"]["spec"]["initContainers"][0]
    assert sidecar["restartPolicy"] == "Always" and _env(agent)["DOCKER_HOST"] == "unix:///run/dind/docker.sock"

    router = _kind("Deployment", "nbexec-router")["spec"]["template"]["spec"]["containers"][0]
    entries = router["args"][router["args"].index("--nodes") + 1].split(",")
    expected = [f"nbexec-node-{i}=http://nbexec-node-{i}.{service['metadata']['name']}:8080"
                for i in range(nodes["spec"]["replicas"])]
    assert entries == expected  # named as the pods name themselves (NBEXEC_NODE_NAME), by the configuration
    assert _env(router)["NBEXEC_NODE_TOKEN"]["secretKeyRef"]["key"] == "node-token"
    assert _env(router)["NBEXEC_API_TOKENS"]["secretKeyRef"]["key"] == "api-tokens"
    assert {router["readinessProbe"]["httpGet"]["path"], router["livenessProbe"]["httpGet"]["path"]} == \
        {"/readyz", "/healthz"}


def test_only_routers_reach_nodes() -> None:
    policy = _kind("NetworkPolicy", "nbexec-nodes-from-routers")["spec"]
    node_labels = _kind("StatefulSet", "nbexec-node")["spec"]["template"]["metadata"]["labels"]
    router_labels = _kind("Deployment", "nbexec-router")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= node_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= router_labels.items()
    assert not source["podSelector"]["matchLabels"].items() <= node_labels.items()


def test_disruption_budgets_cover_nodes_and_routers() -> None:
    assert _kind("PodDisruptionBudget", "nbexec-node")["spec"]["maxUnavailable"] == 1
    assert _kind("PodDisruptionBudget", "nbexec-router")["spec"]["minAvailable"] == 1
