"""The Helm chart: lints clean (strict), renders objects Kubernetes 1.29-1.33 accept, and wires what the
operator expects (its settings, its Service, its webhook configuration, least-privilege RBAC).

Rendered and linted with helm-python-sdk (Helm's Go SDK in a wheel); no cluster is contacted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from modelload.operator._install import render_chart
from modelload.operator.settings import OPTIONS, from_args

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "modelload"
VERSIONS = ["1.29", "1.30", "1.31", "1.32", "1.33"]
NAMESPACE = "modelload-system"
CERT_MANAGER_KINDS = {"Issuer", "Certificate"}

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "cert-manager": {"webhook": {"certManager": {"enabled": True}}},
    "cert-manager-issuer": {
        "webhook": {
            "certManager": {"enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}
        }
    },
    "namespaced": {"watchNamespaces": ["serving", "research"]},
    "ha": {"replicaCount": 2, "sidecar": {"mode": "native"}, "logLevel": "DEBUG"},
    "custom": {
        "fullnameOverride": "ml",
        "image": {"repository": "mirror.local/modelload-operator", "tag": "dev", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "mirror"}],
        "sidecar": {"image": {"repository": "mirror.local/sidecar", "tag": "dev"}, "workingSetMemory": "1Gi"},
        "webhook": {"failurePolicy": "Ignore", "timeoutSeconds": 5, "namespaceSelector": {}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"prometheus.io/scrape": "false"},
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    return render_chart(ROOT, values, namespace=NAMESPACE)


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name}"
    return found[0]


@pytest.mark.parametrize("kube_version", [f"v{v}.0" for v in VERSIONS])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_chart_lints_clean_with_strict_linting(variant: str, kube_version: str) -> None:
    report = helm.lint(
        str(CHART), VARIANTS[variant], strict=True, kube_version=kube_version, namespace=NAMESPACE
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 1] == []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_rendered_object_validates_against_kubernetes(variant: str, version: str) -> None:
    docs = render(VARIANTS[variant])
    assert docs
    for doc in docs:
        if doc["kind"] in CERT_MANAGER_KINDS:
            assert doc["apiVersion"] == "cert-manager.io/v1"  # a CRD's kind: no Kubernetes schema to check
            continue
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_crd_ships_in_the_charts_crds_folder() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        (crd,) = chart.crds
    assert yaml.safe_load(crd["data"])["metadata"]["name"] == "modelloads.modelload.dev"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicaCount": 0}, "replicaCount"),
        ({"sidecar": {"mode": "sometimes"}}, "mode"),
        ({"webhook": {"timeoutSeconds": 31}}, "timeoutSeconds"),
        ({"webhook": {"failurePolicy": "Maybe"}}, "failurePolicy"),
        ({"watchNamespaces": ["Not_A_Namespace"]}, "watchNamespaces"),
        ({"resources": {"limits": {"memory": "lots"}}}, "memory"),
        ({"replicas": 2}, "replicas"),
        ({"sourceNetworks": ["the cluster"]}, "sourceNetworks"),
    ],
)
def test_the_values_schema_refuses_bad_values(values: dict[str, Any], message: str) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError, match=message):
        chart.validate_schema(values)


def test_the_deployment_runs_hardened() -> None:
    deployment = one(render({}), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]["memory"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def _rules(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{d['kind']}/{d['metadata']['name']}", rule)
        for d in docs
        if d["kind"] in ("ClusterRole", "Role")
        for rule in d["rules"]
    ]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rbac_has_no_wildcards_and_only_the_verbs_the_operator_uses(variant: str) -> None:
    allowed = {
        ("modelload.dev", "modelloads"): {"get", "list", "watch", "patch"},
        ("modelload.dev", "modelloads/status"): {"get", "patch"},
        ("", "pods"): {"list", "watch"},
        ("", "secrets"): {"get", "patch", "create"},
        ("", "services"): {"create", "get", "patch"},  # the peers' Service, its selector kept current
        ("", "events"): {"create"},
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"): {"get", "patch"},
    }
    rules = _rules(render(VARIANTS[variant]))
    assert rules
    for where, rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], where
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= allowed[group, resource], (where, group, resource, rule["verbs"])


def test_secrets_can_be_written_only_by_name_in_the_operators_namespace() -> None:
    docs = render({})
    for where, rule in _rules(docs):
        if "secrets" in rule["resources"] and set(rule["verbs"]) & {"patch", "update"}:
            assert where.startswith("Role/")
            assert rule["resourceNames"] == ["modelload-webhook-tls"]
        if "mutatingwebhookconfigurations" in rule["resources"]:
            assert rule["resourceNames"] == ["modelload"]
    roles = [d for d in docs if d["kind"] == "Role"]
    assert all(r["metadata"]["namespace"] == NAMESPACE for r in roles)


def test_watching_namespaces_grants_roles_there_and_limits_the_webhook_to_them() -> None:
    docs = render(VARIANTS["namespaced"])
    workload_roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "modelload"]
    assert sorted(r["metadata"]["namespace"] for r in workload_roles) == ["research", "serving"]
    assert not [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "modelload"]
    (hook,) = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["serving", "research"]}
    ]


def test_the_webhook_configuration_calls_the_service_for_opted_in_pods_only() -> None:
    docs = render({})
    (hook,) = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    service = one(docs, "Service")
    config = hook["clientConfig"]
    assert "url" not in config
    assert config["service"] == {
        "name": service["metadata"]["name"],
        "namespace": NAMESPACE,
        "path": "/mutate-pods",
        "port": service["spec"]["ports"][0]["port"],
    }
    assert hook["objectSelector"] == {
        "matchExpressions": [{"key": "modelload.dev/model", "operator": "Exists"}]
    }
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["reinvocationPolicy"]) == (
        "Fail",
        "None",
        "IfNeeded",
    )
    assert hook["timeoutSeconds"] == 10
    assert hook["admissionReviewVersions"] == ["v1"]
    assert "kube-system" in hook["namespaceSelector"]["matchExpressions"][0]["values"]


def _env(docs: list[dict[str, Any]]) -> dict[str, str]:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for item in container["env"]:
        if "valueFrom" in item:
            assert item["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
            env[item["name"]] = NAMESPACE  # what the kubelet fills in
        else:
            env[item["name"]] = item["value"]
    return env


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_deployment_configures_the_operator_through_settings_it_knows(variant: str) -> None:
    docs = render(VARIANTS[variant])
    env = _env(docs)
    known = {option.env for option in OPTIONS}
    assert set(env) <= known, set(env) - known
    settings = from_args(None, env)  # parses without a ConfigError
    service = next(d for d in docs if d["kind"] == "Service")
    mwc = one(docs, "MutatingWebhookConfiguration")
    assert settings.namespace == NAMESPACE
    assert settings.webhook.service == service["metadata"]["name"]
    assert settings.webhook.configuration == mwc["metadata"]["name"]
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["webhook"] == settings.webhook.port
    assert ports["health"] == settings.liveness_port
    assert settings.webhook.tls == ("files" if "cert-manager" in variant else "self-signed")
    assert settings.sidecar.image.startswith(
        "mirror.local/sidecar:" if variant == "custom" else "ghcr.io/modelload/sidecar:"
    )


def test_source_networks_reach_the_operator_and_default_to_none() -> None:
    import ipaddress

    assert from_args(None, _env(render({}))).source_networks == ()
    env = _env(render({"sourceNetworks": ["10.96.0.0/12", "fd00::/8"]}))
    assert from_args(None, env).source_networks == (
        ipaddress.ip_network("10.96.0.0/12"),
        ipaddress.ip_network("fd00::/8"),
    )


def test_cert_manager_mode_mounts_its_secret_and_injects_the_ca() -> None:
    docs = render(VARIANTS["cert-manager"])
    certificate = one(docs, "Certificate", "modelload-webhook")
    mwc = one(docs, "MutatingWebhookConfiguration")
    assert (
        mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/modelload-webhook"
    )
    assert "modelload-webhook.modelload-system.svc" in certificate["spec"]["dnsNames"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (tls,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["secretName"] == certificate["spec"]["secretName"]
    env = _env(docs)
    assert env["MODELLOAD_OPERATOR_CERT_DIR"] in [
        m["mountPath"] for m in pod["containers"][0]["volumeMounts"]
    ]
    assert not [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-webhook")]
    issuer = one(render(VARIANTS["cert-manager-issuer"]), "Certificate")["spec"]["issuerRef"]
    assert issuer == {"name": "corp-ca", "kind": "ClusterIssuer"}


def test_two_replicas_by_default_with_a_disruption_budget_and_a_spread_over_nodes() -> None:
    docs = render({})
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    budget = one(docs, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (spread,) = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # one node must not stop a test cluster
    assert spread["labelSelector"]["matchLabels"].items() <= pod_labels.items()


def test_one_replica_gets_no_budget_that_would_block_every_drain() -> None:
    docs = render({"replicaCount": 1})
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert "topologySpreadConstraints" not in one(docs, "Deployment")["spec"]["template"]["spec"]
    zones = [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    ]
    custom = one(render({"topologySpreadConstraints": zones}), "Deployment")["spec"]["template"]["spec"]
    assert custom["topologySpreadConstraints"] == zones


def test_replicas_share_the_tls_secret_and_may_renew_it() -> None:
    """Two replicas must serve certificates of one CA: the self-signed mode keeps it in one Secret that
    every replica reads, and may patch (renewal while running)."""
    docs = render({})
    env = _env(docs)
    rules = [
        rule
        for d in docs
        if d["kind"] == "Role" and d["metadata"]["namespace"] == NAMESPACE
        for rule in d["rules"]
        if "secrets" in rule.get("resources", [])
    ]
    secret = env["MODELLOAD_OPERATOR_TLS_SECRET"]
    assert any(secret in r.get("resourceNames", []) and {"get", "patch"} <= set(r["verbs"]) for r in rules)


def test_the_plain_install_manifest_is_the_rendered_chart_and_validates() -> None:
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "install.yaml").read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds[:2] == ["Namespace", "CustomResourceDefinition"]
    assert kinds[-1] == "MutatingWebhookConfiguration"  # last: nothing may call it before its Service exists
    assert docs[2:] == render({})
    for doc in docs:
        for version in ("1.29", "1.33"):
            kubernetes_validate.validate(doc, version, strict=True)
