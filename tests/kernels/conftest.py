"""These tests load torch: set it up before any of them imports it."""

import tests.harness.torch_setup  # noqa: F401
