"""deploy/kuberay/ validated offline (no Kubernetes cluster runs here): each pod template of the RayCluster against
the Kubernetes API schema (strict), the RayCluster's own fields against KubeRay's ray.io/v1 API, and the wiring
(a Docker engine per Ray pod, TMPDIR shared with it, the sandbox limit every group declares, the Ray version
nbexec pins, who may reach the cluster)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import nbexec
from nbexec.sandbox.ray import source as raysource

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kuberay"
VERSION = "1.30.0"  # native sidecars need 1.29+
# The fields of KubeRay's ray.io/v1 RayCluster this deployment may use (its API reference).
SPEC = {"rayVersion", "headGroupSpec", "workerGroupSpecs", "enableInTreeAutoscaling", "autoscalerOptions", "suspend"}
HEAD = {"rayStartParams", "template", "serviceType", "enableIngress", "headService"}
WORKERS = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template", "scaleStrategy",
           "numOfHosts", "suspend", "idleTimeoutSeconds"}


def _documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / "raycluster.yaml").read_text()) if doc]


def _cluster() -> dict[str, Any]:
    return next(doc for doc in _documents() if doc["kind"] == "RayCluster")


def _groups() -> list[tuple[str, dict[str, Any]]]:
    spec = _cluster()["spec"]
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}


@pytest.mark.parametrize("group", [name for name, _ in _groups()])
def test_each_pod_template_is_valid_kubernetes(group: str) -> None:
    template = dict(_groups())[group]["template"]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"nbexec-{group}"},
                                  "template": template}, VERSION, strict=True)


def test_the_raycluster_uses_only_kuberays_fields_and_nbexecs_ray() -> None:
    cluster = _cluster()
    assert cluster["apiVersion"] == "ray.io/v1"
    assert set(cluster["spec"]) <= SPEC
    assert set(cluster["spec"]["headGroupSpec"]) <= HEAD
    assert all(set(group) <= WORKERS for group in cluster["spec"]["workerGroupSpecs"])
    pinned = re.search(r'ray = \["ray==([\d.]+)"\]', (ROOT / "pyproject.toml").read_text())
    assert pinned and cluster["spec"]["rayVersion"] == pinned[1]  # the Ray of nbexec-sandbox[ray]
    for name, group in _groups()[1:]:
        assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name


@pytest.mark.parametrize("group", [name for name, _ in _groups()])
def test_every_ray_pod_declares_its_sandbox_limit_and_runs_its_own_engine(group: str) -> None:
    spec = dict(_groups())[group]
    params = spec["rayStartParams"]
    assert all(isinstance(v, str) for v in params.values())  # KubeRay passes them to `ray start` as text
    resources = json.loads(json.loads(params["resources"]))  # quoted once more for the shell KubeRay runs
    limit = raysource.node_limit({"Resources": {k: float(v) for k, v in resources.items()}})
    assert resources[raysource.LIMIT_RESOURCE] == limit >= 1
    pod = spec["template"]["spec"]
    ray, engine = pod["containers"][0], pod["initContainers"][0]  # KubeRay starts Ray in the first container
    assert ray["image"] == "nbexec-service" and engine["image"].startswith("docker:")
    assert engine["restartPolicy"] == "Always" and engine["securityContext"] == {"privileged": True}
    assert _env(ray)["DOCKER_HOST"] == "unix:///run/dind/docker.sock"
    assert {"name": "dind-socket", "mountPath": "/run/dind"} in engine["volumeMounts"]
    tmp = _env(ray)["TMPDIR"]
    shared = {m["name"] for m in ray["volumeMounts"] if m["mountPath"] == tmp}
    assert shared and shared == {m["name"] for m in engine["volumeMounts"] if m["mountPath"] == tmp}  # same path
    assert all(not c.get("securityContext", {}).get("privileged") for c in pod["containers"])
    assert ray["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["automountServiceAccountToken"] is False


def _gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(Gi|Mi)", quantity).groups()  # type: ignore[union-attr]
    return float(number) / (1024 if unit == "Mi" else 1)


@pytest.mark.parametrize("group", [name for name, _ in _groups()])
def test_every_ray_pod_is_sized_for_its_sandbox_limit(group: str) -> None:
    """The sandboxes are charged to the docker sidecar's cgroup, and /mnt/data (the unprivileged fallback) to the
    work folder: both hold the group's limit of sandboxes of the default config, so one cannot get another
    OOM-killed or the pod evicted."""
    spec = dict(_groups())[group]
    limit = json.loads(json.loads(spec["rayStartParams"]["resources"]))[raysource.LIMIT_RESOURCE]
    defaults = nbexec.SandboxConfig()
    memory, data = _gib(defaults.memory.replace("g", "Gi")), _gib(defaults.max_data.replace("g", "Gi"))
    pod = spec["template"]["spec"]
    engine = pod["initContainers"][0]["resources"]
    assert _gib(engine["limits"]["memory"]) >= limit * memory + 1, engine
    assert engine["requests"]["memory"] == engine["limits"]["memory"]  # placed where it fits
    work = next(v for v in pod["volumes"] if v["name"] == "work")
    assert _gib(work["emptyDir"]["sizeLimit"]) >= limit * 2 * data, work


def test_only_the_clusters_pods_and_labelled_trainers_reach_it() -> None:
    policy = next(doc for doc in _documents() if doc["kind"] == "NetworkPolicy")
    kubernetes_validate.validate(policy, VERSION, strict=True)
    pods = {name: group["template"]["metadata"]["labels"] for name, group in _groups()}
    assert all(policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items() for labels in pods.values())
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    allowed = [source["podSelector"]["matchLabels"] for source in rule["from"]]
    assert set(rule) == {"from"} and all(set(source) == {"podSelector"} for source in rule["from"])
    assert allowed == [policy["spec"]["podSelector"]["matchLabels"], {"nbexec.io/ray-client": "true"}]


def test_the_kustomization_lists_the_cluster_and_the_image_has_the_ray_extra() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["raycluster.yaml"]
    assert "ARG EXTRAS=" in (ROOT / "deploy" / "Dockerfile").read_text()
    assert '"/src[${EXTRAS}]"' in (ROOT / "deploy" / "Dockerfile").read_text()
