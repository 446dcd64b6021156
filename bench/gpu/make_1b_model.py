"""The 1B-parameter Llama (random weights, bf16 on load) used for GPU measurements.

    python -m bench.gpu.make_1b_model /tmp/m1b
"""

from __future__ import annotations

import sys

from worker.engine.default_model import create_tiny_model


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/m1b"
    create_tiny_model(path, hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                      intermediate_size=5632, max_position_embeddings=8192, initializer_range=0.02)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
