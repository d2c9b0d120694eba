"""Make Triton's CPU interpreter round `tl.fma` once, as GPUs do.

The interpreter evaluates fma(x, y, z) as x * y + z in the operands' dtype: two roundings. The
kernels' sample placement (sampling.pixel_cell) relies on fma's single rounding for an exact
cell choice. In float64 a product of two float32 values is exact and adding z rounds at most
once more for the operands the kernels use, so the interpreter then matches the GPU bit for bit
there. Applied when msda is imported with TRITON_INTERPRET=1 (tests, debugging); float64 fma is
left as it was (the kernels use fma only for float32 placement).
"""

import numpy as np
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
