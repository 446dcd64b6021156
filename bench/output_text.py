"""The host's cost of a request's output text per token, as the text grows: detokenization, stop checks, output.

    python -m bench.output_text [--chars 2000,32000,128000] [--tokens 3000]

For each text length, one request of the default model's tokenizer is grown to that many characters of output,
then `--tokens` more tokens go through what the engine does with each (`RequestState.on_token`, then
`take_output`, the step's output), without and with stop strings. A step's cost must not grow with the text
already written: a long output (a reasoning model's tens of thousands of tokens) would otherwise slow every
step of every request beside it. Prints microseconds per token, median of `--rounds`.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from scheduler import SamplingParams
from scheduler.sequence import Sequence
from worker.engine.default_model import build_tokenizer
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.request_state import RequestState
from worker.engine.sampler import SampledToken

TEXT = "lorem ipsum dolor sit amet, consectetur adipiscing elit " * 20


def us_per_token(token_ids: list[int], chars: int, stops: list[str], tokens: int) -> float:
    """Microseconds per token once the output holds `chars` characters."""
    params = SamplingParams(max_tokens=10**9, ignore_eos=True, stop=stops)
    seq = Sequence("r", [1, 2, 3], params)
    state = RequestState(seq, IncrementalDetokenizer(build_tokenizer(), [1, 2, 3]), eos_token_ids=set())

    def feed(token: int) -> None:
        seq.output_token_ids.append(token)
        assert state.on_token(SampledToken(token, None, None)) is None, "the text holds no stop string"
        state.take_output()

    i = 0
    while state.detokenizer.buffer.length < chars:
        feed(token_ids[i % len(token_ids)])
        i += 1
    start = time.perf_counter()
    for k in range(tokens):
        feed(token_ids[k % len(token_ids)])
    return 1e6 * (time.perf_counter() - start) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", default="2000,32000,128000", help="output lengths, comma-separated")
    parser.add_argument("--tokens", type=int, default=3000, help="tokens timed at each length")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    token_ids = build_tokenizer()(TEXT, add_special_tokens=False).input_ids
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}\n")
    print("| output chars | µs per token, no stop strings | µs per token, 2 stop strings |\n|---|---|---|")
    for chars in (int(c) for c in args.chars.split(",")):
        cells = [statistics.median(us_per_token(token_ids, chars, stops, args.tokens) for _ in range(args.rounds))
                 for stops in ([], ["THE END", "\n\nQ:"])]
        print(f"| {chars:,} | {cells[0]:.2f} | {cells[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
