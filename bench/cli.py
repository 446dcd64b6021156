"""`carpool bench`: the whole batching comparison in one command, with a report on disk.

    carpool bench --output bench-results            # the full comparison (default model)
    carpool bench --quick --output /tmp/smoke       # seconds: a tiny model, a few short requests
    carpool bench --workload fair-share             # only the fair-share workload (two tenants, one lane)
    carpool bench --workload batch-api              # interactive chat while a Batch API batch runs
    carpool bench batch-api --batch-requests 2000   # the same, with its own flags (--help lists them)

Settings are read once here (flags, then ``CARPOOL_BENCH_<FLAG>`` variables)
and passed down.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from bench.config import MODEL_DTYPES, QUICK_NOTE, SWEPT_MODES, BenchConfig
from scheduler.runtime.flags import flag_error
from scheduler.runtime.model_path import check_local_checkpoint


_Default = TypeVar("_Default", str, None)

WORKLOADS = ("all", "fair-share", "batch-api")


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    def default(flag: str, value: _Default) -> str | _Default:
        return env.get(f"CARPOOL_BENCH_{flag.upper().replace('-', '_')}", value)

    base = BenchConfig()
    p = argparse.ArgumentParser(prog="carpool bench", description=(
        "Compare static, dynamic and continuous batching (engine direct and through gateway + Redis) and "
        "transformers' generate / generate_batch on seeded workloads; writes results.json, results.md and PNG plots."))
    p.add_argument("--output", default=default("output", "bench-results"), help="report folder [env CARPOOL_BENCH_OUTPUT]")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, few short requests (seconds)")
    p.add_argument("--model", default=default("model", None),
                   help="checkpoint directory; default: the built-in model (--quick: a tiny one built in OUTPUT)")
    p.add_argument("--max-num-seqs", type=int, default=default("max-num-seqs", str(base.max_num_seqs)),
                   help=f"batch slots for every system (default {base.max_num_seqs}) [env CARPOOL_BENCH_MAX_NUM_SEQS]")
    p.add_argument("--seed", type=int, default=default("seed", str(base.seed)),
                   help=f"seed of the workloads and the sampling (default {base.seed}) [env CARPOOL_BENCH_SEED]")
    p.add_argument("--threads", type=int, default=default("threads", str(base.threads)),
                   help="torch CPU threads for every system, worker included (default 1: steady numbers on a shared "
                        "CPU) [env CARPOOL_BENCH_THREADS]")
    p.add_argument("--device", default=default("device", base.device),
                   help="cpu, cuda or cuda:N, for every system, worker included (default: cpu)")
    p.add_argument("--dtype", default=default("dtype", None), choices=MODEL_DTYPES,
                   help="model dtype for every system (default: the checkpoint's)")
    p.add_argument("--skewed-requests", type=int, default=None, help=f"default {base.skewed_requests}")
    p.add_argument("--sharegpt-requests", type=int, default=None, help=f"default {base.sharegpt_requests}")
    p.add_argument("--skewed-pairs", type=int, default=None,
                   help=f"measure the skewed claim's two sides this many times, back to back; the claim is the "
                        f"median (default {base.skewed_pairs}; --quick: 2)")
    p.add_argument("--online-pairs", type=int, default=None,
                   help=f"the same for the online claim (default {base.online_pairs}; --quick: 2)")
    p.add_argument("--online-modes", default=None,
                   help=f"comma-separated batching modes swept online (default: {','.join(SWEPT_MODES)})")
    p.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    p.add_argument("--workload", choices=WORKLOADS, default=default("workload", "all"),
                   help="all: the batching comparison; fair-share: tenant A floods the batch lane, then tenant B "
                        "queues a few jobs (fair share against first come, first served); batch-api: interactive "
                        "chat while a 2,000-request Batch API batch runs, against the same requests as plain jobs "
                        "(`carpool bench batch-api --help` for its own flags) [env CARPOOL_BENCH_WORKLOAD]")
    p.add_argument("--fair-share-a", type=int, default=None, help="fair-share: tenant A's jobs (default 2000; --quick 200)")
    p.add_argument("--fair-share-b", type=int, default=None, help="fair-share: tenant B's jobs (default 50; --quick 10)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    config = BenchConfig(max_num_seqs=args.max_num_seqs, seed=args.seed, threads=args.threads,
                         device=args.device, dtype=args.dtype)
    if args.quick:
        config = config.quick()
    config = replace(config, peers=not args.no_peers)
    if args.skewed_requests is not None:
        config = replace(config, skewed_requests=args.skewed_requests)
    if args.sharegpt_requests is not None:
        config = replace(config, sharegpt_requests=args.sharegpt_requests)
    for name in ("skewed_pairs", "online_pairs"):
        if getattr(args, name) is not None:
            config = replace(config, **{name: getattr(args, name)})
    if args.online_modes:
        config = replace(config, online_modes=tuple(m.strip() for m in args.online_modes.split(",") if m.strip()))
    return config


OPTIONAL_MODULES = ("matplotlib", "tqdm", "openai")
"""What the benchmark needs beyond carpool's own dependencies: the `bench` extra (`pip install -e '.[bench]'`)."""


def missing_modules(names: Sequence[str]) -> list[str]:
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _say_missing_modules() -> bool:
    """Whether a module of the bench extra is missing; if so, says which and how to install them."""
    missing = missing_modules(OPTIONAL_MODULES)
    if missing:
        print(f"carpool bench: needs {', '.join(missing)}, from the bench extra: pip install -e '.[bench]' "
              "(or pip install 'carpool[bench]')", file=sys.stderr)
    return bool(missing)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    environ = os.environ if env is None else env
    if argv is None:
        argv = sys.argv[1:]
    if list(argv[:1]) == ["batch-api"]:
        if _say_missing_modules():  # its module imports them: even its --help needs them
            return 2
        from bench.batch_api import main as batch_api_main

        return batch_api_main(argv[1:], environ)
    parser = build_parser(environ)
    args = parser.parse_args(argv)
    if _say_missing_modules():
        return 2
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    if args.model:
        try:
            check_local_checkpoint(args.model)
        except ValueError as e:
            print(f"carpool bench: {flag_error(str(e), also=('model',))}", file=sys.stderr)
            return 2
    output = Path(args.output).expanduser()
    output.mkdir(parents=True, exist_ok=True)
    model = args.model or _default_model(args.quick, output)
    if args.workload == "fair-share":
        return _fair_share(args, config, model, output, environ)
    if args.workload == "batch-api":
        from bench.batch_api import main as batch_api_main

        return batch_api_main(["--output", str(output), "--seed", str(args.seed),
                               *(["--model", args.model] if args.model else [])], environ)

    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    from bench.plan import build_workloads
    from bench.report import write_report
    from bench.suite import planned_output_tokens, run_suite

    hf_logging.disable_progress_bar()  # one bar on screen: ours
    total = planned_output_tokens(config, build_workloads(config))
    with tqdm(total=total, unit="tok", desc="carpool bench", disable=args.no_progress, file=sys.stderr,
              dynamic_ncols=True) as bar:
        def progress(phase: str, num_tokens: int) -> None:
            bar.set_description(phase, refresh=False)
            bar.update(num_tokens)

        report = run_suite(config, model, progress, environ)
    paths = write_report(report, output)
    if args.quick:
        print(QUICK_NOTE)
    for check in report.checks:
        verdict = "–" if check["passed"] is None else ("met" if check["passed"] else "NOT met")
        if args.quick and check["passed"] is False:
            verdict += ", as expected of --quick"
        print(f"{check['name']}: {check['measured']} (target {check['target']}, {verdict})")
    print(f"report: {paths['markdown']} and {paths['json']} ({report.duration_s:.0f} s)")
    return 0


def _fair_share(args: argparse.Namespace, config: BenchConfig, model: str, output: Path,
                environ: Mapping[str, str]) -> int:
    from bench.fair_share import FairShareConfig, run_fair_share

    num_a = args.fair_share_a or (200 if args.quick else 2000)
    num_b = args.fair_share_b or (10 if args.quick else 50)
    if num_a < 1 or num_b < 2:
        print("carpool bench: --fair-share-a must be at least 1 and --fair-share-b at least 2", file=sys.stderr)
        return 2
    fair = FairShareConfig(num_a=num_a, num_b=num_b, max_num_seqs=config.max_num_seqs, device=config.device,
                           dtype=config.dtype)
    run_fair_share(model, fair, {**environ, "OMP_NUM_THREADS": str(config.threads)}, output, quick=args.quick)
    print((output / "fair-share.md").read_text())
    return 0


def _default_model(quick: bool, output: Path) -> str:
    from worker.engine.default_model import create_tiny_model, default_model_path, models_cache_dir

    if quick:
        path = output / "tiny-model"
        if not (path / "config.json").exists():
            create_tiny_model(path)
        return str(path)
    return str(default_model_path(models_cache_dir(os.environ)))


if __name__ == "__main__":
    raise SystemExit(main())
