#!/usr/bin/env python3
"""Rebuild data/corpus/austen.txt from Debian's r-cran-janeaustenr package.

Usage (from the repository root, as any user):
    apt-get download r-cran-janeaustenr
    dpkg-deb -x r-cran-janeaustenr_*_all.deb /tmp/janeaustenr
    python3 scripts/extract_austen_corpus.py \
        /tmp/janeaustenr/usr/lib/R/site-library/janeaustenr/data \
        data/corpus/austen.txt

The package stores each novel as an R character vector (one element per
line) inside R's lazy-load database (Rdata.rdx index + Rdata.rdb blobs).
This script contains a minimal reader for R's XDR serialisation format,
enough for character vectors, integer vectors, lists and pairlists, so R
itself is not needed. The lines are joined with "\n", the novels with a
blank line; nothing else is changed.
"""
import gzip
import struct
import sys
import zlib

NOVELS = [
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
]


class RReader:
    """Reads one object in R's XDR ("X\\n") serialisation format."""

    def __init__(self, buf):
        self.buf = buf
        self.pos = 0
        self.refs = []

    def int(self):
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def bytes(self, n):
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def header(self):
        magic = self.bytes(2)
        if magic != b"X\n":
            raise ValueError(f"not XDR serialisation: {magic!r}")
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader version
        if version == 3:
            self.bytes(self.int())  # native encoding name

    def item(self):
        flags = self.int()
        kind = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind == 255:  # REFSXP
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if kind == 1:  # SYMSXP
            sym = ("sym", self.item())
            self.refs.append(sym)
            return sym
        if kind == 2:  # LISTSXP (pairlist)
            return self.pairlist(has_attr, has_tag)
        if kind == 9:  # CHARSXP
            n = self.int()
            return None if n == -1 else self.bytes(n).decode("utf-8")
        if kind in (10, 13):  # LGLSXP, INTSXP
            n = self.int()
            value = list(struct.unpack_from(f">{n}i", self.buf, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # REALSXP
            n = self.int()
            value = list(struct.unpack_from(f">{n}d", self.buf, self.pos))
            self.pos += 8 * n
        elif kind in (16, 19):  # STRSXP, VECSXP
            value = [self.item() for _ in range(self.int())]
        else:
            raise ValueError(f"unsupported R type {kind} at byte {self.pos}")
        attrs = self.item() if has_attr else None
        return {"value": value, "attrs": attrs}

    def pairlist(self, has_attr, has_tag):
        if has_attr:
            self.item()
        tag = self.item() if has_tag else None
        car = self.item()
        cdr = self.item()
        rest = cdr if isinstance(cdr, list) else []
        return [(tag, car)] + rest


def attr(obj, name):
    for tag, value in obj["attrs"] or []:
        if tag == ("sym", name):
            return value
    return None


def read_object(raw):
    reader = RReader(raw)
    reader.header()
    return reader.item()


def main(data_dir, out_path):
    with gzip.open(f"{data_dir}/Rdata.rdx", "rb") as fh:
        index = read_object(fh.read())
    names = attr(index, "names")["value"]
    variables = index["value"][names.index("variables")]
    var_names = attr(variables, "names")["value"]
    with open(f"{data_dir}/Rdata.rdb", "rb") as fh:
        rdb = fh.read()
    novels = []
    for novel in NOVELS:
        offset, length = variables["value"][var_names.index(novel)]["value"]
        blob = rdb[offset : offset + length]
        raw = zlib.decompress(blob[4:])
        lines = read_object(raw)["value"]
        novels.append("\n".join(line or "" for line in lines).strip("\n"))
    with open(out_path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write("\n\n\n".join(novels) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
