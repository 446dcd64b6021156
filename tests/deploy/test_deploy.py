"""Structural checks of the deployment files against the code they run.

No container engine or cluster is involved: the files are parsed and every
name, path, port and variable in them is checked against the repository and
the real `carpool` CLI parser.
"""

from __future__ import annotations

import re

import yaml

from tests.harness.deploy_files import (
    CARPOOL_VERBS, COMPOSE_FILE, DEPLOY, REPO, compose_variables, example_env, k8s_objects, load_compose,
    load_env_example, parse_verb, service_env, verb_env_names,
)

EXPECTED_SERVICES = {"redis", "gateway", "worker", "webhooks", "otel-collector", "prometheus", "grafana"}


def carpool_verb(service: dict) -> str | None:
    command = service.get("command") or []
    return command[0] if command and command[0] in CARPOOL_VERBS else None


# --- every file parses --------------------------------------------------------------


def test_every_deployment_yaml_parses() -> None:
    files = [COMPOSE_FILE, *DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]
    assert len(files) >= 12
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"
        assert all(isinstance(d, dict) for d in docs), path


# --- docker compose ---------------------------------------------------------------------


def test_compose_services_and_what_they_reference_exist() -> None:
    compose = load_compose()
    services = compose["services"]
    assert set(services) == EXPECTED_SERVICES
    built = {}
    for name, service in services.items():
        if "build" in service:
            assert service["build"]["context"] == "."
            assert (REPO / service["build"]["dockerfile"]).is_file(), name
            built[service["image"].split(":")[0]] = service["build"]["dockerfile"]
    assert built == {"carpool-gateway": "deploy/docker/Dockerfile.gateway", "carpool-worker": "deploy/docker/Dockerfile.worker"}
    for name, service in services.items():
        image = service["image"].split(":")[0] if "image" in service else None
        if image and image.startswith("carpool-"):
            assert image in built, f"{name} uses {image}, which no service builds"
        elif image:
            tag = service["image"].split(":", 1)[1]
            assert tag and tag != "latest", f"{name}: pin third-party images"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{name} mounts missing {source}"
            elif not source.startswith("${"):
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"
        for dep, cond in (service.get("depends_on") or {}).items():
            assert dep in services
            if cond["condition"] == "service_healthy":
                assert not services[dep].get("healthcheck", {}).get("disable"), f"{dep} has no health check"
                assert "test" in services[dep]["healthcheck"]
    # Every long-running carpool process and Redis has a real health check.
    for name in ("redis", "gateway", "worker", "webhooks", "prometheus", "grafana"):
        assert services[name]["healthcheck"]["test"][0] == "CMD"


def test_compose_runs_a_worker_per_gpu_and_its_note_adds_one_for_the_next() -> None:
    worker = load_compose()["services"]["worker"]
    assert "ports" not in worker and "container_name" not in worker
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    # device_ids, not count: compose would give every replica of a `count: 1` service the same GPU.
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and "count" not in device
    assert device["device_ids"] == ["${WORKER_GPU:-0}"]
    assert worker["stop_grace_period"] == "60s"
    # The commented service for a second GPU, as an operator would paste it under `services:`.
    text = COMPOSE_FILE.read_text()
    note = text[text.index("  #   worker-1:\n"):text.index("  worker:\n")]
    pasted = "".join(line.replace("  #   ", "  ", 1) + "\n" for line in note.splitlines())
    services = yaml.safe_load(text.replace("services:\n", "services:\n" + pasted, 1))["services"]
    second = services["worker-1"]
    assert {k: v for k, v in second.items() if k != "deploy"} == {k: v for k, v in worker.items() if k != "deploy"}
    (device,) = second["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["1"] and device["capabilities"] == ["gpu"]


def test_compose_holds_no_secrets() -> None:
    text = COMPOSE_FILE.read_text()
    compose = load_compose()
    secretish = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH", re.I)
    for name, service in compose["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if secretish.search(key):
                assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]+\}", str(value)), f"{name}.{key} must come from .env"
    assert not re.search(r"whsec_[A-Za-z0-9+/=]{8,}", text), "a webhook secret is written in the file"
    assert "redis://:${REDIS_PASSWORD" in text
    assert re.search(r"requirepass\", \"\$\{REDIS_PASSWORD:\?", text)


def test_env_example_defines_every_compose_variable_and_no_secret() -> None:
    example = load_env_example()
    used = compose_variables(COMPOSE_FILE.read_text())
    assert used - set(example) == set(), "document every variable in .env.example"
    assert set(example) - used == set(), ".env.example names a variable compose never reads"
    for key in ("REDIS_PASSWORD", "CARPOOL_WEBHOOK_SECRET", "GRAFANA_ADMIN_PASSWORD"):
        assert example[key] == "", f"{key} must be left empty in the example"


def test_compose_carpool_variables_are_flags_of_the_verb_and_parse() -> None:
    env = example_env()
    services = load_compose()["services"]
    verbs = {name: carpool_verb(s) for name, s in services.items() if carpool_verb(s)}
    assert verbs == {"gateway": "gateway", "worker": "worker", "webhooks": "webhooks"}
    for name, verb in verbs.items():
        container_env = service_env(services[name], env)
        carpool_vars = {k for k in container_env if k.startswith("CARPOOL_")}
        assert carpool_vars, name
        unknown = carpool_vars - verb_env_names(verb)
        assert not unknown, f"{name}: {sorted(unknown)} are not flags of `carpool {verb}`"
        args = parse_verb(verb, container_env)
        for key in carpool_vars:
            assert getattr(args, key.removeprefix("CARPOOL_").lower()) is not None or container_env[key] == "", key
    # The .env.example CARPOOL_* variables each feed a flag of a service that uses them.
    for key in (k for k in load_env_example() if k.startswith("CARPOOL_")):
        users = [n for n, s in services.items() if f"${{{key}" in yaml.safe_dump(s.get("environment", {}))]
        assert users, key
        for user in users:
            assert key in verb_env_names(verbs[user]), f"{key} is not a flag of `carpool {verbs[user]}`"


def test_compose_ports_match_the_flags() -> None:
    env = example_env()
    services = load_compose()["services"]
    gateway = parse_verb("gateway", service_env(services["gateway"], env))
    assert (gateway.host, gateway.port, gateway.no_webhooks) == ("0.0.0.0", 8000, True)
    assert services["gateway"]["ports"] == ["${GATEWAY_PUBLISH_PORT:-8000}:8000"]
    assert services["gateway"]["healthcheck"]["test"][-3:] == ["/readyz", "CARPOOL_PORT", "8000"]
    worker = parse_verb("worker", service_env(services["worker"], env))
    assert worker.metrics_port == 9464 and worker.device == "cuda" and worker.model == "/models/my-model"
    assert services["worker"]["expose"] == [str(worker.metrics_port)]
    assert services["worker"]["healthcheck"]["test"][-3:] == ["/readyz", "CARPOOL_METRICS_PORT", str(worker.metrics_port)]
    redis_url = service_env(services["worker"], env)["CARPOOL_REDIS_URL"]
    webhooks = parse_verb("webhooks", service_env(services["webhooks"], env))
    assert redis_url == "redis://:example-password@redis:6379/0" == webhooks.redis_url
    assert webhooks.metrics_port == 9465 and services["webhooks"]["expose"] == [str(webhooks.metrics_port)]
    assert services["webhooks"]["healthcheck"]["test"][-3:] == ["/healthz", "CARPOOL_METRICS_PORT", str(webhooks.metrics_port)]

    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["carpool-gateway"]["static_configs"][0]["targets"] == [f"gateway:{gateway.port}"]
    assert jobs["carpool-worker"]["dns_sd_configs"][0] == {"names": ["worker"], "type": "A", "port": worker.metrics_port, "refresh_interval": "15s"}
    assert jobs["carpool-webhooks"]["dns_sd_configs"][0] == {"names": ["webhooks"], "type": "A", "port": webhooks.metrics_port, "refresh_interval": "15s"}
    collector = yaml.safe_load((DEPLOY / "otel" / "collector.yaml").read_text())
    exporter_port = collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    assert jobs["otel-collector"]["static_configs"][0]["targets"] == [f"otel-collector:{exporter_port}"]
    assert exporter_port in services["otel-collector"]["expose"]


def test_observability_config_is_wired() -> None:
    services = load_compose()["services"]
    collector = yaml.safe_load((DEPLOY / "otel" / "collector.yaml").read_text())
    for pipeline in collector["service"]["pipelines"].values():
        assert set(pipeline["receivers"]) <= set(collector["receivers"])
        assert set(pipeline["processors"]) <= set(collector["processors"])
        assert set(pipeline["exporters"]) <= set(collector["exporters"])
    otlp_http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1]
    for name in ("gateway", "worker", "webhooks"):
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://otel-collector:{otlp_http}"
    telemetry_source = (REPO / "scheduler" / "telemetry" / "otel.py").read_text()
    for name in ("gateway", "worker", "webhooks"):
        for key in services[name]["environment"]:
            if key.startswith("OTEL_"):
                assert f'"{key}"' in telemetry_source, f"{name}: nothing reads {key}"
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"] if v.startswith("./"))
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "carpool.yaml").read_text())
    assert mounts["./deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090" and "prometheus" in services


def test_redis_config_is_durable_and_never_evicts() -> None:
    conf = (DEPLOY / "redis" / "redis.conf").read_text()
    settings = dict(line.split(None, 1) for line in conf.splitlines() if line.strip() and not line.startswith("#") and " " in line)
    assert settings["appendonly"] == "yes" and settings["appendfsync"] == "everysec"
    assert settings["maxmemory-policy"] == "noeviction"
    assert "requirepass" not in settings, "the password comes from the environment"
    k8s_conf = k8s_objects("ConfigMap")["carpool-redis-config"]["data"]["redis.conf"]
    assert k8s_conf.strip() == conf.strip(), "deploy/k8s/redis.yaml must carry deploy/redis/redis.conf unchanged"
