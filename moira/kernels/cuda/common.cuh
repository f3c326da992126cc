// What this folder's CUDA kernels share (attend.cu, estimate.cu, select.cu include it inside
// their anonymous namespace; build.py puts this folder on NVRTC's include path). No system
// header: NVRTC builds with torch's own libnvrtc, whose built-in headers lack cuda_bf16.h,
// so a bf16 is handled as its 16 bits and converted by PTX.
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
