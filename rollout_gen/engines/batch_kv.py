"""The running batch's KV cache on the CPU engine: one buffer per layer with spare rows and columns,
so decoding steps, rows that join and rows that leave touch only their own rows and columns; the
batch is copied only when a buffer runs out of room (`stack`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

CPU = torch.device("cpu")


class _GrowingLayer(DynamicLayer):
    """The running batch's KV for one layer, in buffers [R, H, C, D] with spare rows and columns: rows
    [0, b) and columns [c0, c0 + n) hold the batch. A decoding step writes one column in place
    (DynamicLayer concatenates: a quarter of a step), rows that join are written into spare rows, and
    rows that leave or columns no row uses any more are cut off as views, so the batch's KV is copied
    only when the buffers run out of room."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: int, c0: int, n: int) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._k, self._v = keys, values
        self._b, self._c0, self._n = rows, c0, n
        self._view()

    def _view(self) -> None:
        b, c0, n = self._b, self._c0, self._n
        self.keys, self.values = self._k[:b, :, c0 : c0 + n], self._v[:b, :, c0 : c0 + n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b, n, q = self._b, self._n, key_states.shape[2]
        if self._c0 + n + q > self._k.shape[2]:
            left, room = _spare_left(n), max(n + q, 2 * n, 64)

            def grow(t: torch.Tensor) -> torch.Tensor:
                bigger = t.new_zeros(t.shape[0], t.shape[1], left + room, t.shape[3])
                bigger[:, :, left : left + n] = t[:, :, self._c0 : self._c0 + n]
                return bigger

            self._k, self._v, self._c0 = grow(self._k), grow(self._v), left
        end = self._c0 + n
        self._k[:b, :, end : end + q], self._v[:b, :, end : end + q] = key_states, value_states
        self._n = n + q
        self._view()
        return self.keys, self.values

    def fits(self, rows: int, width: int) -> bool:
        return self._b + rows <= self._k.shape[0] and width <= self._n + self._c0

    def widen(self, width: int) -> None:
        """Take in spare columns on the left until the batch is `width` wide (zeros: padding)."""
        extra = width - self._n
        if extra > 0:
            c0 = self._c0 - extra
            self._k[: self._b, :, c0 : self._c0], self._v[: self._b, :, c0 : self._c0] = 0, 0
            self._c0, self._n = c0, width
            self._view()

    def place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append rows (KV [j, H, m, D], m <= n) right-aligned with the batch, in spare rows."""
        b, j, m, end = self._b, keys.shape[0], keys.shape[2], self._c0 + self._n
        for buf, kv in ((self._k, keys), (self._v, values)):
            buf[b : b + j, :, self._c0 : end - m] = 0
            buf[b : b + j, :, end - m : end] = kv
        self._b = b + j
        self._view()

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        c0, end = self._c0, self._c0 + self._n
        self._k[dst, :, c0:end], self._v[dst, :, c0:end] = self._k[src, :, c0:end], self._v[src, :, c0:end]

    def cut(self, rows: int, start: int) -> None:
        """Keep rows [0, rows) and the columns from `start` on (as views)."""
        self._b, self._c0, self._n = rows, self._c0 + start, self._n - start
        self._view()


def growing(layers: list[tuple[torch.Tensor, torch.Tensor]], rows: int, c0: int, n: int) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [_GrowingLayer(k, v, rows, c0, n) for k, v in layers]
    return cache


def left_pad(rows: list[list[int]], pad_id: int, device: torch.device = CPU) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows right-aligned in one batch behind `pad_id`s: (ids [B, W], mask [B, W], 0 on the padding), on
    `device`, each made in one copy from host lists."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long, device=device).reshape(
        len(rows), width
    )
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=device).reshape(
        len(rows), width
    )
    return ids, mask


def _spare(width: int) -> int:
    """Columns allocated beyond `width` whenever the batch's KV is rebuilt, so the decoding steps that
    follow write in place instead of copying the whole batch to grow it."""
    return max(64, width // 2)


def _spare_left(width: int) -> int:
    """Columns allocated before the batch whenever its KV is rebuilt: rows with a wider context than
    the batch's join by taking them in, without copying the running rows."""
    return max(32, width // 4)


def _spare_rows(rows: int) -> int:
    """Rows allocated beyond the batch whenever its KV is rebuilt, for requests that join later."""
    return max(8, rows // 4)


def stack(
    parts: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]],
) -> tuple[list, torch.Tensor, int, int, int]:
    """Rows of several batches (per layer KV [B, H, W, D] and mask [B, W]) in one, right-aligned, with
    spare rows and columns: (per-layer buffers, mask, rows, first column, width)."""
    width = max(m.shape[1] for _, m in parts)
    rows = sum(m.shape[0] for _, m in parts)
    left = _spare_left(width)
    k0 = parts[0][0][0][0]
    bufs = []
    for li in range(len(parts[0][0])):
        keys = k0.new_zeros(rows + _spare_rows(rows), k0.shape[1], left + width + _spare(width), k0.shape[3])
        values = torch.zeros_like(keys)
        r = 0
        for layers, m in parts:
            rs, cs = slice(r, r + m.shape[0]), slice(left + width - m.shape[1], left + width)
            keys[rs, :, cs], values[rs, :, cs] = layers[li]
            r += m.shape[0]
        bufs.append((keys, values))
    mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for _, m in parts])  # zeros on the left: padding
    return bufs, mask, rows, left, width
