"""Make Triton's CPU interpreter round `tl.fma` once, and convert bfloat16 to and from types other
than float32, as GPUs do.

The interpreter evaluates fma(x, y, z) as x * y + z in the operands' dtype: two roundings. The
kernels' sample placement (sampling.pixel_cell) relies on fma's single rounding for an exact
cell choice. In float64 a product of two float32 values is exact and adding z rounds at most
once more for the operands the kernels use, so the interpreter then matches the GPU bit for bit
there. Applied when msda is imported with TRITON_INTERPRET=1 (tests, debugging); float64 fma is
left as it was (the kernels use fma only for float32 placement).

The interpreter holds bfloat16 as uint16 words and converts them only to and from float32; any
other conversion, such as the float64 kernels' output stored into a bfloat16 tensor, was numpy's
`astype(uint16)`, an integer read as bfloat16 bits: garbage, no error (a bfloat16 value with float64
locations gave a relative error of 1). Those go through float32 here, as GPUs without a direct
conversion do (sm_80-89; Triton's float64 -> float32 step there keeps the rounding right).
"""

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def _fma_rounded_once(self, x, y, z):
    if z.data.dtype == np.float32:
        with np.errstate(invalid="ignore", over="ignore"):  # inf * W - inf is NaN on a GPU too
            exact = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
            return interpreter.TensorHandle(exact.astype(np.float32), z.dtype.scalar)
    return _interpreter_fma(self, x, y, z)


_interpreter_fma = interpreter.InterpreterBuilder.create_fma
if getattr(_interpreter_fma, "__name__", "") != "_fma_rounded_once":
    interpreter.InterpreterBuilder.create_fma = _fma_rounded_once


def _bfloat16_through_float32(self, src, dst_type):
    source, target = src.dtype.scalar, dst_type.scalar
    if (source == tl.bfloat16) == (target == tl.bfloat16) or tl.float32 in (source, target):
        return _interpreter_cast(self, src, dst_type)
    if target == tl.bfloat16:
        return _interpreter_cast(self, interpreter.TensorHandle(src.data.astype(np.float32), tl.float32), dst_type)
    as_float32 = _interpreter_cast(self, src, tl.float32).data
    return interpreter.TensorHandle(as_float32.astype(interpreter._get_np_dtype(dst_type)), target)


_interpreter_cast = interpreter.InterpreterBuilder.cast_impl
if getattr(_interpreter_cast, "__name__", "") != "_bfloat16_through_float32":
    interpreter.InterpreterBuilder.cast_impl = _bfloat16_through_float32
