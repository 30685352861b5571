"""`python -m sglang.launch_server` for tests: serves the embedded engine (`dreamgym serve`),
which speaks SGLang's HTTP API, with the flags `infra/engine/sglang.build_command` passes.

--model-path, --host, --port and --api-key are honoured; SGLang's GPU flags (--tp-size,
--mem-fraction-static, --dtype, ...) are accepted and ignored. Extra `section.key=value`
settings for `dreamgym serve` come from SGLANG_STANDIN_OVERRIDES (space-separated), e.g. the
weights root a test's run directory needs for /update_weights_from_disk.
"""

from __future__ import annotations

import argparse
import os
import sys

from infra.cli import main

if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key", default=None)
    args, _gpu_flags = p.parse_known_args()
    argv = ["serve", *os.environ.get("SGLANG_STANDIN_OVERRIDES", "").split(),
            "--model", args.model_path, "--host", args.host, "--port", str(args.port)]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    sys.exit(main(argv))
