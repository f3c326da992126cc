// Estimate in CUDA C++ (KernelOptions(estimate="cuda"); built and launched by
// cuda/estimate.py through cuda/build.py).
//
// The same step as triton/estimate.py's kernel and the same grid, (rows, 2 + J): program 1 of
// a row writes this step's token into the cache and summarizes the current page when the
// token filled it; programs 0 and 1 compute the sink's and the current page's log-masses
// exactly from their keys; the J others share the row's tiles of middle pages and apply mvar
// (Eq. 2) to their summaries. What differs is how an mvar program reads: each warp takes
// LOADS pages per pass, every lane issuing one 16-byte load per page (lanes 0-15 of a page
// the mean's 128 channels, 16-31 the variance's; two pages per load at D = 64), all LOADS in
// flight at once, and the next tile's block-table entries load while this tile computes. A
// lane's partial sums (LOADS pages x G heads, at most 32) are summed over the page's lanes by
// a reduce-scatter of shuffles, which leaves each lane one (page, head) total to store. Why:
// the Triton kernel is latency-bound (in Nsight Compute: 28% occupancy, DRAM at 33% of peak
// at 131k x 4, each program a chain of dependent loads), 2x its bytes' time
// (docs/design/estimate.md).

// An exact-page program issues its page's id, its keys and the group's queries together, one
// barrier after (not a wait on each query load, then the table, then the keys), and an
// mvar program whose share of the row holds no middle page returns before loading its query
// (vLLM's table is as wide as the longest admitted context: at 8k most programs are idle).
// Together: 16.8 -> 15.0 us at 8k x 32 in a 2,048-page table, 0.1-0.3 us less in the rows'
// own tables. A rolling two-group pipeline (+1.1 to +2.9 us) and the first tile's ids loaded
// beside the row's length (+0.3 to +0.8) lost.
namespace {

#include "common.cuh"

constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr float LOG_PAGE = 4.1588830833596715f;  // log(64): mvar's log |P|

// mirrored field by field by cuda/estimate.py's Params (ctypes); strides in elements, the head
// dim's stride 1
struct Params {
  const bf16* query;
  bf16* key_cache;
  bf16* summaries;
  const int* block_table;
  const int* seq_lens;
  float* log_masses;
  const bf16* new_keys;
  const bf16* new_values;
  bf16* value_cache;
  const i64* slot_mapping;
  i64 stride_qb, stride_qh;
  i64 stride_kp, stride_kt, stride_kh;
  i64 stride_sp, stride_sh, stride_ss;
  i64 stride_bt, stride_lr, stride_lg;
  i64 stride_knb, stride_knh, stride_vnb, stride_vnh;
  i64 stride_vp, stride_vt, stride_vh;
  int num_kv_heads, max_pages, group, dense_below_pages, mvar_programs, num_slots;
  int first_program;  // 0; 2 launches the mvar programs alone (cuda/estimate.py's parts)
  float scale;
};

__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(u32(x) << 16); }

// the 8 bf16 of a 16-byte load as floats (element 0 in the low half of word 0)
__device__ __forceinline__ void unpack8(const uint4& v, float (&x)[8]) {
  const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(words[i] << 16);
    x[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// Request b's new key and value of KV head `head` into their slot (a negative slot, vLLM's
// padding, is not written); the caller's barrier makes them visible to the block.
template <int D>
__device__ void write_new_token(const Params& p, int b, int head) {
  if (b >= p.num_slots) return;
  const i64 slot = p.slot_mapping[b];
  if (slot < 0) return;
  const i64 page = slot / PAGE;
  const i64 offset = slot % PAGE;
  for (int d = threadIdx.x; d < D; d += THREADS) {
    // both loads before either store (a store may alias a load: the compiler would not
    // move the value's load above the key's store)
    const bf16 k = p.new_keys[b * p.stride_knb + head * p.stride_knh + d];
    const bf16 v = p.new_values[b * p.stride_vnb + head * p.stride_vnh + d];
    p.key_cache[page * p.stride_kp + offset * p.stride_kt + head * p.stride_kh + d] = k;
    p.value_cache[page * p.stride_vp + offset * p.stride_vt + head * p.stride_vh + d] = v;
  }
}

// The mean and population variance of a full page's keys, per channel (two passes, as
// triton/summarize.py: no cancellation), rounded to bf16.
template <int D>
__device__ void summarize_page(const Params& p, i64 physical, int head) {
  const int d = threadIdx.x;
  if (d >= D) return;
  const bf16* keys = p.key_cache + physical * p.stride_kp + head * p.stride_kh + d;
  float sum = 0.f;
  for (int t = 0; t < PAGE; ++t) sum += to_float(keys[t * p.stride_kt]);
  const float mean = sum / PAGE;
  float squares = 0.f;
  for (int t = 0; t < PAGE; ++t) {
    const float centered = to_float(keys[t * p.stride_kt]) - mean;
    squares += centered * centered;
  }
  bf16* dst = p.summaries + physical * p.stride_sp + head * p.stride_sh + d;
  dst[0] = to_bf16(mean);
  dst[p.stride_ss] = to_bf16(squares / PAGE);
}

// A barrier of a program's THREADS threads: the whole block in this file's kernels (SLOTS
// = 1), or the 128 threads of one of SLOTS groups that each act as a program
// (estimate_select.cu), by a named barrier per group (0 is __syncthreads')
template <int SLOTS>
__device__ __forceinline__ void program_barrier() {
  if constexpr (SLOTS == 1) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;\n" :: "r"(1 + threadIdx.x / THREADS), "n"(THREADS)
                 : "memory");
  }
}

// The exact log-mass of page `page` for the group's heads: log sum_t exp(s q_g . k_t) over
// its valid tokens. Thread pairs take a token (each half of the channels). SLOTS > 1: each
// group of THREADS threads computes its own page (program_barrier).
template <int D, int GP, int SLOTS = 1>
__device__ void exact_page(const Params& p, int row, int b, int head, int page, int seq_len,
                           const int* row_table) {
  __shared__ float queries[SLOTS][GP][D];  // the group's queries, scaled, float32
  __shared__ float partials[SLOTS][WARPS][GP];
  static_assert(THREADS == 2 * PAGE, "a pair of threads per token");
  const int slot = SLOTS == 1 ? 0 : threadIdx.x / THREADS;
  const unsigned thread = SLOTS == 1 ? threadIdx.x : threadIdx.x % THREADS;
  float (&query)[GP][D] = queries[slot];
  float (&partial)[WARPS][GP] = partials[slot];
  const int token = thread / 2, half = thread % 2;
  const int lane = thread % 32, warp = thread / 32;
  const bool valid = token < seq_len - page * PAGE;
  // the page's id and this thread's keys first, the query beside them, one barrier after
  uint4 kraw[D / 16];
  const i64 physical = row_table[page];
  {
    const bf16* keys = p.key_cache + physical * p.stride_kp + token * p.stride_kt +
                       head * p.stride_kh + half * (D / 2);
#pragma unroll
    for (int c = 0; c < D / 16; ++c)
      kraw[c] = valid ? reinterpret_cast<const uint4*>(keys)[c] : make_uint4(0u, 0u, 0u, 0u);
  }
  constexpr int PER = (GP * D + THREADS - 1) / THREADS;  // query elements per thread
  bf16 qraw[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = thread + k * THREADS, g = i / D, d = i % D;
    qraw[k] = i < GP * D && g < p.group
                  ? p.query[b * p.stride_qb + (i64(head) * p.group + g) * p.stride_qh + d]
                  : bf16(0);
  }
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = thread + k * THREADS;
    if (i < GP * D) query[i / D][i % D] = to_float(qraw[k]) * p.scale;
  }
  program_barrier<SLOTS>();
  float logits[GP];
#pragma unroll
  for (int g = 0; g < GP; ++g) logits[g] = 0.f;
  {
#pragma unroll
    for (int c = 0; c < D / 2; c += 8) {
      float k[8];
      unpack8(kraw[c / 8], k);
#pragma unroll
      for (int g = 0; g < GP; ++g)
#pragma unroll
        for (int j = 0; j < 8; ++j) logits[g] += k[j] * query[g][half * (D / 2) + c + j];
    }
  }
  float peak[GP], total[GP];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    logits[g] += __shfl_xor_sync(FULL, logits[g], 1);  // both halves: the token's logit
    logits[g] = valid ? logits[g] : -infinity();
    peak[g] = logits[g];
#pragma unroll
    for (int o = 2; o < 32; o *= 2) peak[g] = fmaxf(peak[g], __shfl_xor_sync(FULL, peak[g], o));
  }
  if (lane == 0)
#pragma unroll
    for (int g = 0; g < GP; ++g) partial[warp][g] = peak[g];
  program_barrier<SLOTS>();
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    peak[g] = partial[0][g];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) peak[g] = fmaxf(peak[g], partial[w][g]);
    // one thread of a token's pair counts it (a page has a valid token: peak is finite)
    total[g] = valid && half == 0 ? expf(logits[g] - peak[g]) : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) total[g] += __shfl_xor_sync(FULL, total[g], o);
  }
  program_barrier<SLOTS>();  // every warp has read the maxima
  if (lane == 0)
#pragma unroll
    for (int g = 0; g < GP; ++g) partial[warp][g] = total[g];
  program_barrier<SLOTS>();
  if (thread < p.group) {
    const int g = thread;
    float sum = 0.f;
    for (int w = 0; w < WARPS; ++w) sum += partial[w][g];  // g < GP: a dynamic index in smem
    float peak_g = peak[0];
#pragma unroll
    for (int h = 1; h < GP; ++h) peak_g = h == g ? peak[h] : peak_g;
    p.log_masses[row * p.stride_lr + g * p.stride_lg + page] = peak_g + logf(sum);
  }
}

// Sums the lanes' partials over the lanes of a page (offsets below LANES), halving the values
// a lane keeps at each level: a lane that has O set keeps the upper half. With N values left
// at 1, the remaining levels add whole.
template <int N, int O>
__device__ __forceinline__ void reduce_scatter(float* values, int lane) {
  if constexpr (O > 0) {
    if constexpr (N > 1) {
      const bool upper = lane & O;
#pragma unroll
      for (int j = 0; j < N / 2; ++j) {
        const float send = upper ? values[j] : values[j + N / 2];
        const float keep = upper ? values[j + N / 2] : values[j];
        values[j] = keep + __shfl_xor_sync(FULL, send, O);
      }
      reduce_scatter<N / 2, O / 2>(values, lane);
    } else {
      values[0] += __shfl_xor_sync(FULL, values[0], O);
      reduce_scatter<1, O / 2>(values, lane);
    }
  }
}

// mvar's coefficients for a lane's 8 channels from `channel` on: s q (mean), (s q)^2 / 2
// (variance), each of the group's heads (zeros for padding heads)
template <int GP>
__device__ __forceinline__ void mvar_coefficients(const Params& p, int b, int head, int channel,
                                                  bool variance, float (&coef)[GP][8]) {
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    float q[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (g < p.group)
      unpack8(*reinterpret_cast<const uint4*>(
                  p.query + b * p.stride_qb + (i64(head) * p.group + g) * p.stride_qh + channel),
              q);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float scaled = q[j] * p.scale;
      coef[g][j] = variance ? 0.5f * scaled * scaled : scaled;
    }
  }
}

// a lane's partial mvar sums: for each of its N loads (8 channels of a page's mean or
// variance) and each head, the loaded values dotted with the head's coefficients
template <int N, int GP>
__device__ __forceinline__ void mvar_partials(const uint4 (&data)[N], const float (&coef)[GP][8],
                                              float (&values)[N * GP]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float x[8];
    unpack8(data[i], x);
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += coef[g][j] * x[j];
      values[i * GP + g] = sum;
    }
  }
}

// which of N values a lane ends with after reduce_scatter<N, LANES / 2>: its halving, replayed
template <int N, int LANES>
__device__ __forceinline__ int first_value_of(int lane) {
  int first_value = 0, n = N;
#pragma unroll
  for (int o = LANES / 2; o > 0; o /= 2)
    if (n > 1) {
      first_value += (lane & o) ? n / 2 : 0;
      n /= 2;
    }
  return first_value;
}

template <int D, int GP>
struct MvarShape {
  static constexpr int LANES = D / 4;               // 16-byte chunks of a page's two summaries
  static constexpr int PAGES_PER_LOAD = 32 / LANES;  // 1 at D = 128, 2 at D = 64
  static constexpr int LOADS = GP >= 8 ? 4 : 8;     // in flight per lane per pass
  static constexpr int VALUES = LOADS * GP;         // a lane's partial sums, at most 32
  static constexpr int WARP_PAGES = LOADS * PAGES_PER_LOAD;
  static constexpr int TILE = WARPS * WARP_PAGES;   // pages per program per pass
  static constexpr int KEPT = VALUES > LANES ? VALUES / LANES : 1;  // totals left per lane
  // the reduction's last levels, where a total is already whole and lanes hold copies
  static constexpr int COPIES_MASK = VALUES < LANES ? LANES / VALUES - 1 : 0;
};

template <int D, int GP, int SLOTS = 1>
__device__ void mvar_pages(const Params& p, int row, int b, int head, int last,
                           const int* row_table, int program) {
  typedef MvarShape<D, GP> S;
  const int tiles = cdiv(max(last, 0), S::TILE);  // tiles holding a middle page (< last)
  const int share = cdiv(tiles, p.mvar_programs);
  const int first = program * share;
  const int end = min(first + share, tiles);
  if (first >= end) return;  // before the query's loads: idle programs of a wide table
  const int lane = threadIdx.x % 32;
  const int warp = SLOTS == 1 ? threadIdx.x / 32 : threadIdx.x / 32 % WARPS;
  const int in_page = lane % S::LANES;
  const int sub = lane / S::LANES;  // which page of a load
  const bool variance = in_page >= D / 8;
  const int channel = (in_page % (D / 8)) * 8;
  float coef[GP][8];
  mvar_coefficients<GP>(p, b, head, channel, variance, coef);
  // which (load, head) total this lane ends with
  const int first_value = first_value_of<S::VALUES, S::LANES>(lane);
  const bool stores = (lane & S::COPIES_MASK) == 0;
  const bf16* lane_summaries = p.summaries + head * p.stride_sh +
                               (variance ? p.stride_ss : 0) + channel;
  float* dst = p.log_masses + row * p.stride_lr;
  const int warp_first = warp * S::WARP_PAGES + sub;
  int ids[S::LOADS];  // physical pages of this pass's middle pages, -1 elsewhere
#pragma unroll
  for (int i = 0; i < S::LOADS; ++i) {
    const int page = first * S::TILE + warp_first + i * S::PAGES_PER_LOAD;
    ids[i] = page > 0 && page < last ? row_table[page] : -1;
  }
  for (int tile = first; tile < end; ++tile) {
    uint4 data[S::LOADS];
#pragma unroll
    for (int i = 0; i < S::LOADS; ++i)
      data[i] = ids[i] >= 0
          ? *reinterpret_cast<const uint4*>(lane_summaries + i64(ids[i]) * p.stride_sp)
          : make_uint4(0u, 0u, 0u, 0u);
    // the next tile's entries, in flight while this one computes
#pragma unroll
    for (int i = 0; i < S::LOADS; ++i) {
      const int page = (tile + 1) * S::TILE + warp_first + i * S::PAGES_PER_LOAD;
      ids[i] = tile + 1 < end && page > 0 && page < last ? row_table[page] : -1;
    }
    float values[S::VALUES];
    mvar_partials(data, coef, values);
    reduce_scatter<S::VALUES, S::LANES / 2>(values, lane);
    if (stores) {
#pragma unroll
      for (int k = 0; k < S::KEPT; ++k) {
        const int value = first_value + k;
        const int g = value % GP;
        const int page = tile * S::TILE + warp_first + (value / GP) * S::PAGES_PER_LOAD;
        if (g < p.group && page > 0 && page < last)
          dst[g * p.stride_lg + page] = values[k] + LOG_PAGE;
      }
    }
  }
}

template <int D, int GP>
__device__ void estimate_program(const Params& p) {
  const int row = blockIdx.x;
  const int block = blockIdx.y + p.first_program;
  const int b = row / p.num_kv_heads;
  const int head = row % p.num_kv_heads;
  const int* row_table = p.block_table + b * p.stride_bt;
  const int seq_len = p.seq_lens[b];
  const int pages_in_row = min(cdiv(seq_len, PAGE), p.max_pages);
  const int last = pages_in_row - 1;
  if (block == 1) {
    if (p.num_slots > 0) {  // this step's token first: the current page's keys include it
      write_new_token<D>(p, b, head);
      __syncthreads();
    }
    if (pages_in_row > 0 && seq_len == pages_in_row * PAGE)  // the step filled the page
      summarize_page<D>(p, row_table[last], head);
  }
  if (pages_in_row <= p.dense_below_pages) return;  // Select keeps the whole row
  if (block < 2) {
    // program 0: the sink, program 1: the current page; a single page is program 1's alone
    if (pages_in_row == 0 || (block == 0 && last == 0)) return;
    exact_page<D, GP>(p, row, b, head, block == 0 ? 0 : last, seq_len, row_table);
    return;
  }
  mvar_pages<D, GP>(p, row, b, head, last, row_table, block - 2);
}

}  // namespace

#ifndef MOIRA_DEVICE_ONLY  // estimate_select.cu takes the functions, not the kernels
// blocks per SM that ptxas is to fit (its register budget, 65,536 / (THREADS x this); 0: its
// own choice): cuda/estimate.py passes tuning "estimate.cuda_min_blocks_per_sm"; at most 4 at
// G = 8 (5 spill)
#ifndef ESTIMATE_MIN_BLOCKS
#define ESTIMATE_MIN_BLOCKS 0
#endif
#define MIN_BLOCKS(GP) (GP >= 8 && ESTIMATE_MIN_BLOCKS > 4 ? 4 : ESTIMATE_MIN_BLOCKS)

#define MOIRA_ESTIMATE(D, GP)                                                      \
  extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS(GP))            \
      moira_estimate_d##D##_g##GP(const Params p) {                                \
    estimate_program<D, GP>(p);                                                    \
  }

MOIRA_ESTIMATE(64, 1)
MOIRA_ESTIMATE(64, 2)
MOIRA_ESTIMATE(64, 4)
MOIRA_ESTIMATE(64, 8)
MOIRA_ESTIMATE(128, 1)
MOIRA_ESTIMATE(128, 2)
MOIRA_ESTIMATE(128, 4)
MOIRA_ESTIMATE(128, 8)
#endif
