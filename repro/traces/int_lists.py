"""The "[3, 5]" expert-list cells of a CSV routing table, parsed in one compiled pass over Arrow's string buffers
(repro.traces.tabular imports this only for CSV, so other formats do not pay numba's import). Arrow's regex match,
trim, split and cast of these cells had taken most of a CSV import's time.

Legend: n cells.
"""

from __future__ import annotations

import numba
import numpy as np
import pyarrow as pa


def string_buffers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(int32 or int64 offsets[n + 1], uint8 data) of a string / large_string array, zero-copy."""
    _, offsets, data = column.buffers()
    width = 8 if pa.types.is_large_string(column.type) else 4
    offsets = np.frombuffer(offsets, dtype=np.int64 if width == 8 else np.int32, count=len(column) + 1,
                            offset=column.offset * width)
    return offsets, np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)


@numba.njit(cache=True)
def parse_int_lists(offsets, data, null):  # pragma: no cover (compiled)
    """(int64 flat values, int64[n] lengths, bool[n] malformed) of n text cells, each matching repro.traces.tabular.INT_LIST_PATTERN
    (whitespace: tab, newline, form feed, carriage return, space, as RE2's \\s); a null or malformed cell has
    length 0. Integers of more than 18 digits count as malformed (they overflow int64 and no expert id is that large)."""
    n = len(offsets) - 1
    flat = np.empty(len(data) // 2 + 1, dtype=np.int64)  # a number and its separator take >= 2 bytes
    lengths = np.zeros(n, dtype=np.int64)
    malformed = np.zeros(n, dtype=np.bool_)
    count = 0
    for row in range(n):
        if null[row]:
            continue
        i, end, start_count = offsets[row], offsets[row + 1], count
        ok = True
        while i < end and (data[i] == 32 or 9 <= data[i] <= 10 or 12 <= data[i] <= 13):
            i += 1
        if i < end and data[i] == 91:  # '['
            i += 1
        else:
            ok = False
        expect_number = False  # after ','; "[" alone may be followed by "]"
        first = True
        while ok:
            while i < end and (data[i] == 32 or 9 <= data[i] <= 10 or 12 <= data[i] <= 13):
                i += 1
            if i < end and data[i] == 93 and not expect_number:  # ']'
                i += 1
                break
            if not (first or expect_number):
                ok = False
                break
            negative = i < end and data[i] == 45  # '-'
            if negative:
                i += 1
            digits, value = 0, 0
            while i < end and 48 <= data[i] <= 57:
                value = value * 10 + (data[i] - 48)
                digits += 1
                i += 1
            if digits == 0 or digits > 18:
                ok = False
                break
            flat[count] = -value if negative else value
            count += 1
            first = False
            while i < end and (data[i] == 32 or 9 <= data[i] <= 10 or 12 <= data[i] <= 13):
                i += 1
            expect_number = i < end and data[i] == 44  # ','
            if expect_number:
                i += 1
            elif not (i < end and data[i] == 93):
                ok = False
        while ok and i < end and (data[i] == 32 or 9 <= data[i] <= 10 or 12 <= data[i] <= 13):
            i += 1
        if ok and i == end:
            lengths[row] = count - start_count
        else:
            malformed[row] = True
            count = start_count
    return flat[:count], lengths, malformed
