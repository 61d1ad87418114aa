"""build-wheel: an official vLLM wheel with the series and overlay laid in.

The wheel keeps its name, tags and requirements; its version gains the local
label ``+afd.<series hash>`` so that pip (and ``pip show``) tell a patched
install from a stock one, and RECORD is regenerated for the changed files.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import shutil
import tempfile
import zipfile
from pathlib import Path

from .fetch import download_wheel, parse_spec, unpack_wheel
from .series import Series, SeriesError
from .tree import VllmTree


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _dist_info(root: Path) -> Path:
    infos = list(root.glob("*.dist-info"))
    if len(infos) != 1:
        raise SeriesError(f"expected one .dist-info in the wheel, found {infos}")
    return infos[0]


def _set_version(root: Path, local: str) -> tuple[str, str, Path]:
    """Add ``+local`` to the version in METADATA and the dist-info name."""
    info = _dist_info(root)
    name, version = info.name.removesuffix(".dist-info").rsplit("-", 1)
    new_version = f"{version}+{local}"
    meta = info / "METADATA"
    lines = meta.read_text().splitlines(keepends=True)
    lines = [f"Version: {new_version}\n" if ln.startswith("Version: ") else ln for ln in lines]
    meta.write_text("".join(lines))
    new_info = info.with_name(f"{name}-{new_version}.dist-info")
    info.rename(new_info)
    return name, new_version, new_info


def _write_record(root: Path, info: Path) -> list[Path]:
    """Write RECORD (CSV: names may hold commas) and return every file."""
    record = info / "RECORD"
    files = sorted(p for p in root.rglob("*") if p.is_file() and p != record)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for p in files:
        data = p.read_bytes()
        writer.writerow([p.relative_to(root).as_posix(), _record_hash(data), len(data)])
    writer.writerow([record.relative_to(root).as_posix(), "", ""])
    record.write_text(buf.getvalue())
    return files + [record]


def build_wheel(source: str, out_dir: Path, series: Series, log=print) -> Path:
    """Build the patched wheel from ``source`` (a spec or a .whl path)."""
    if source.endswith(".whl"):
        wheel = Path(source)
        if not wheel.is_file():
            raise SeriesError(f"no wheel file at {wheel}")
    else:
        wheel = download_wheel(*parse_spec(source), log=log)
    work = Path(tempfile.mkdtemp(prefix="afd-wheel-"))
    try:
        log(f"[1/4] unpacking {wheel.name}")
        root = unpack_wheel(wheel, work / "tree", log=log)
        log(f"[2/4] applying {len(series.patches)} patches and {len(series.overlay)} overlay files")
        VllmTree(root).apply(series, log=lambda m: log("      " + m))
        name, version, info = _set_version(root, f"afd.{series.hash}")
        log(f"[3/4] version {version}: regenerating RECORD")
        files = _write_record(root, info)
        tags = wheel.name.removesuffix(".whl").split("-")[-3:]
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / f"{name}-{version}-{'-'.join(tags)}.whl"
        log(f"[4/4] writing {target} ({len(files)} files)")
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
            # dist-info last, as the wheel spec recommends
            ordered = sorted(files, key=lambda p: (info in p.parents, p.as_posix()))
            for i, p in enumerate(ordered, 1):
                zf.write(p, p.relative_to(root).as_posix())
                if i % 1000 == 0 or i == len(ordered):
                    log(f"      {i}/{len(ordered)} files")
        partial.rename(target)
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)
