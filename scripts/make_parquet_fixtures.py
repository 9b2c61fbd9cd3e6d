#!/usr/bin/env python3
"""Writes the tiny Parquet fixtures of src/data's tests, as Hugging Face `datasets` writes its
Parquet files (pyarrow, a nullable `text` string column beside others, several row groups):
tests/fixtures/hf_tiny_snappy.parquet (pyarrow's default codec, and `datasets`'),
hf_tiny_zstd.parquet, and hf_tiny_gzip.parquet (a codec Tessera refuses by name).

    pip install pyarrow && python3 scripts/make_parquet_fixtures.py

The rows are fixed; the tests in src/data/format_tests.rs spell them out again.
"""
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

ROWS = [
    'Hello "world"\n',
    None,
    "Second doc: caf\u00e9",
    "",
    "third",
]

out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
table = pa.table({
    "id": pa.array(range(len(ROWS)), type=pa.int64()),
    "text": pa.array(ROWS, type=pa.string()),
    "url": pa.array([f"https://example.org/{i}" for i in range(len(ROWS))], type=pa.string()),
})
for codec in ["snappy", "zstd", "gzip"]:
    path = out / f"hf_tiny_{codec}.parquet"
    pq.write_table(table, path, compression=codec, row_group_size=2)
    print(path, path.stat().st_size, "bytes")
