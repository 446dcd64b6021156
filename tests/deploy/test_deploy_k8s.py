"""Structural checks of the Kubernetes manifests and the KEDA scaler against the code."""

from __future__ import annotations

from typing import Any

from scheduler.protocol.lanes import LANES
from tests.harness.deploy_files import K8S, REPO, k8s_documents, k8s_objects, parse_verb, verb_env_names

NAMESPACE = "carpool"
DEPLOYMENT_VERBS = {"carpool-gateway": "gateway", "carpool-worker": "worker", "carpool-webhooks": "webhooks"}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def container_env(deployment: dict[str, Any], secret_values: dict[str, str]) -> dict[str, str]:
    """The environment a container would see: its ConfigMaps, then its own `env` entries."""
    config_maps = k8s_objects("ConfigMap")
    c = container(deployment)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]]["data"])
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secret_values[ref["key"]]
    return env


def example_secret() -> dict[str, str]:
    (secret,) = [doc for path, doc in k8s_documents() if path.name == "secret.example.yaml"]
    values = dict(secret["stringData"])
    values["CARPOOL_WEBHOOK_SECRET"] = "whsec_Y2FycG9vbC1leGFtcGxlLXdlYmhvb2stc2VjcmV0ISE="
    return values


def test_every_manifest_is_well_formed_and_applied() -> None:
    docs = list(k8s_documents())
    assert len(docs) >= 12
    for path, doc in docs:
        assert {"apiVersion", "kind"} <= set(doc), path
        if doc["kind"] == "Kustomization":
            continue
        assert doc["metadata"]["name"], path
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{path}: {doc['metadata']['name']}"
    (kustomization,) = [doc for _, doc in docs if doc["kind"] == "Kustomization"]
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    assert "secret.example.yaml" not in kustomization["resources"], "the example Secret must not be applied"
    applied = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert applied == set(kustomization["resources"])
    assert {i["name"] for i in kustomization["images"]} == {"carpool-gateway", "carpool-worker"}


def test_references_between_objects_resolve() -> None:
    config_maps = k8s_objects("ConfigMap")
    secret_keys = set(example_secret())
    services = k8s_objects("Service")
    pvcs = k8s_objects("PersistentVolumeClaim")
    workloads = {**k8s_objects("Deployment"), **k8s_objects("StatefulSet")}
    assert set(workloads) == {*DEPLOYMENT_VERBS, "carpool-redis"}
    for name, workload in workloads.items():
        pod = workload["spec"]["template"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(), name
        for c in pod["spec"]["containers"]:
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, name
            for item in c.get("env", []):
                if "valueFrom" in item:
                    ref = item["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == "carpool-secrets" and ref["key"] in secret_keys, (name, ref)
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            volumes = {v["name"] for v in pod["spec"].get("volumes", [])}
            claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
            assert mounts <= volumes | claims, name
        for volume in pod["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in pvcs
    for name, service in services.items():
        (target,) = [w for w in workloads.values()
                     if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        port_names = {p["name"] for p in container(target)["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, name


def test_carpool_variables_are_flags_of_the_verb_and_parse() -> None:
    deployments = k8s_objects("Deployment")
    secrets = example_secret()
    for name, verb in DEPLOYMENT_VERBS.items():
        deployment = deployments[name]
        assert container(deployment)["args"] == [verb]
        env = container_env(deployment, secrets)
        carpool_vars = {k for k in env if k.startswith("CARPOOL_")}
        unknown = carpool_vars - verb_env_names(verb)
        assert not unknown, f"{name}: {sorted(unknown)} are not flags of `carpool {verb}`"
        parse_verb(verb, env)
    gateway = parse_verb("gateway", container_env(deployments["carpool-gateway"], secrets))
    assert (gateway.host, gateway.port, gateway.no_webhooks) == ("0.0.0.0", 8000, True)
    assert gateway.redis_url == "redis://:CHANGE-ME@carpool-redis:6379/0"


def test_probes_and_ports_match_the_flags() -> None:
    deployments = k8s_objects("Deployment")
    secrets = example_secret()
    gateway_args = parse_verb("gateway", container_env(deployments["carpool-gateway"], secrets))
    worker_args = parse_verb("worker", container_env(deployments["carpool-worker"], secrets))
    for name, port in (("carpool-gateway", gateway_args.port), ("carpool-worker", worker_args.metrics_port)):
        c = container(deployments[name])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        annotations = deployments[name]["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == port
        # A gateway stays ready while Redis is down, to answer 503 with Retry-After; a worker is ready
        # once its model is loaded and it reads the lanes.
        assert c["readinessProbe"]["httpGet"]["path"] == ("/healthz" if name == "carpool-gateway" else "/readyz")
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert ports[c["readinessProbe"]["httpGet"]["port"]] == port, name
    webhooks_args = parse_verb("webhooks", container_env(deployments["carpool-webhooks"], secrets))
    c = container(deployments["carpool-webhooks"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert webhooks_args.metrics_port == 9465 and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert ports[c["livenessProbe"]["httpGet"]["port"]] == webhooks_args.metrics_port
    annotations = deployments["carpool-webhooks"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == webhooks_args.metrics_port
    assert worker_args.device == "cuda" and worker_args.model == "/models/my-model"
    worker_pod = deployments["carpool-worker"]["spec"]["template"]["spec"]
    assert worker_pod["terminationGracePeriodSeconds"] > worker_args.shutdown_grace_s
    assert container(deployments["carpool-worker"])["resources"]["limits"]["nvidia.com/gpu"] == 1
    (redis_service,) = k8s_objects("Service")["carpool-redis"]["spec"]["ports"]
    assert gateway_args.redis_url.endswith(f"@carpool-redis:{redis_service['port']}/0")


def test_the_gateway_serves_on_while_its_endpoint_is_withdrawn() -> None:
    gateway = k8s_objects("Deployment")["carpool-gateway"]
    command = container(gateway)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    # The pause, then the gateway's own shutdown (its streams end within seconds), fit in the grace period.
    assert 0 < int(command[1]) <= gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] - 20


def test_pods_run_as_non_root() -> None:
    for name, workload in {**k8s_objects("Deployment"), **k8s_objects("StatefulSet")}.items():
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0, name
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["resources"]["limits"]["memory"], name


def keda_triggers() -> list[dict[str, Any]]:
    (scaled,) = k8s_objects("ScaledObject").values()
    return list(scaled["spec"]["triggers"])


def test_keda_scales_workers_on_every_lanes_backlog_and_running_jobs_from_the_gateway() -> None:
    (scaled,) = k8s_objects("ScaledObject").values()
    assert scaled["spec"]["scaleTargetRef"]["name"] == "carpool-worker" in k8s_objects("Deployment")
    (gateway_port,) = k8s_objects("Service")["carpool-gateway"]["spec"]["ports"]
    host = f"carpool-gateway.{NAMESPACE}.svc.cluster.local"
    url = f"http://{host}/readyz" if gateway_port["port"] == 80 else f"http://{host}:{gateway_port['port']}/readyz"
    locations = set()
    for trigger in keda_triggers():
        meta = trigger["metadata"]
        assert trigger["type"] == "metrics-api" and meta["url"] == url, trigger["name"]
        assert float(meta["targetValue"]) >= 1 and all(isinstance(v, str) for v in meta.values())
        if meta["valueLocation"].endswith(".waiting"):
            assert meta["activationTargetValue"] == "0"  # one waiting job wakes a pool scaled to zero
        locations.add(meta["valueLocation"])
    assert locations == {f"lanes.{lane.value}.{count}" for lane in LANES for count in ("waiting", "running")}
    assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    # Failing triggers (no gateway to read) hold a pool of workers rather than what their errors would leave.
    fallback = scaled["spec"]["fallback"]
    assert fallback["failureThreshold"] >= 1
    assert scaled["spec"]["minReplicaCount"] <= fallback["replicas"] <= scaled["spec"]["maxReplicaCount"]


async def test_every_keda_value_location_finds_a_count_in_the_gateways_readyz(redis_url: str) -> None:
    from aiohttp.test_utils import TestClient
    from tests.harness.gateway_server import GatewayTestServer

    from gateway.app import init_app
    from gateway.config import GatewayConfig

    async with TestClient(GatewayTestServer(init_app(GatewayConfig(redis_url=redis_url, no_webhooks=True)))) as client:
        assert (await client.post("/v1/jobs", json={"prompt": "x", "lane": "batch"})).status == 202
        resp = await client.get("/readyz")
        assert resp.status == 200
        ready = await resp.json()
    found = {}
    for trigger in keda_triggers():
        value: Any = ready
        for part in trigger["metadata"]["valueLocation"].split("."):
            value = value[part]
        assert isinstance(value, int) and not isinstance(value, bool), trigger["name"]
        found[trigger["metadata"]["valueLocation"]] = value
    assert found["lanes.batch.waiting"] == 1 and found["lanes.batch.running"] == 0


def test_images_in_manifests_are_built_here() -> None:
    dockerfiles = {"carpool-gateway": "Dockerfile.gateway", "carpool-worker": "Dockerfile.worker"}
    for _, doc in k8s_documents():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            repo, _, tag = c["image"].partition(":")
            assert tag and tag != "latest", c["image"]
            if repo.startswith("carpool-"):
                assert (REPO / "deploy" / "docker" / dockerfiles[repo]).is_file()
