"""Container health probe: GET http://127.0.0.1:<port><path>, exit 0 on a 2xx.

Usage: healthcheck.py PATH PORT_ENV_VAR DEFAULT_PORT
The port is read from the named CARPOOL_* variable so the probe follows the
same setting the process listens on. Standard library only: the images carry
no curl.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    path, port_var, default_port = argv
    port = os.environ.get(port_var) or default_port
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as response:
            return 0 if 200 <= response.status < 300 else 1
    except (urllib.error.URLError, OSError) as e:
        print(f"{path} on port {port}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
