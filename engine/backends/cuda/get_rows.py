"""Token embeddings: rows of a (possibly quantized) table as float32 (kernels/get_rows.cu)."""

from __future__ import annotations

from ...errors import BrassError
from .common import F32, TYPE_NAMES, CudaWeight, i32
from .params import pack

GET_ROWS_THREADS = 256


def launched_kernels() -> list[tuple[str, str]]:
    return [("get_rows.cu", f"get_rows_{n}") for n in TYPE_NAMES.values()]


def embed(b, table, ids):
    ids = i32(ids, "embed ids").reshape(-1)
    if not isinstance(table, CudaWeight) or len(table.shape) != 2:
        raise BrassError("embed: expected a 2-D weight table")
    n_rows, D = table.shape
    y = b._out((ids.size, D), F32)
    if ids.size:
        b.launch("get_rows.cu", f"get_rows_{TYPE_NAMES[table.type]}",
                 (-(-D // GET_ROWS_THREADS), ids.size), GET_ROWS_THREADS, table.data, ids, y,
                 params=pack("GetRowsParams", n_ids=ids.size, n_cols=D, row_bytes=table.row_bytes,
                             n_table_rows=n_rows))
    return y
