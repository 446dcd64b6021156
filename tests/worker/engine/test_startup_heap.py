"""The start-up heap frozen at a process edge (`carpool generate` here; the engine process the same way): the
objects alive then leave the collector's scans, and garbage made afterwards is still collected."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.harness.child_env import child_pythonpath

REPO = Path(__file__).resolve().parents[3]


def test_generate_freezes_its_start_up_heap_and_later_cycles_are_still_collected(tiny_model) -> None:
    code = (
        "import gc, sys, worker.cli as cli\n"
        "assert gc.get_freeze_count() == 0\n"
        "code = cli.main(sys.argv[1:], env={})\n"
        "frozen = gc.get_freeze_count()\n"
        "class Node:\n"
        "    pass\n"
        "gc.disable()  # every cycle below waits for the one collection that counts them\n"
        "for _ in range(1000):\n"
        "    a, b = Node(), Node()\n"
        "    a.other, b.other = b, a\n"
        "del a, b\n"
        "print('heap', code, frozen, gc.collect(), gc.get_freeze_count())\n"
    )
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-c", code, "generate", "hello", "--max-tokens", "2", "--model", tiny_model()],
        capture_output=True, text=True, env=env, timeout=120, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    word, exit_code, frozen, collected, frozen_after = done.stdout.strip().splitlines()[-1].split()
    assert (word, exit_code) == ("heap", "0"), done.stdout
    # The model, tokenizer and torch's modules: many thousands of objects, none of them scanned again.
    assert int(frozen) > 10_000
    # The 1000 pairs made after the freeze: all collected (at least their 2000 objects), none frozen.
    assert int(collected) >= 2000
    assert int(frozen_after) == int(frozen)
    # Unfrozen at exit for the last collection: nothing of Triton's is reported as leaked.
    assert "leaked" not in done.stderr, done.stderr[-2000:]
