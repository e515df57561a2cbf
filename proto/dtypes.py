"""Wire enums <-> numpy dtypes, and the sets of values the codec accepts (no logic)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from proto import shard_runtime_pb2 as pb
from proto.errors import LocalError

__all__ = ["BUNDLE_VERSION", "PB_TO_NUMPY", "NUMPY_TO_PB", "FLOAT_DTYPES", "COMPRESSIONS",
           "ENCODINGS", "pb_dtype_of"]

# TensorBundle layout generation, versioned apart from the schema.
BUNDLE_VERSION = 1

PB_TO_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_UINT8: np.dtype("u1"),
    pb.DTYPE_INT8: np.dtype("i1"),
    pb.DTYPE_BOOL: np.dtype("?"),
}
NUMPY_TO_PB = {dt: code for code, dt in PB_TO_NUMPY.items()}
FLOAT_DTYPES = frozenset({pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16, pb.DTYPE_FLOAT32})
COMPRESSIONS = frozenset({pb.COMPRESSION_NONE, pb.COMPRESSION_ZSTD})
ENCODINGS = frozenset({pb.TENSOR_ENCODING_RAW, pb.TENSOR_ENCODING_Q8_BLOCK32})


def pb_dtype_of(dtype) -> int:
    """The wire DType of a numpy dtype (LocalError if unsupported)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    try:
        return NUMPY_TO_PB[dt]
    except KeyError:
        raise LocalError(f"unsupported dtype {dt}; use one of "
                         + ", ".join(str(d) for d in PB_TO_NUMPY.values())) from None
