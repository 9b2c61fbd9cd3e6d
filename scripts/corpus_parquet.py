#!/usr/bin/env python3
"""Writes the shipped corpus (data/corpus/austen.txt) as a Parquet file the way Hugging Face
`datasets` writes one (pyarrow, a `text` string column, one row a paragraph, several row groups),
for runs that take `--data corpus.parquet` (scripts/gpu_verify.sh: a LLaMA folder fine-tuned on it).

    pip install pyarrow && python3 scripts/corpus_parquet.py OUT.parquet
"""
import pathlib
import sys

import pyarrow as pa
import pyarrow.parquet as pq

if len(sys.argv) != 2:
    sys.exit("usage: corpus_parquet.py OUT.parquet")
root = pathlib.Path(__file__).resolve().parent.parent
text = (root / "data" / "corpus" / "austen.txt").read_text(encoding="utf-8")
paragraphs = [p.strip() + "\n" for p in text.split("\n\n") if p.strip()]
table = pa.table({"text": pa.array(paragraphs, type=pa.string())})
pq.write_table(table, sys.argv[1], compression="zstd", row_group_size=2048)
print(f"{sys.argv[1]}: {len(paragraphs)} paragraphs, {sum(map(len, paragraphs))} characters")
