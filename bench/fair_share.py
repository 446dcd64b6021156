"""The fair-share workload: tenant A floods the batch lane, then tenant B queues a few jobs.

    carpool bench --workload fair-share --output /tmp/fair      # 2,000 jobs of A, then 50 of B
    carpool bench --workload fair-share --quick --output /tmp/f  # 200 then 10, a tiny model

The stack is real (bundled redis-server, the gateway with ``--api-keys``, one ``carpool worker`` child).
A's jobs are submitted first, all at once; B's follow as soon as A's are all queued. Each job's wait is
its record's ``timings.queued_s`` (submission to start). The same jobs then run again with keys off, where
both producers are the one default tenant and B's jobs wait behind A's (first come, first served): the
baseline. The claim: with fair share, B's p50 wait is under a fifth of A's, while A's jobs keep finishing.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.config import QUICK_NOTE
from bench.online import SUBMIT_CONNECTIONS, OnlineStack, _read_replies
from gateway.api_keys import KeyStore
from scheduler.protocol.keys import Keys
from scheduler.protocol.tenants import TenantLimits

TARGET_RATIO = 0.2
"""B's p50 wait over A's must be below this."""


@dataclass(frozen=True)
class FairShareConfig:
    num_a: int = 2000
    num_b: int = 50
    max_tokens: int = 4
    max_num_seqs: int = 8
    device: str = "cpu"
    dtype: str | None = None


async def _submit_all(session: aiohttp.ClientSession, url: str, headers: dict[str, str], prefix: str, n: int,
                      max_tokens: int, stream: str) -> None:
    async def one(i: int) -> None:
        body = {"id": f"{prefix}-{i}", "prompt_token_ids": [1 + (i + k) % 200 for k in range(16)], "lane": "batch",
                "reply_to": stream, "params": {"max_tokens": max_tokens, "ignore_eos": True}}
        async with session.post(f"{url}/v1/jobs", headers=headers, json=body) as resp:
            if resp.status != 202:
                raise RuntimeError(f"submission refused with {resp.status}: {await resp.text()}")

    await asyncio.gather(*(one(i) for i in range(n)))


async def run_once(model: str, config: FairShareConfig, *, fair: bool, child_env: dict[str, str]) -> dict[str, Any]:
    """One run: with keys on (two tenants, fair share) or off (one default tenant, first come first served)."""
    async with OnlineStack(model, "continuous", config.max_num_seqs, 5.0, child_env, device=config.device,
                           dtype=config.dtype, api_keys=fair) as stack:
        client = aioredis.Redis.from_url(stack.redis.url)
        headers: dict[str, dict[str, str]] = {"a": {}, "b": {}}
        if fair:
            store = KeyStore(client, Keys())
            for tenant in ("a", "b"):
                key, _ = await store.create(f"tenant-{tenant}", TenantLimits())
                headers[tenant] = {"Authorization": f"Bearer {key}"}
        # With keys on, a tenant's reply stream is under its name: one stream each, read together.
        run = uuid.uuid4().hex
        streams = ({tenant: f"tenant-{tenant}:bench-fair-{run}" for tenant in ("a", "b")} if fair
                   else dict.fromkeys(("a", "b"), f"bench:fair:{run}"))
        reader = asyncio.create_task(_read_every_reply(client, streams, config))
        connector = aiohttp.TCPConnector(limit=SUBMIT_CONNECTIONS)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
                started = time.time()
                await _submit_all(s, stack.base_url, headers["a"], "a", config.num_a, config.max_tokens, streams["a"])
                a_queued_s = time.time() - started
                await _submit_all(s, stack.base_url, headers["b"], "b", config.num_b, config.max_tokens, streams["b"])
            records = await asyncio.wait_for(reader, 3600)
        finally:
            reader.cancel()
            await client.aclose()
    return summarize(records, fair=fair, a_queued_s=a_queued_s)


async def _read_every_reply(client: aioredis.Redis, streams: dict[str, str],
                            config: FairShareConfig) -> list[dict[str, Any]]:
    """Every job's final record, from the one stream both tenants reply to or from each tenant's own."""
    if streams["a"] == streams["b"]:
        return await _read_replies(client, streams["a"], config.num_a + config.num_b, None)
    a, b = await asyncio.gather(_read_replies(client, streams["a"], config.num_a, None),
                                _read_replies(client, streams["b"], config.num_b, None))
    return a + b


def summarize(records: list[dict[str, Any]], *, fair: bool, a_queued_s: float) -> dict[str, Any]:
    a = [r for r in records if r["id"].startswith("a-")]
    b = [r for r in records if r["id"].startswith("b-")]
    wait = {name: [r["timings"]["queued_s"] for r in rs] for name, rs in (("a", a), ("b", b))}
    b_first = min(r["created_at"] for r in b)
    b_last_done = max(r["finished_at"] for r in b)
    a_done_during_b = sum(1 for r in a if b_first <= r["finished_at"] <= b_last_done)
    p50_a, p50_b = statistics.median(wait["a"]), statistics.median(wait["b"])
    return {
        "fair_share": fair, "jobs_a": len(a), "jobs_b": len(b),
        "failed": sum(r["status"] != "succeeded" for r in records),
        "a_submit_s": round(a_queued_s, 2),
        "p50_wait_a_s": round(p50_a, 3), "p50_wait_b_s": round(p50_b, 3),
        "p90_wait_b_s": round(statistics.quantiles(wait["b"], n=10)[-1], 3) if len(b) > 1 else round(p50_b, 3),
        "ratio_b_over_a": round(p50_b / p50_a, 4) if p50_a > 0 else None,
        "a_finished_while_b_waited_or_ran": a_done_during_b,
        "duration_s": round(max(r["finished_at"] for r in records) - min(r["created_at"] for r in records), 2),
    }


def run_fair_share(model: str, config: FairShareConfig, child_env: dict[str, str], output: Path, *,
                   quick: bool = False) -> dict[str, Any]:
    """Fair share, then the first-come-first-served baseline; writes fair-share.json and .md in `output`.
    `quick`: a --quick run, whose workload is too small for the target (a miss is marked as expected)."""
    from bench.plan import describe_machine

    machine = describe_machine()
    fair = asyncio.run(run_once(model, config, fair=True, child_env=child_env))
    fifo = asyncio.run(run_once(model, config, fair=False, child_env=child_env))
    ratio = fair["ratio_b_over_a"]
    check = {"name": "fair share: B's p50 wait / A's p50 wait", "target": f"< {TARGET_RATIO}", "measured": ratio,
             "passed": ratio is not None and ratio < TARGET_RATIO and fair["a_finished_while_b_waited_or_ran"] > 0}
    document = {"machine": machine, "config": {**config.__dict__, "model": model}, "runs": [fair, fifo],
                "check": check, "quick": quick}
    output.mkdir(parents=True, exist_ok=True)
    (output / "fair-share.json").write_text(json.dumps(document, indent=2) + "\n")
    (output / "fair-share.md").write_text(to_markdown(document))
    return document


def to_markdown(document: dict[str, Any]) -> str:
    c, m = document["config"], document["machine"]
    lines = [
        f"# Fair share: {c['num_a']} batch jobs of tenant A, then {c['num_b']} of tenant B",
        "",
        f"Machine: {m['cpu']} ({m['num_cpus']} CPUs), {m['platform']}; model {c['model']}, "
        f"{c['max_num_seqs']} slots, {c['max_tokens']} output tokens a job.",
        "",
        "| run | p50 wait A (s) | p50 wait B (s) | p90 wait B (s) | B / A | A finished while B waited or ran | failed | duration (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in document["runs"]:
        name = "fair share (two tenants)" if run["fair_share"] else "one tenant (first come, first served)"
        lines.append(f"| {name} | {run['p50_wait_a_s']} | {run['p50_wait_b_s']} | {run['p90_wait_b_s']} | "
                     f"{run['ratio_b_over_a']} | {run['a_finished_while_b_waited_or_ran']} | {run['failed']} | "
                     f"{run['duration_s']} |")
    check = document["check"]
    verdict = "met" if check["passed"] else "NOT met"
    if document.get("quick") and not check["passed"]:
        verdict += ", as expected of --quick"
    lines += ["", f"{check['name']}: {check['measured']} (target {check['target']}, {verdict})", ""]
    if document.get("quick"):
        lines += [QUICK_NOTE[0].upper() + QUICK_NOTE[1:] + ".", ""]
    return "\n".join(lines)
