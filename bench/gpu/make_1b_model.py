"""The 1B-parameter Llama (random weights, bf16 on load) used for GPU measurements.

    python -m bench.gpu.make_1b_model /tmp/m1b
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from worker.engine.default_model import create_tiny_model


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.make_1b_model", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default="/tmp/m1b",
                        help="the folder to write the checkpoint to (about 3.7 GB of fp32 weights; default /tmp/m1b)")
    path = parser.parse_args(argv).path
    create_tiny_model(path, hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                      intermediate_size=5632, max_position_embeddings=8192, initializer_range=0.02)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
