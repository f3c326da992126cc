"""Moira's Triton kernels, one file per stage, each with its launcher.

The launchers here check nothing: ``moira.decode`` validates inputs once per public call and
hands over tensors of known shapes. Every launch grid depends only on shapes (never on values in
GPU memory), so a whole decode step can be captured in a CUDA graph.
"""

from triton import knobs


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(knobs.runtime.interpret)


def _fix_interpreter():
    """Work around three bugs of Triton 3.6's CPU interpreter (no effect on GPU runs).

    - tl.dot on bf16: bf16 is stored as uint16 and those integers reach np.matmul, which returns
      garbage. Widen bf16 operands to float32 first (exact).
    - float32 -> bf16 casts truncate; the GPU rounds to nearest even. Round like the GPU.
    - Scalars loaded from memory are 1-element arrays, and ``range(scalar)`` calls
      ``int(array)``, which NumPy >= 2.4 refuses for arrays of one dimension.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_moira_fixed", False):
        return
    builder = interpreter.InterpreterBuilder
    original_dot = builder.create_dot
    original_patch = interpreter._patch_lang_tensor
    original_cast = builder.cast_impl

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            data = (handle.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round half to even
            return interpreter.TensorHandle(bits.astype(np.uint16), tl.bfloat16)
        return original_cast(self, src, dst_type)

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).item()))

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._moira_fixed = True


if interpreting():
    _fix_interpreter()
