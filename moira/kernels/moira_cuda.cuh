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

// d += a b: a 16x16 bf16 (row), b 16x8 bf16 (col), d 16x8 float32 (mma.m16n8k16; lane l
// holds a's rows l / 4 and l / 4 + 8 at k = 2 (l % 4) + {0, 1} and + 8, b's k rows
// 2 (l % 4) + {0, 1} and + 8 of column l / 4, d's rows l / 4 and l / 4 + 8 at columns
// 2 (l % 4) + {0, 1}; two bf16 per register, the lower k or column in the low half)
__device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0,
                                    u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
