"""Readers for the deployment files, shared by the deployment tests.

Loads docker-compose.yml, the Kubernetes manifests and .env.example, resolves
compose's `${VAR}` substitutions from .env.example, and asks the real CLI
parser which `CARPOOL_*` variables each verb reads.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
K8S = DEPLOY / "k8s"

CARPOOL_VERBS = ("gateway", "worker", "webhooks")
_SUBST = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def load_env_example() -> dict[str, str]:
    values: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f".env.example: not KEY=VALUE: {line!r}"
        values[key.strip()] = value.strip()
    return values


def compose_variables(text: str) -> set[str]:
    """Every variable a compose file substitutes (`${NAME...}`)."""
    return {m.group(1) for m in _SUBST.finditer(text)}


def substitute(value: str, env: Mapping[str, str]) -> str:
    """Compose-style substitution: `${X}`, `${X:-default}`, `${X:?error}` (error -> placeholder)."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        current = env.get(name, "")
        if op in (":-", "-") and not current:
            return arg
        if op in (":?", "?") and not current:
            return f"placeholder-{name.lower()}"
        return current

    return _SUBST.sub(one, value)


def example_env() -> dict[str, str]:
    """.env.example with its empty secrets filled by well-formed placeholders."""
    env = load_env_example()
    fills = {"REDIS_PASSWORD": "example-password", "CARPOOL_WEBHOOK_SECRET": "whsec_Y2FycG9vbC1leGFtcGxlLXdlYmhvb2stc2VjcmV0ISE=",
             "GRAFANA_ADMIN_PASSWORD": "example-password"}
    for key, value in fills.items():
        if not env.get(key):
            env[key] = value
    return env


def service_env(service: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """A compose service's container environment with substitutions applied."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {key: substitute(str(value), env) for key, value in raw.items()}


def k8s_documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                yield path, doc


def k8s_objects(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for _, doc in k8s_documents() if doc.get("kind") == kind}


def verb_help(verb: str) -> str:
    """What `carpool <verb> --help` prints, through the real entry point."""
    from gateway.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([verb, "--help"], env={})
    assert done.value.code in (0, None), f"carpool {verb} --help failed"
    return out.getvalue()


def verb_env_names(verb: str) -> set[str]:
    """Every `CARPOOL_*` variable `carpool <verb> --help` says it reads."""
    names = set(re.findall(r"\[env\s+(CARPOOL_[A-Z0-9_]+)\]", verb_help(verb)))
    assert "CARPOOL_REDIS_URL" in names, f"carpool {verb} --help names no CARPOOL_* variables"
    return names


def parse_verb(verb: str, env: Mapping[str, str]) -> argparse.Namespace:
    """Parse `carpool <verb>` with `env` as its environment and build (so validate) its config."""
    from gateway.webhooks.config import WebhookConfig
    from scheduler.runtime.flags import config_from_args

    if verb == "gateway":
        from gateway.cli.main import build_parser
        from gateway.config import GatewayConfig

        args = build_parser(env).parse_args(["gateway"])
        config_from_args(GatewayConfig, args, webhooks=config_from_args(WebhookConfig, args))
    elif verb == "worker":
        from worker.cli import build_parser as worker_parser
        from worker.config import WorkerConfig

        args = worker_parser(env).parse_args(["worker"])
        config_from_args(WorkerConfig, args)
    elif verb == "webhooks":
        from gateway.webhooks.cli import parse_args

        args = parse_args([], env)
        config_from_args(WebhookConfig, args)
    else:
        raise AssertionError(f"no container runs `carpool {verb}`")
    return args


FIRST_PARTY = frozenset({"gateway", "scheduler", "worker", "kernels", "bench", "tests"})


def third_party_imports(paths: list[Path]) -> dict[str, list[str]]:
    """Dotted modules imported in `paths` (files, or folders searched for *.py), not stdlib, not first-party -> files.

    Imports inside `try: ... except ImportError` are optional and left out.
    """
    first_party = FIRST_PARTY
    found: dict[str, list[str]] = {}
    for root in paths:
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            tree = ast.parse(path.read_text(), filename=str(path))
            optional = _optional_import_nodes(tree)
            for node in ast.walk(tree):
                if node in optional:
                    continue
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in first_party or top == "__future__":
                        continue
                    found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def _optional_import_nodes(tree: ast.AST) -> set[ast.AST]:
    optional: set[ast.AST] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        catches_import_error = any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            or isinstance(h.type, ast.Tuple) and any(getattr(e, "id", "") in ("ImportError", "ModuleNotFoundError") for e in h.type.elts)
            for h in node.handlers
        )
        if catches_import_error:
            for stmt in node.body:
                optional.update(n for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return optional


def requirement_names(path: Path) -> set[str]:
    names: set[str] = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(normalize_dist(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]))
    return names


def normalize_dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
