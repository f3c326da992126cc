// What this folder's CUDA kernels share (attend_cuda.cu, estimate_cuda.cu, select_cuda.cu
// include it inside their anonymous namespace; cuda_build.py puts this folder on NVRTC's
// include path). No system header: NVRTC builds with torch's own libnvrtc, whose built-in
// headers lack cuda_bf16.h, so a bf16 is handled as its 16 bits and converted by PTX.
#pragma once

typedef unsigned short bf16;  // a bfloat16's bits
typedef unsigned int u32;
typedef long long i64;

constexpr int PAGE = 64;  // tokens per page (config.PAGE_SIZE)
constexpr unsigned FULL = 0xffffffffu;  // every lane of a warp

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ bf16 to_bf16(float x) {  // round to nearest even
  bf16 bits;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(bits) : "f"(x));
  return bits;
}

// 16 bytes from global to shared memory by cp.async, through the L2 only (.cg) or also the L1
// (L1: where this block's own threads may just have stored to that global memory, which the
// L2 path need not see yet); bytes < 16 zero-fills the rest (0: a token past seq_len, a page
// outside the table)
template <bool L1 = false>
__device__ __forceinline__ void cp_async16(void* shared, const void* global, int bytes) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  if constexpr (L1) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(address), "l"(global), "r"(bytes));
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(address), "l"(global), "r"(bytes));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING));
}
