"""Shrink a CUDA wheel (fbgemm-gpu) to the device code of one GPU architecture, without CUDA's tools.

The CUDA build of fbgemm-gpu is a 465 MB wheel (2.5 GB unpacked): every ``.so`` carries cubins for sm_80,
sm_90 and sm_100 in its ``.nv_fatbin`` section. A machine reached only by copying files needs a far smaller
one. This script rewrites each fat binary *in place* (the ELF layout, sizes and addresses are unchanged):

* a kept container is compacted to its entries for ``--arch`` (what ``nvprune`` would leave); the bytes after
  it, up to the container's old end, become zeros;
* a dropped container (every one of a library named by ``--drop-lib``, or one whose CUDA source file, read
  from the ``_INTERNAL_<hash>_<n>_<file>_cu`` symbols of its cubin, matches ``--drop-source``) keeps one entry
  header of another architecture with a zeroed payload: the GPU finds no image for itself there, exactly as
  with a library built for other GPUs, and only a launch of one of its kernels fails ("no kernel image is
  available"). A container whose source cannot be read (a zstd-compressed cubin without the ``zstandard``
  package) is kept.

The wheel is written again with LZMA-compressed members (``zipfile.ZIP_LZMA``; pip installs it as any wheel)
and a RECORD with the new hashes: cubins compress about 25x with LZMA against 8x with deflate.

Fat binary layout (public reverse-engineering, e.g. cuda-fatbin tools): a container header
``<IHHQ``: magic 0xBA55ED50, version, header size, size of the entries; each entry header ``<HHIQ IIHHIII QQQ``:
kind (1 PTX, 2 cubin), version, header size, payload size, ..., arch (e.g. 90), ..., flags (0x8000: the
payload is zstd-compressed), ..., uncompressed size.

    python scripts/prune_fatbin.py IN.whl OUT.whl --arch 90 [--drop-lib NAME ...] [--drop-source REGEX]
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import re
import struct
import sys
import zipfile
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Pattern, Tuple

MAGIC = 0xBA55ED50
CONTAINER = struct.Struct("<IHHQ")
ENTRY = struct.Struct("<HHIQIIHHIIIQQQ")
ARCH_OFFSET = 28  # byte offset of the arch field in an entry header
FLAG_ZSTD = 0x8000
SOURCE = re.compile(rb"_INTERNAL_[0-9a-f]{8}_\d+_(\w+?)_cu(?:_|\b)")


def nv_fatbin(data: bytes) -> Optional[Tuple[int, int]]:
    """(file offset, size) of the ELF64 section ``.nv_fatbin``, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx][4]
    for name, _typ, _flags, _addr, off, size in heads:
        end = data.index(b"\0", strtab + name)
        if data[strtab + name : end] == b".nv_fatbin":
            return off, size
    return None


def containers(data: bytes, off: int, size: int) -> Iterator[Tuple[int, int, List[Dict[str, int]]]]:
    """(offset, end, entries) of each fat binary container in the section (8-byte aligned, maybe padded)."""
    pos, end = off, off + size
    while pos + CONTAINER.size <= end:
        magic, _ver, hsize, fsize = CONTAINER.unpack_from(data, pos)
        if magic != MAGIC:
            pos += 8
            continue
        cend = pos + hsize + fsize
        entries = []
        e = pos + hsize
        while e < cend:
            kind, _v, ehsize, psize, *_r, arch, _no, _nl, flags, _z, _dsize = ENTRY.unpack_from(data, e)
            entries.append(dict(off=e, kind=kind, hsize=ehsize, size=psize, arch=arch, flags=flags))
            e += ehsize + psize
        yield pos, cend, entries
        pos = cend


def payload(data: bytes, e: Dict[str, int]) -> bytes:
    raw = data[e["off"] + e["hsize"] : e["off"] + e["hsize"] + e["size"]]
    if e["flags"] & FLAG_ZSTD:
        try:
            import zstandard
        except ImportError:
            return b""  # unknown contents: the caller keeps the container
        return zstandard.ZstdDecompressor().decompressobj().decompress(raw)
    return raw


def source(data: bytes, entry: Dict[str, int]) -> Optional[str]:
    """The CUDA source file a cubin was compiled from (``gen_embedding_forward_ssd_weighted_kernel``), the
    one its internal symbols name most often; None if unreadable."""
    body = payload(data, entry)
    names = Counter(m.group(1).decode() for m in SOURCE.finditer(body))
    return names.most_common(1)[0][0] if names else None


def prune(
    data: bytes, arch: int, drop_all: bool, drop_source: Optional[Pattern[str]], stats: Dict[str, Any]
) -> Optional[bytes]:
    """The library with its fat binaries reduced to ``arch`` (None: it has none)."""
    found = nv_fatbin(data)
    if found is None:
        return None
    out = bytearray(data)
    for start, end, entries in containers(data, *found):
        keep = [e for e in entries if e["arch"] == arch]
        if not keep:
            stats["containers_without_arch"] += 1
            continue
        name = None if drop_all or drop_source is None else source(data, keep[0])
        dropped = drop_all or bool(name and drop_source is not None and drop_source.search(name))
        if name and dropped:
            stats["dropped_sources"].append(name)
        if dropped:
            # one entry of another architecture, payload zeroed: no image for this GPU in the container
            other = next((e for e in entries if e["arch"] != arch), None)
            keep = [other] if other is not None else []
        hsize = CONTAINER.unpack_from(data, start)[2]
        pos = start + hsize
        body = bytearray()
        for e in keep:
            chunk = bytearray(data[e["off"] : e["off"] + e["hsize"] + e["size"]])
            if dropped:
                chunk[e["hsize"] :] = bytes(e["size"])
            body += chunk
        out[pos : pos + len(body)] = body
        out[pos + len(body) : end] = bytes(end - pos - len(body))
        struct.pack_into("<Q", out, start + 8, len(body))
        stats["containers_dropped" if dropped else "containers_kept"] += 1
        stats["bytes_kept"] += 0 if dropped else len(body)
    return bytes(out)


def record_line(name: str, body: bytes) -> List[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(body))]


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel_in")
    p.add_argument("wheel_out")
    p.add_argument("--arch", type=int, default=90, help="SM architecture to keep (90: H100/H200)")
    p.add_argument("--drop-lib", nargs="*", default=[], help="library stems whose device code goes")
    p.add_argument("--drop-source", default=None, help="regex: device code of matching CUDA sources goes")
    args = p.parse_args(argv)
    stats: Dict[str, Any] = {
        "containers_kept": 0,
        "containers_dropped": 0,
        "containers_without_arch": 0,
        "bytes_kept": 0,
        "dropped_sources": [],
    }
    drop_source = re.compile(args.drop_source) if args.drop_source else None
    with zipfile.ZipFile(args.wheel_in) as zin:
        infos = zin.infolist()
        record_name = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        rows: List[List[str]] = []
        with zipfile.ZipFile(args.wheel_out, "w", compression=zipfile.ZIP_LZMA) as zout:
            for info in infos:
                if info.filename == record_name:
                    continue
                body = zin.read(info)
                if info.filename.endswith(".so"):
                    stem = info.filename.rsplit("/", 1)[-1][: -len(".so")]
                    before = dict(stats)
                    pruned = prune(body, args.arch, stem in args.drop_lib, drop_source, stats)
                    if pruned is not None:
                        body = pruned
                        kept = stats["containers_kept"] - before["containers_kept"]
                        gone = stats["containers_dropped"] - before["containers_dropped"]
                        print(f"{info.filename}: {kept} containers kept (sm_{args.arch}), {gone} dropped")
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.external_attr = info.external_attr
                out.compress_type = zipfile.ZIP_LZMA
                zout.writestr(out, body)
                rows.append(record_line(info.filename, body))
            rows.append([record_name, "", ""])
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows)
            zout.writestr(record_name, buf.getvalue())
    print(
        f"{args.wheel_out}: {stats['containers_kept']} containers kept, {stats['containers_dropped']} dropped, "
        f"{stats['containers_without_arch']} without sm_{args.arch} left as they were; "
        f"{stats['bytes_kept'] / 1e6:.1f} MB of device code kept; dropped sources: "
        f"{', '.join(sorted(stats['dropped_sources'])) or 'none'}"
    )


if __name__ == "__main__":
    sys.exit(main())
