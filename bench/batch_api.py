"""Interactive chat while a Batch API batch runs: interactive latency holds, and the Batch API costs the batch nothing.

    carpool bench batch-api --output bench-results      # about 5 minutes on a 2-core CPU, default model

One stack as ``carpool up`` runs it (bundled redis-server, gateway and worker
processes, every setting at its default), the worker restarted before each
batch phase (a cold prefix cache, so no phase reuses another's prompts):

- ``alone``: interactive chat completions, streamed through the real
  ``openai`` client at Poisson arrivals; TTFT is measured at the client,
  from the request sent to its first chunk (the gateway sends it with the
  first token), and split by the job records into queue time (submitted ->
  a worker started it) and the engine's part (started -> first token). The
  time to the first chunk with text is kept beside it: with a byte-level
  tokenizer a first token may be part of a character, and its text waits for
  the next token(s).
- ``jobs``: the batch's requests as plain jobs (``POST /v1/jobs``, batch
  lane, results on a ``reply_to`` stream), with the same interactive arrivals.
- ``batch``: the same requests as one Batch API batch (``files.create``,
  ``batches.create``, polled until ``completed``), with the same arrivals.

``jobs`` and ``batch`` run ``--pairs`` times (2), in mirrored order (jobs,
batch, batch, jobs), and each claim compares their pooled numbers. Claims: the
interactive TTFT p99 during the Batch API batch is at most 2x that alone (and,
reported beside it, the same for the first text); the
Batch API batch's throughput (requests from the upload to ``completed``,
output file written) is at least 0.9x the plain jobs' (first POST to last
result). Interactive requests are counted only while the batch runs.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import openai
import redis.asyncio as aioredis

from bench.plan import describe_machine
from bench.process_stack import ProcessStack
from bench.records import percentile
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_replies import stream_entries

KEYS = Keys()
SUBMIT_CONNECTIONS = 16
POLL_S = 0.2
TTFT_RATIO_TARGET = 2.0
THROUGHPUT_RATIO_TARGET = 0.9


@dataclass(frozen=True)
class BatchApiConfig:
    batch_requests: int = 2000
    batch_prompt_len: int = 32
    batch_max_tokens: int = 48
    interactive: int = 30
    interactive_rate: float = 1.0
    """Interactive arrivals per second (Poisson)."""
    interactive_max_tokens: int = 16
    interactive_delay_s: float = 2.0
    """The batch's head start: interactive traffic arrives once the batch owns the worker."""
    seed: int = 0
    model: str | None = None
    max_num_seqs: int | None = None
    """The worker's batch slots; None: its default (as ``carpool up`` runs it)."""
    pairs: int = 2
    """Times the jobs and batch phases run, in mirrored order (jobs, batch, batch, jobs, ...)."""

    def __post_init__(self) -> None:
        for name in ("batch_requests", "batch_prompt_len", "batch_max_tokens", "interactive", "interactive_max_tokens",
                     "pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1")
        if self.interactive_rate <= 0:
            raise ValueError("interactive_rate: must be positive")


@dataclass
class Phase:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    """Client-side TTFT (to the first chunk) of each interactive request that finished while the batch ran (all of
    them when alone)."""
    first_text_s: list[float] = field(default_factory=list)
    """The same requests' time to their first chunk with text."""
    num_interactive_sent: int = 0
    job_ids: list[str] = field(default_factory=list)
    """Jobs of the counted interactive requests."""
    queued_s: list[float] = field(default_factory=list)
    """Their records' submission -> a worker started them."""
    engine_ttft_s: list[float] = field(default_factory=list)
    """Their records' started -> first token (the engine's part of TTFT)."""
    batch_s: float | None = None
    batch_completed: int = 0
    batch_output_tokens: int = 0

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.name, "interactive_sent": self.num_interactive_sent,
                               "interactive_counted": len(self.ttft_s)}
        for name, values in (("ttft", self.ttft_s), ("first_text", self.first_text_s), ("queued", self.queued_s),
                             ("engine_ttft", self.engine_ttft_s)):
            for q in (50, 95, 99):
                value = percentile(values, q)
                out[f"{name}_p{q}_ms"] = None if value is None else round(value * 1000, 1)
        if self.batch_s:
            out.update(batch_s=round(self.batch_s, 2), batch_completed=self.batch_completed,
                       batch_requests_per_s=round(self.batch_completed / self.batch_s, 2),
                       batch_output_tokens_per_s=round(self.batch_output_tokens / self.batch_s, 1))
        return out


def batch_prompts(config: BatchApiConfig) -> list[list[int]]:
    rng = random.Random(config.seed)
    return [[rng.randrange(3, 250) for _ in range(config.batch_prompt_len)] for _ in range(config.batch_requests)]


def interactive_arrivals(config: BatchApiConfig) -> list[tuple[float, str]]:
    rng = random.Random(config.seed + 1)
    words = ("queue", "lane", "token", "batch", "cache", "model", "step", "prompt", "worker", "redis")
    t, out = 0.0, []
    for i in range(config.interactive):
        t += rng.expovariate(config.interactive_rate)
        out.append((t, f"Question {i}: " + " ".join(rng.choice(words) for _ in range(12))))
    return out


async def run_interactive(client: openai.AsyncOpenAI, model: str, config: BatchApiConfig, phase: Phase,
                          batch_done: asyncio.Event | None) -> None:
    """Send the arrivals (stopping when the batch is done); keep TTFTs of requests that finished before it."""
    async def one(text: str) -> None:
        sent = time.perf_counter()
        first: float | None = None
        first_text: float | None = None
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=config.interactive_max_tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        job_id = None
        async for chunk in stream:
            job_id = f"{chunk.id}-0"
            if first is None and chunk.choices:
                first = time.perf_counter()
            if first_text is None and chunk.choices and chunk.choices[0].delta.content:
                first_text = time.perf_counter()
        if (first is not None and first_text is not None and job_id is not None
                and (batch_done is None or not batch_done.is_set())):
            phase.ttft_s.append(first - sent)
            phase.first_text_s.append(first_text - sent)
            phase.job_ids.append(job_id)

    tasks: list[asyncio.Task[None]] = []
    start = time.perf_counter()
    try:
        for at, text in interactive_arrivals(config):
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if batch_done is not None and batch_done.is_set():
                break
            tasks.append(asyncio.create_task(one(text)))
            phase.num_interactive_sent += 1
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def run_jobs(stack: ProcessStack, prompts: list[list[int]], config: BatchApiConfig, phase: Phase,
                   done: asyncio.Event) -> None:
    stream = f"bench:replies:{uuid.uuid4().hex}"
    redis = aioredis.Redis.from_url(stack.redis.url)
    connector = aiohttp.TCPConnector(limit=SUBMIT_CONNECTIONS)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            async def submit(ids: list[int]) -> None:
                body = {"prompt_token_ids": ids, "lane": "batch", "reply_to": stream,
                        "params": {"max_tokens": config.batch_max_tokens, "temperature": 0, "ignore_eos": True}}
                async with session.post(f"{stack.base_url}/v1/jobs", json=body) as resp:
                    if resp.status != 202:
                        raise RuntimeError(f"submission refused with {resp.status}: {await resp.text()}")

            start = time.perf_counter()
            submissions = asyncio.gather(*(submit(ids) for ids in prompts))
            last_id, results = "0-0", 0
            while results < len(prompts):
                reply = await redis.xread({stream: last_id}, block=1000, count=500)
                for _, entries in stream_entries(reply):
                    for entry_id, fields in entries:
                        last_id = entry_id.decode()
                        assert fields is not None
                        record = msgpack.unpackb(fields[b"result"], raw=False, strict_map_key=False)
                        results += 1
                        if record["status"] == "succeeded":
                            phase.batch_completed += 1
                            phase.batch_output_tokens += int(record["usage"]["completion_tokens"])
            phase.batch_s = time.perf_counter() - start
            await submissions
    finally:
        done.set()
        await redis.aclose()


async def run_batch(client: openai.AsyncOpenAI, model: str, prompts: list[list[int]], config: BatchApiConfig,
                    phase: Phase, done: asyncio.Event) -> None:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": model, "prompt": ids, "max_tokens": config.batch_max_tokens,
                                  "temperature": 0, "ignore_eos": True}})
             for i, ids in enumerate(prompts)]
    try:
        start = time.perf_counter()
        upload = await client.files.create(file=("bench.jsonl", io.BytesIO("\n".join(lines).encode())),
                                           purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                            completion_window="24h")
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(POLL_S)
            batch = await client.batches.retrieve(batch.id)
        phase.batch_s = time.perf_counter() - start
        done.set()  # the batch has ended; reading its output file below is the bench's work, not the service's
        if batch.status != "completed" or batch.request_counts is None:
            raise RuntimeError(f"the batch ended {batch.status}: {batch.errors}")
        phase.batch_completed = batch.request_counts.completed
        content = await client.files.content(batch.output_file_id or "")
        phase.batch_output_tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
                                        for line in content.text.splitlines())
    finally:
        done.set()


async def read_timings(stack: ProcessStack, phase: Phase) -> None:
    redis = aioredis.Redis.from_url(stack.redis.url)
    try:
        for job_id in phase.job_ids:
            created, started, first = await redis.hmget(KEYS.job(job_id), ["created_at", "started_at",
                                                                           "first_token_at"])
            if created and started and first:
                phase.queued_s.append(float(started) - float(created))
                phase.engine_ttft_s.append(float(first) - float(started))
    finally:
        await redis.aclose()


def phase_order(pairs: int) -> list[str]:
    """Alone first; then the two batch phases, each pair in the other order than the last, so a machine
    growing busier or quieter over the run weighs on both alike (each claim pools the pairs)."""
    order = ["alone"]
    for k in range(pairs):
        order += ["jobs", "batch"] if k % 2 == 0 else ["batch", "jobs"]
    return order


async def run_phases(config: BatchApiConfig) -> list[Phase]:
    prompts = batch_prompts(config)
    worker_args = [] if config.max_num_seqs is None else ["--max-num-seqs", str(config.max_num_seqs)]
    async with ProcessStack(config.model, worker_args, []) as stack:
        client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            model = (await client.models.list()).data[0].id
            # Warm-up: the whole path once, untimed.
            await run_interactive(client, model, BatchApiConfig(interactive=2, interactive_rate=100), Phase("warm"),
                                  None)
            phases = [Phase(name) for name in phase_order(config.pairs)]
            for phase in phases:
                if phase.name == "alone":  # the worker that served the warm-up
                    await run_interactive(client, model, config, phase, None)
                else:
                    await stack.start_worker()
                    done = asyncio.Event()
                    runner = (run_jobs(stack, prompts, config, phase, done) if phase.name == "jobs"
                              else run_batch(client, model, prompts, config, phase, done))

                    async def interactive(phase: Phase = phase, done: asyncio.Event = done) -> None:
                        await asyncio.sleep(config.interactive_delay_s)
                        await run_interactive(client, model, config, phase, done)

                    await asyncio.gather(runner, interactive())
                await read_timings(stack, phase)
            return phases
        finally:
            await client.close()


def merged(phases: Sequence[Phase], name: str) -> Phase:
    """Every phase of one name as one: TTFTs pooled, batch times and counts summed."""
    out = Phase(name)
    for p in phases:
        if p.name == name:
            out.ttft_s += p.ttft_s
            out.first_text_s += p.first_text_s
            out.queued_s += p.queued_s
            out.engine_ttft_s += p.engine_ttft_s
            out.num_interactive_sent += p.num_interactive_sent
            out.batch_s = (out.batch_s or 0.0) + (p.batch_s or 0.0) if p.batch_s else out.batch_s
            out.batch_completed += p.batch_completed
            out.batch_output_tokens += p.batch_output_tokens
    return out


def checks(phases: Sequence[Phase]) -> list[dict[str, Any]]:
    alone, jobs, batch = (merged(phases, name).summary() for name in ("alone", "jobs", "batch"))
    def ratio(name: str) -> float | None:
        return batch[name] / alone[name] if batch.get(name) and alone.get(name) else None

    ttft_ratio, text_ratio = ratio("ttft_p99_ms"), ratio("first_text_p99_ms")
    tput_ratio = (batch["batch_requests_per_s"] / jobs["batch_requests_per_s"]
                  if batch.get("batch_requests_per_s") and jobs.get("batch_requests_per_s") else None)
    return [
        {"name": "interactive TTFT p99 during a Batch API batch / alone", "measured": ttft_ratio,
         "target": f"<= {TTFT_RATIO_TARGET}", "passed": None if ttft_ratio is None else ttft_ratio <= TTFT_RATIO_TARGET},
        {"name": "interactive time to first text p99 during a Batch API batch / alone", "measured": text_ratio,
         "target": f"<= {TTFT_RATIO_TARGET}", "passed": None if text_ratio is None else text_ratio <= TTFT_RATIO_TARGET},
        {"name": "Batch API throughput / the same requests as plain jobs", "measured": tput_ratio,
         "target": f">= {THROUGHPUT_RATIO_TARGET}",
         "passed": None if tput_ratio is None else tput_ratio >= THROUGHPUT_RATIO_TARGET},
    ]


def markdown(config: BatchApiConfig, phases: Sequence[Phase], found: list[dict[str, Any]],
             machine: dict[str, Any]) -> str:
    rows = [p.summary() for p in phases] + [merged(phases, name).summary() | {"phase": f"{name}, all"}
                                            for name in ("jobs", "batch")]
    cols = ["phase", "interactive_counted", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "first_text_p50_ms",
            "first_text_p99_ms", "queued_p50_ms",
            "queued_p99_ms", "engine_ttft_p50_ms", "engine_ttft_p99_ms", "batch_s", "batch_requests_per_s",
            "batch_output_tokens_per_s"]
    lines = [f"machine: {machine['cpu']} ({machine['num_cpus']} CPUs), load {machine['load_average_at_start']} "
             f"-> {machine.get('load_average_at_end')}", f"config: {asdict(config)}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "–")) for c in cols) + " |" for r in rows]
    lines.append("")
    for check in found:
        measured = "–" if check["measured"] is None else f"{check['measured']:.2f}"
        verdict = "–" if check["passed"] is None else ("met" if check["passed"] else "NOT met")
        lines.append(f"- {check['name']}: {measured} (target {check['target']}, {verdict})")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    base = BatchApiConfig()
    p = argparse.ArgumentParser(prog="carpool bench batch-api", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default=(env or os.environ).get("CARPOOL_BENCH_OUTPUT", "bench-results"))
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--batch-requests", type=int, default=base.batch_requests)
    p.add_argument("--batch-max-tokens", type=int, default=base.batch_max_tokens)
    p.add_argument("--interactive", type=int, default=base.interactive, help="interactive requests per phase")
    p.add_argument("--interactive-rate", type=float, default=base.interactive_rate, help="arrivals per second")
    p.add_argument("--seed", type=int, default=base.seed)
    p.add_argument("--max-num-seqs", type=int, default=None, help="the worker's batch slots (default: its own)")
    p.add_argument("--pairs", type=int, default=base.pairs, help="jobs/batch phase pairs, in mirrored order")
    args = p.parse_args(argv)
    try:
        config = BatchApiConfig(batch_requests=args.batch_requests, batch_max_tokens=args.batch_max_tokens,
                                interactive=args.interactive, interactive_rate=args.interactive_rate,
                                seed=args.seed, model=args.model, max_num_seqs=args.max_num_seqs, pairs=args.pairs)
    except ValueError as e:
        p.error(str(e))
    machine = describe_machine()
    started = time.perf_counter()
    phases = asyncio.run(run_phases(config))
    machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    found = checks(phases)
    output = Path(args.output).expanduser()
    output.mkdir(parents=True, exist_ok=True)
    report = {"config": asdict(config), "machine": machine, "phases": [p.summary() for p in phases],
              "merged": [merged(phases, name).summary() for name in ("alone", "jobs", "batch")],
              "checks": found, "duration_s": round(time.perf_counter() - started, 1)}
    (output / "batch_api.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(config, phases, found, machine)
    (output / "batch_api.md").write_text(text)
    print(text, end="")
    print(f"report: {output / 'batch_api.md'} and {output / 'batch_api.json'} ({report['duration_s']:.0f} s)")
    return 0
