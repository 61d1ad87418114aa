"""A generation process: what ``generate.run`` and its kin start.

    python -m vllm_afd_dev.harness.worker --model DIR --engine-args JSON \\
        --max-tokens N --out RESULT.json [--prompts 0,2,5] [--dp-done-dir DIR] \
        [--go-file PATH] [--images]

Builds an ``LLM`` with ``generate.ENGINE_ARGS`` and the given engine
arguments merged over them, warms it up, finds where the decoder layers'
FFNs live in its model (``generate.ffn_placement``, on every TP worker),
generates ``PROMPTS[i]`` for each i of ``--prompts`` (default: all) greedily
and writes the tokens, the time per step and the placements to ``--out``.
``--dp-done-dir``: as an offline data-parallel rank, hold the engine until
every rank has written its result there (``generate.start_dp_ranks``).
``--go-file``: once warmed up, say "ready to generate" and wait for that
file to exist before generating (processes that must generate at once).
``--images``: every other prompt with a seeded image (``image_prompts``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from vllm_afd_dev.harness.generate import ENGINE_ARGS, PROMPTS, ffn_placement, image_prompts


def generate(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    engine_args = {**ENGINE_ARGS, **json.loads(args.engine_args)}
    prompts = [PROMPTS[i] for i in args.prompts] if args.prompts else PROMPTS
    if args.images:
        prompts = image_prompts(args.model, prompts)
    llm = LLM(model=str(args.model), **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    # From its module (not __main__), so the engine's processes can import it.
    placements = llm.apply_model(ffn_placement)  # one per TP worker
    if args.go_file is not None:
        print("ready to generate", flush=True)
        while not args.go_file.exists():
            time.sleep(0.05)
    print(f"generating {len(prompts)} prompts x {args.max_tokens} tokens", flush=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
    wall = time.perf_counter() - start
    import vllm

    result = {
        "vllm": str(Path(vllm.__file__).parent),
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "ms_per_step": 1000 * wall / args.max_tokens,
        **placements[0],
        "placements": placements,
    }
    Path(args.out).write_text(json.dumps(result))
    if args.dp_done_dir is not None:
        wait_for_every_dp_rank(args.dp_done_dir)


DP_PAUSE_S = 15.0
"""At most 31 dummy steps: well under a second on a GPU; seen at up to
0.3 s a step with both roles on a 2-core CPU machine."""


def wait_for_every_dp_rank(done_dir: Path, timeout_s: float = 600) -> None:
    """Offline data parallel: hold this rank's LLM (and with it its engine)
    until every rank has generated. A DP engine steps in lockstep until all
    ranks are done, and collecting its LLM earlier starts vLLM's shutdown
    grace, after which vLLM kills the engine."""
    rank, size = os.environ["VLLM_DP_RANK"], int(os.environ["VLLM_DP_SIZE"])
    (done_dir / f"rank{rank}.done").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(done_dir.glob("rank*.done"))) < size and time.monotonic() < deadline:
        time.sleep(0.5)
    # Then, as vLLM's own data-parallel example does, let the engines pause:
    # after the last request they still step in lockstep (dummy batches) up
    # to their next all-reduce of unfinished work, every 32 steps. A rank
    # shut down before that leaves its peer stuck in a step's collectives
    # until vLLM kills it, and that peer's FFN rank sees it vanish.
    time.sleep(DP_PAUSE_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--engine-args", default="{}", help="JSON, merged over ENGINE_ARGS")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--prompts",
        type=lambda v: [int(i) for i in v.split(",") if i],
        help="indices into PROMPTS (default: all)",
    )
    parser.add_argument("--dp-done-dir", type=Path, help="as an offline data-parallel rank")
    parser.add_argument("--go-file", type=Path, help="generate once this file exists")
    parser.add_argument(
        "--images", action="store_true", help="every other prompt with an image (image_prompts)"
    )
    generate(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
