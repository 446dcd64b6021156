"""`carpool batch submit --wait -o`, `status` and `cancel` against a real gateway process and a real worker."""

from __future__ import annotations

import asyncio
import io
import json
import re
import sys

from gateway.cli.main import main
from tests.harness.gateway_process import gateway_process
from tests.harness.openai_support import MODEL_NAME
from tests.harness.worker_harness import running_worker


def line(i: int) -> str:
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL_NAME, "prompt": f"item {i}", "max_tokens": 3, "temperature": 0}})


async def test_batch_submit_waits_with_progress_and_writes_the_output(redis_url, tiny_model, tmp_path, capsys,
                                                                      monkeypatch) -> None:
    from worker.engine.engine import Engine

    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([line(i) for i in range(20)] + ["not json"]) + "\n")
    out = tmp_path / "out.jsonl"
    with gateway_process(redis_url, tmp_path / "gateway.log", "--batch-poll-interval-s", "0.1") as gateway:
        async with running_worker(redis_url, Engine(model=tiny_model(), max_num_seqs=8), served_model_name=MODEL_NAME):
            # The endpoint comes from the lines' url; -o waits for the batch to end.
            code = await asyncio.to_thread(main, ["batch", "submit", str(source), "-o", str(out),
                                                  "--gateway", gateway.url])
            captured = capsys.readouterr()
            # `-` for both: the lines from stdin, the results (output lines, then error lines) alone on stdout.
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(source.read_bytes())))
            piped = await asyncio.to_thread(main, ["batch", "submit", "-", "-o", "-", "--gateway", gateway.url])
        streamed = capsys.readouterr()
        assert piped == 0, streamed.err
        results = [json.loads(x) for x in streamed.out.splitlines()]
        assert [r["custom_id"] for r in results[-1:]] == [None] and results[-1]["error"]["code"] == "invalid_json"
        assert sorted(r["custom_id"] for r in results[:-1]) == sorted(f"c{i}" for i in range(20))
        assert re.search(r"carpool batch: batch_\w+", streamed.err) and "wrote" not in streamed.err
        assert code == 0, captured.err
        batch_id = captured.out.split()[0]
        final = re.findall(r"completed\s+20 done / 1 failed / 21\s+(\d+) tok/s", captured.err)
        assert final and int(final[-1]) > 0, captured.err
        outputs = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"c{i}" for i in range(20))
        errors = [json.loads(x) for x in out.with_suffix(".errors.jsonl").read_text().splitlines()]
        assert [e["error"]["code"] for e in errors] == ["invalid_json"]

        assert await asyncio.to_thread(main, ["batch", "status", batch_id, "--gateway", gateway.url]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["status"] == "completed"
        assert shown["usage"]["output_tokens"] == sum(o["response"]["body"]["usage"]["completion_tokens"]
                                                      for o in outputs) > 0
        assert await asyncio.to_thread(main, ["batch", "cancel", "batch_nope", "--gateway", gateway.url]) == 2
        assert "404" in capsys.readouterr().err

        # A file with no line that can run: the batch fails, and each line's fault is printed.
        source.write_text("not json\n" + line(0).replace("/v1/completions", "/v1/embeddings") + "\n")
        assert await asyncio.to_thread(main, ["batch", "submit", str(source), "--wait", "--gateway", gateway.url]) == 1
        err = capsys.readouterr().err
        assert "carpool batch: failed: line 1: the line is not valid JSON" in err
        assert "carpool batch: failed: line 2: url must be the batch's endpoint" in err


def test_a_local_file_problem_is_named_as_such_before_anything_is_sent(tmp_path, capsys) -> None:
    # No gateway listens on this port: a problem with a local file must be said before it is ever tried.
    gateway = "http://127.0.0.1:9"
    assert main(["batch", "submit", str(tmp_path / "missing.jsonl"), "--gateway", gateway]) == 1
    err = capsys.readouterr().err
    assert "cannot read" in err and "missing.jsonl" in err and "gateway" not in err, err
    source = tmp_path / "in.jsonl"
    source.write_text(line(0) + "\n")
    out = tmp_path / "no-such-dir" / "out.jsonl"
    assert main(["batch", "submit", str(source), "-o", str(out), "--gateway", gateway]) == 1
    err = capsys.readouterr().err
    assert "cannot write" in err and "no-such-dir" in err and "gateway" not in err, err
