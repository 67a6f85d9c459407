"""The runner's block tables: one int array row per request, fed only by ``TableDeltas``.

A step's block tables are then one gather from this array (vLLM's worker keeps the same
structure). Rows are recycled and zero past each table (padding reads block 0, masked out by
``seq_lens``); columns grow on demand. Torch-free: tensor-parallel ranks each keep one, fed the
same deltas, so every rank reads the same block ids.
"""

from __future__ import annotations

import numpy as np

from kvledger.cache.table_delta import TableDeltas


class BlockTable:
    def __init__(self, rows: int = 16, cols: int = 64) -> None:
        self.array = np.zeros((rows, cols), dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)  # entries per row
        self.index: dict[str, int] = {}  # request id -> row
        self._free_rows = list(range(rows - 1, -1, -1))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.index

    def __len__(self) -> int:
        return len(self.index)

    def apply(self, deltas: TableDeltas, group: int = 0) -> None:
        """Bring the rows up to date with the manager's tables of KV cache group ``group``
        (idempotent for one ``deltas``)."""
        for rid in deltas.removed:
            row = self.index.pop(rid, None)
            if row is not None:
                self.array[row, : self.num_blocks[row]] = 0
                self.num_blocks[row] = 0
                self._free_rows.append(row)
        for d in deltas.changed:
            if d.group != group:
                continue
            row = self.index.get(d.request_id)
            if row is None:
                row = self._new_row()
                self.index[d.request_id] = row
            end = d.start + len(d.block_ids)
            if end > self.array.shape[1]:
                self._grow_cols(end)
            old = int(self.num_blocks[row])
            if end < old:
                self.array[row, end:old] = 0
            self.array[row, d.start : end] = d.block_ids
            self.num_blocks[row] = end

    def rows(self, request_ids: list[str]) -> list[int]:
        index = self.index
        return [index[r] for r in request_ids]

    def table(self, request_id: str) -> list[int]:
        row = self.index[request_id]
        return self.array[row, : self.num_blocks[row]].tolist()

    def _new_row(self) -> int:
        if not self._free_rows:
            n = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _grow_cols(self, n: int) -> None:
        cols = max(n, 2 * self.array.shape[1])
        grown = np.zeros((self.array.shape[0], cols), dtype=np.int64)
        grown[:, : self.array.shape[1]] = self.array
        self.array = grown
