"""A variant's purified rows, staged one sorted file per bucket (purifier/beam_pipeline.GroupStage), read back for the
commit in (prompt_id, sample_idx) order a chunk at a time: the driver holds the keys of every row and one chunk's
rows, not the partition (benchmarks/bench_purify_memory.py). The order is the one sort of all the rows gives, so a
partition that fits one chunk is committed as the same bytes as when it was sorted whole."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from purifier.batch import SORT
from storage.schemas import PURIFIED

# Tokens (prompt + response) of the rows committed at a time: one row group of the committed part. 2^20 tokens
# is 64 rows of 16k tokens; a demo partition is one chunk.
COMMIT_TOKENS = 1 << 20


class _Cursor:
    """One sorted staged file read forward, a row group (beam_pipeline.STAGED_ROW_GROUP_TOKENS) at a time."""

    def __init__(self, path: Path) -> None:
        # one row group read at a time and no batch reader kept open between reads: Arrow reads a nested
        # column's row group whole, and an open reader holds its decoding buffers
        self.file, self.next_group = pq.ParquetFile(path), 0
        self.buffered: list[pa.Table] = []
        self.rows = 0

    def take(self, n: int) -> pa.Table:
        """The file's next `n` rows."""
        while self.rows < n:
            batch = self.file.read_row_group(self.next_group, use_threads=False)
            self.next_group += 1
            self.buffered.append(batch)
            self.rows += batch.num_rows
        table = pa.concat_tables(self.buffered)
        head, rest = table.slice(0, n), table.slice(n)
        self.buffered, self.rows = ([rest] if rest.num_rows else []), rest.num_rows
        return head


def _keys(files: list[Path]) -> pa.Table:
    """Every staged row's sort key, file, row in its file and tokens, in commit order."""
    tables = []
    for k, f in enumerate(files):
        t = pq.read_table(f, columns=["prompt_id", "sample_idx", "prompt_ids", "response_ids"])
        tokens = pc.add(
            pc.fill_null(pc.list_value_length(t["prompt_ids"]), 0),
            pc.fill_null(pc.list_value_length(t["response_ids"]), 0),
        )
        tables.append(
            pa.table(
                {
                    "prompt_id": t["prompt_id"],
                    "sample_idx": t["sample_idx"],
                    "file": pa.array(np.full(t.num_rows, k, dtype=np.int32)),
                    "row": pa.array(np.arange(t.num_rows, dtype=np.int64)),
                    "tokens": tokens,
                }
            )
        )
    return pa.concat_tables(tables).sort_by(SORT) if tables else pa.table({"file": [], "row": [], "tokens": []})


def sorted_chunks(files: list[Path], budget: int | None = None) -> Iterator[pa.Table]:
    """The rows of `files` (each sorted by SORT) in SORT order, in chunks of at most `budget` tokens (at least one
    row each). Each file's rows of a chunk are its next ones, so each file is read forward once."""
    budget = budget or COMMIT_TOKENS
    keys = _keys(files)
    of_file = keys["file"].to_numpy()
    rows = keys["row"].to_numpy()
    tokens = keys["tokens"].to_numpy()
    for k, f in enumerate(files):  # read forward, a file out of order would commit rows out of order
        if np.any(np.diff(rows[of_file == k]) < 0):
            raise ValueError(f"{f}: staged rows not in (prompt_id, sample_idx) order")
    cursors = [_Cursor(f) for f in files]
    start, n = 0, len(of_file)
    while start < n:
        end, total = start + 1, int(tokens[start])
        while end < n and total + tokens[end] <= budget:
            total += int(tokens[end])
            end += 1
        chunk_files, chunk_rows = of_file[start:end], rows[start:end]
        pieces, offsets, offset = [], np.zeros(len(files), dtype=np.int64), 0
        for k in np.unique(chunk_files):
            mine = chunk_rows[chunk_files == k]
            offsets[k] = offset - int(mine[0])  # this file's first row of the chunk sits at `offset`
            pieces.append(cursors[k].take(len(mine)))
            offset += len(mine)
        chunk = pa.concat_tables(pieces)
        yield chunk.take(pa.array(offsets[chunk_files] + chunk_rows)).cast(PURIFIED)
        start = end
