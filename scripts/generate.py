#!/usr/bin/env python3
"""Greedy generation on the built-in tiny model: AFD (1A1F) against colocated.

    .venv/bin/python scripts/generate.py [--model DIR] [--max-tokens N] [--engine-args JSON]

The AFD run is the patched vLLM with ``afd_config={"spawn_ffn": true}``: the
attention engine starts its FFN rank as a separate process and every layer's
MLP runs there, over the gloo connector. The colocated run is stock vLLM,
imported from the pristine tree that ``apply_patches.py fetch`` caches. Each
run is its own process, so the two never share state. Prompts of mixed
lengths and a small token budget per step make vLLM chunk the long prefills
and mix them with decodes. Prints both token lists, whether they match, and
the time per output token of each; exits non-zero if they differ.

The runs are ``vllm_afd_dev.harness.generate``'s (``scripts/setup_env.sh``
installs the package into the venv).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_afd_dev.harness.generate import DEFAULT_MODEL, compare_afd_with_colocated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--engine-args", default="{}", help="JSON, merged over the defaults")
    args = parser.parse_args()
    same = compare_afd_with_colocated(args.model, args.max_tokens, json.loads(args.engine_args))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
