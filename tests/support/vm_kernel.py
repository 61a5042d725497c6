"""Decompress a Linux bzImage into the plain ELF ``vmlinux`` QEMU can boot with ``-kernel``.

    python3 vm_kernel.py vmlinuz-6.1.0-X-amd64 vmlinux

Under emulation the kernel's own decompressor costs about 3 s of every boot; decompressing
once at build time saves it. The bzImage holds one compressed payload (Debian's: xz; gzip and
zstd are tried too): its start is found by the format's magic bytes, and the first candidate
that decompresses to an ELF file wins (the magic can also occur by chance earlier).
"""

from __future__ import annotations

import gzip
import lzma
import sys
import zlib

ELF_MAGIC = b"\x7fELF"
MAGICS = {
    "xz": b"\xfd7zXZ\x00",
    "gzip": b"\x1f\x8b\x08",
}


def _xz(data: bytes) -> bytes:
    return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)


def _gzip(data: bytes) -> bytes:
    return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)


DECODERS = {"xz": _xz, "gzip": _gzip}


def extract(image: bytes) -> bytes:
    """The ELF kernel inside ``image``. Raises ValueError naming the formats tried."""
    candidates = []
    for name, magic in MAGICS.items():
        at = image.find(magic)
        while at != -1:
            candidates.append((at, name))
            at = image.find(magic, at + 1)
    for at, name in sorted(candidates):
        try:
            out = DECODERS[name](image[at:])
        except (lzma.LZMAError, zlib.error, EOFError, gzip.BadGzipFile):
            continue
        if out.startswith(ELF_MAGIC):
            return out
    raise ValueError(f"no {'/'.join(MAGICS)} payload that decompresses to an ELF kernel "
                     f"({len(candidates)} candidate offset(s) tried)")


def main(argv: list) -> int:
    if len(argv) != 2:
        print("usage: vm_kernel.py BZIMAGE VMLINUX", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        image = f.read()
    try:
        kernel = extract(image)
    except ValueError as exc:
        print(f"vm_kernel: {argv[0]}: {exc}", file=sys.stderr)
        return 1
    with open(argv[1], "wb") as f:
        f.write(kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
