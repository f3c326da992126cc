// Select in CUDA C++ (KernelOptions(select="cuda"); built and launched by cuda/select.py
// through cuda/build.py).
//
// The same rule and outputs as triton/select.py's kernel (its docstring is the
// specification): per (request, KV head) row, the group-mean softmax share of every page,
// then K_B-way bisection on the threshold (coverage: the kept middle mass reaches gamma minus
// the forced pages' share; fixed count: exactly top_k - 2 middle pages, ties in page order),
// then the list compacted in page order. One program per row, as the paper's Alg. 1; what
// differs is its width: a program runs up to 512 threads, P pages each (thread t holds pages
// [t P, t P + P)), and each pass's K_B sums are reduced across the block with one barrier,
// where the Triton kernel's 4 warps hold 16 pages per thread and its ~2,800 straight-line
// instructions wait on instruction fetches (in Nsight Compute: 9.2 us at 131k x 4 on 32 SMs;
// docs/design/select.md).

namespace {

#include "common.cuh"

constexpr int MAX_GROUP = 8;
constexpr int MAX_WARPS = 16;  // 512 threads

// mirrored field by field by cuda/select.py's Params (ctypes)
struct Params {
  const float* log_masses;
  const int* seq_lens;
  const float* row_values;  // a keep fraction (fractions) or a target (row_gammas) per row
  int* page_lists;
  int* page_counts;
  i64 stride_lr, stride_lg, stride_pb, stride_ph, stride_cb, stride_ch, stride_vb, stride_vh;
  int num_kv_heads, max_pages, group, top_k, dense_below_pages;
  int fixed_count, fractions, row_gammas;
  float gamma;
};

struct Sum {
  template <typename T>
  __device__ __forceinline__ static T apply(T a, T b) { return a + b; }
  template <typename T>
  __device__ __forceinline__ static T identity() { return T(0); }
};
struct Max {  // of floats
  template <typename T>
  __device__ __forceinline__ static T apply(T a, T b) { return a > b ? a : b; }
  template <typename T>
  __device__ __forceinline__ static T identity() { return -infinity(); }
};

// N values reduced over the block: each warp's lanes first (a reduce-scatter of shuffles
// while values remain, then whole), one barrier, then every warp combines the warps' results
// from shared memory at once: lane l takes the entries l, l + 32, ... (value l % N of
// several warps), shuffles add the lanes that share a value, and each value is broadcast
// from the lane that holds it. No loop over the warps: a runtime loop there was unrolled into
// ~600 instructions per reduction. `buffer` ([MAX_WARPS][N]) must not be read by a
// reduction still in progress: callers alternate two buffers.
template <typename Op, typename T, int N>
__device__ __forceinline__ void block_reduce(T (&values)[N], T* buffer) {
  static_assert(N <= 32 && 32 % N == 0, "N divides a warp");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  T mine[N];
#pragma unroll
  for (int j = 0; j < N; ++j) mine[j] = values[j];
  int n = N, first = 0;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    if (n > 1) {
      const bool upper = lane & o;
#pragma unroll
      for (int j = 0; j < N / 2; ++j) {
        if (j < n / 2) {
          const T send = upper ? mine[j] : mine[j + n / 2];
          const T keep = upper ? mine[j + n / 2] : mine[j];
          mine[j] = Op::apply(keep, __shfl_xor_sync(FULL, send, o));
        }
      }
      first += upper ? n / 2 : 0;
      n /= 2;
    } else {
      mine[0] = Op::apply(mine[0], __shfl_xor_sync(FULL, mine[0], o));
    }
  }
  // with N < 32 values, the lanes past N hold copies: the first N lanes' (lane & copies == 0)
  constexpr int copies = 32 / N - 1;
  if ((lane & copies) == 0) buffer[warp * N + first] = mine[0];
  __syncthreads();
  T total = Op::template identity<T>();
#pragma unroll
  for (int i = 0; i < (MAX_WARPS * N + 31) / 32; ++i) {
    const int entry = lane + 32 * i;  // warp entry / N's value entry % N == lane % N
    if (entry < warps * N) total = Op::apply(total, buffer[entry]);
  }
#pragma unroll
  for (int o = 16; o >= N; o /= 2) total = Op::apply(total, __shfl_xor_sync(FULL, total, o));
#pragma unroll
  for (int j = 0; j < N; ++j) values[j] = __shfl_sync(FULL, total, j);
}

// (exclusive prefix of `count` over the threads in order, total over the block)
__device__ __forceinline__ int block_exclusive_scan(int count, int* buffer, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int inclusive = count;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int before = __shfl_up_sync(FULL, inclusive, o);
    if (lane >= o) inclusive += before;
  }
  if (lane == 31) buffer[warp] = inclusive;
  __syncthreads();
  int offset = 0;
  total = 0;
  for (int w = 0; w < warps; ++w) {
    const int warp_total = buffer[w];
    offset += w < warp ? warp_total : 0;
    total += warp_total;
  }
  return offset + inclusive - count;
}

// K_B-way bisection on the threshold (Alg. 1): each pass tries WAYS evenly spaced thresholds
// in [lo, hi), sums measure(share, threshold) over the block's pages for each (T: a count or
// a mass), and keeps the sub-interval where enough(sum) turns false; 24 bits in all.
// `buffers`: two reduction buffers of `stride` elements, used in turn.
template <int P, int WAYS, typename T, typename Measure, typename Enough>
__device__ __forceinline__ void bisect(const float (&candidate)[P], float& lo, float& hi,
                                       Measure measure, Enough enough, T* buffers, int stride,
                                       int& turn) {
  constexpr int PASSES = WAYS == 2 ? 24 : WAYS == 4 ? 12 : WAYS == 8 ? 8 : 6;
  static_assert(WAYS == 2 || WAYS == 4 || WAYS == 8 || WAYS == 16, "K_B");
  for (int pass = 0; pass < PASSES; ++pass) {
    T sums[WAYS];
    float tau[WAYS];
#pragma unroll
    for (int j = 0; j < WAYS; ++j) {
      tau[j] = lo + (hi - lo) * (float(j) / WAYS);
      sums[j] = T(0);
#pragma unroll
      for (int k = 0; k < P; ++k) sums[j] += measure(candidate[k], tau[j]);
    }
    block_reduce<Sum>(sums, buffers + turn * stride);
    turn ^= 1;
    float new_lo = lo, new_hi = hi;
#pragma unroll
    for (int j = 0; j < WAYS; ++j) {
      const bool above_target = enough(sums[j]);
      new_lo = fmaxf(new_lo, above_target ? tau[j] : lo);
      new_hi = fminf(new_hi, above_target ? hi : tau[j]);
    }
    lo = new_lo;
    hi = new_hi;
  }
}

// The same bisection with K_B = 64 (4 passes of 6 bits), each pass's 64 sums from one
// histogram instead of 64 comparisons per page: a page inside [lo, hi) adds its measure to
// the bin of the largest threshold it reaches (an atomic in shared memory), and the sum at a
// threshold is the bins' suffix sum from it plus the sum at or above hi, carried from the
// pass before, as is the sum at lo (bin 0 is never accumulated: in the first pass most
// pages fall there and its atomics would queue). A thread's work per pass is O(P), not
// O(P K_B), so 64 ways cost about what 4 did, in a third of the passes. The measures are
// integers (a count, or a share in fixed point), so the sums do not depend on the atomics'
// order and every run selects the same pages. The thresholds are the compared form's;
// `hi` must start above every share (the sum there is 0) and `lo` at or below the lowest
// middle share (the sum there is taken in the first pass).
constexpr int BINS = 64;

__device__ __forceinline__ float threshold(float lo, float hi, int j) {
  return lo + (hi - lo) * (float(j) / BINS);  // as bisect's tau[j]
}

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) value += __shfl_xor_sync(FULL, value, o);
  return value;
}

template <int P, typename T, typename Measure, typename Enough>
__device__ __forceinline__ void bisect_binned(const float (&candidate)[P], float& lo, float& hi,
                                              Measure measure, Enough enough) {
  constexpr int PASSES = 4;
  // three histograms in turn: one filled, one read, one being zeroed for the pass after
  // next (a barrier lies between each of those steps and the next use); slot BINS of the
  // first holds the sum at the starting lo
  __shared__ T hist[3][BINS + 1];
  for (int i = threadIdx.x; i < 3 * (BINS + 1); i += blockDim.x) (&hist[0][0])[i] = T(0);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  T at_lo = T(0), at_hi = T(0);
  {
    T mine = T(0);
#pragma unroll
    for (int k = 0; k < P; ++k) mine += candidate[k] >= lo ? measure(candidate[k]) : T(0);
    mine = warp_sum(mine);
    if (lane == 0) atomicAdd(&hist[0][BINS], mine);  // read after the first pass's barrier
  }
  for (int pass = 0; pass < PASSES; ++pass) {
    T* bins = hist[pass % 3];
    const float scale = BINS / (hi - lo);  // used only where lo <= share < hi, so hi > lo
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const float share = candidate[k];
      if (share >= lo && share < hi) {
        // clamped before the conversion (inf, or NaN where scale is inf and share == lo,
        // would be undefined): fminf drops a NaN, and the loops below correct the bin
        int j = int(fminf((share - lo) * scale, float(BINS - 1)));
        // the bin of the largest threshold it reaches, by the thresholds themselves (the
        // estimate may be a bin off, more where thresholds an ulp apart round alike)
        while (j + 1 < BINS && share >= threshold(lo, hi, j + 1)) ++j;
        while (j > 0 && share < threshold(lo, hi, j)) --j;
        if (j > 0) atomicAdd(&bins[j], measure(share));
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < BINS + 1; i += blockDim.x) hist[(pass + 2) % 3][i] = T(0);
    if (pass == 0) at_lo = hist[0][BINS];
    // every warp alike: lane l holds bins 2l and 2l + 1; suffix sums over the lanes
    const T even_bin = bins[2 * lane], odd_bin = bins[2 * lane + 1];
    T suffix = even_bin + odd_bin;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const T after = __shfl_down_sync(FULL, suffix, o);
      if (lane + o < 32) suffix += after;
    }
    const T at_even = lane == 0 ? at_lo : at_hi + suffix;  // the sums at thresholds 2l, 2l + 1
    const T at_odd = at_hi + suffix - even_bin;
    // the sums fall as the threshold rises: the largest threshold still enough
    const unsigned even_enough = __ballot_sync(FULL, enough(at_even));
    const unsigned odd_enough = __ballot_sync(FULL, enough(at_odd));
    int best = -1;
    if (even_enough) best = 2 * (31 - __clz(even_enough));
    if (odd_enough) best = max(best, 2 * (31 - __clz(odd_enough)) + 1);
    const int above = best + 1;  // the lowest threshold not enough (BINS: hi)
    const T sum_best = __shfl_sync(FULL, (best & 1) ? at_odd : at_even, max(best, 0) >> 1);
    const T sum_above = __shfl_sync(FULL, (above & 1) ? at_odd : at_even,
                                    min(above, BINS - 1) >> 1);
    const float new_lo = best >= 0 ? threshold(lo, hi, best) : lo;
    const float new_hi = above < BINS ? threshold(lo, hi, above) : hi;
    at_hi = best < 0 ? at_lo : (above < BINS ? sum_above : at_hi);
    at_lo = best >= 0 ? sum_best : at_lo;
    lo = new_lo;
    hi = best < 0 ? lo : new_hi;
  }
}

// shares in fixed point for the binned passes' sums: 2^40 per unit, rounded down (the
// target rounded up), so a kept mass that reaches the target in fixed point reaches it
constexpr float FIXED_ONE = 1099511627776.0f;  // 2^40

template <int P, int WAYS, int GP>
__device__ void select_row(const Params& p) {
  static_assert(GP <= MAX_GROUP, "G");
  // two reduction buffers in turn, each [MAX_WARPS][max(K_B values reduced, GP)] (the
  // binned passes reduce none)
  constexpr int REDUCED = WAYS == BINS ? 1 : WAYS;
  constexpr int WIDTH = MAX_WARPS * (REDUCED > GP ? REDUCED : GP);
  __shared__ float float_buffers[2][WIDTH];
  __shared__ int int_buffers[2][WIDTH];
  int turn = 0;

  const int row = blockIdx.x;
  const int b = row / p.num_kv_heads;
  const int head = row % p.num_kv_heads;
  const int n = min(cdiv(p.seq_lens[b], PAGE), p.max_pages);
  int* lists = p.page_lists + b * p.stride_pb + head * p.stride_ph;
  int* count_out = p.page_counts + b * p.stride_cb + head * p.stride_ch;
  if (n == 0) {
    if (threadIdx.x == 0) *count_out = 0;
    return;
  }
  if (n <= p.dense_below_pages) {  // short row: every page (Estimate skipped it)
    for (int page = threadIdx.x; page < n; page += blockDim.x) lists[page] = page;
    if (threadIdx.x == 0) *count_out = n;
    return;
  }
  // lane tiers, as the Triton kernel's: a row that fits in half the pages per thread runs
  // that build, whose per-thread work (loads, exponentials, passes) and code are half this
  // one's; the program's width is the table's, so without them a short row in a wide table
  // cost as much as a full one (measured +3.9 to +7.5 us per layer with 8k-64k rows in a
  // 2,048-page table)
  if constexpr (P > 1) {
    if (n <= int(blockDim.x) * (P / 2)) {
      select_row<P / 2, WAYS, GP>(p);
      return;
    }
  }
  const int base = threadIdx.x * P;  // this thread's pages: [base, base + P)
  const float* masses = p.log_masses + row * p.stride_lr;

  // group-mean share of every page: each head's softmax, then their mean. A thread loads its
  // pages of every head at once, at addresses clamped into the row and to a real head (so no
  // load waits behind a branch: loads in per-head branches ran one after another), and keeps
  // its own maximum and sum; the block combines them. An estimate that is NaN or +inf takes
  // no part in its head's softmax, and its page is unreadable (the reference's `unreadable`):
  // kept below, never dropped unseen (-inf is a mass of zero). Bit k: page base + k.
  float peak[GP], total[GP];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    const float* head_masses = masses + min(g, p.group - 1) * p.stride_lg;
    float ell[P];
#pragma unroll
    for (int k = 0; k < P; ++k) ell[k] = head_masses[min(base + k, n - 1)];
    peak[g] = -infinity();
#pragma unroll
    for (int k = 0; k < P; ++k) {
      // (false for NaN and +inf)
      ell[k] = g < p.group && base + k < n && ell[k] <= 3.402823466e38f ? ell[k] : -infinity();
      peak[g] = fmaxf(peak[g], ell[k]);
    }
    total[g] = 0.f;
#pragma unroll
    for (int k = 0; k < P; ++k) total[g] += __expf(ell[k] - peak[g]);
    total[g] = peak[g] == -infinity() ? 0.f : total[g];  // no page here: not NaN
  }
  float row_peak[GP];
#pragma unroll
  for (int g = 0; g < GP; ++g) row_peak[g] = peak[g];
  block_reduce<Max>(row_peak, float_buffers[turn]);
  turn ^= 1;
#pragma unroll
  for (int g = 0; g < GP; ++g)  // this thread's sum, rescaled to the row's maximum
    total[g] = peak[g] == -infinity() ? 0.f : total[g] * __expf(peak[g] - row_peak[g]);
  block_reduce<Sum>(total, float_buffers[turn]);
  turn ^= 1;
  // a product, not a quotient per page: a division's slow-path branch kept the loads below
  // from being issued together
  float weight[GP];  // 1 / (G total_g), 0 for padding heads
#pragma unroll
  for (int g = 0; g < GP; ++g)  // a head without a finite estimate: 0, not infinite
    weight[g] = g < p.group && total[g] > 0.f ? 1.f / (total[g] * p.group) : 0.f;
  const int last = n - 1;
  float candidate[P];  // a middle page's share, -1 elsewhere (below every threshold)
#pragma unroll
  for (int k = 0; k < P; ++k) candidate[k] = 0.f;
#pragma unroll
  for (int g = 0; g < GP; ++g) {  // the loads above again, from L1
    const float* head_masses = masses + min(g, p.group - 1) * p.stride_lg;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const float ell = head_masses[min(base + k, n - 1)];
      // a NaN or +inf estimate makes the page's sum +inf, which marks it unreadable below;
      // weight 0: a head with no readable estimate, whose peak is -inf (-inf - -inf is NaN)
      candidate[k] += g >= p.group ? 0.f
                      : !(ell <= 3.402823466e38f) ? infinity()
                      : weight[g] > 0.f ? __expf(ell - row_peak[g]) * weight[g] : 0.f;
    }
  }
  float edges[2] = {-1.f, 0.f};  // (top middle share, the sink's and current page's shares)
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int page = base + k;
    const bool unknown = page < n && !(candidate[k] <= 3.402823466e38f);
    const float share = page < n && !unknown ? candidate[k] : 0.f;
    // an unreadable middle page: above every share (at most 1) under a fixed count, so it
    // ranks first; -0 under the coverage rule, a share of 0 to the bisection whose sign marks
    // the page for keeping (no register held across the bisection: one spilled)
    candidate[k] = page > 0 && page < last ? (unknown ? (p.fixed_count ? 2.f : -0.f) : share)
                                           : -1.f;
    edges[1] += (page == 0 || page == last) ? share : 0.f;  // page 0 once when last == 0
  }
  {
    float top[1] = {-1.f};
#pragma unroll
    for (int k = 0; k < P; ++k) top[0] = fmaxf(top[0], candidate[k]);
    block_reduce<Max>(top, float_buffers[turn]);
    turn ^= 1;
    float forced[1] = {edges[1]};
    block_reduce<Sum>(forced, float_buffers[turn]);
    turn ^= 1;
    edges[0] = top[0];
    edges[1] = forced[0];
  }
  const float top = edges[0], forced = edges[1];
  bool keep[P];

  if (p.fixed_count) {
    int top_k = p.top_k;
    if (p.fractions) {
      const float fraction = p.row_values[b * p.stride_vb + head * p.stride_vh];
      // rounded at each step, as the reference's torch ops (a fused multiply-add differs
      // where fraction * n lies within an ulp of k + 1/2)
      top_k = max(int(floorf(__fadd_rn(__fmul_rn(fraction, float(n)), 0.5f))), 2);
    }
    const int needed = top_k - 2;
    float lo = top * 0.f;
    float hi = top * (1.f + 1e-6f) + 1e-30f;  // strictly above every share
    if constexpr (WAYS == BINS) {
      bisect_binned<P, int>(candidate, lo, hi, [](float) { return 1; },
                            [needed](int above) { return above >= needed; });
    } else {
      bisect<P, WAYS, int>(
          candidate, lo, hi, [](float share, float tau) { return int(share >= tau); },
          [needed](int above) { return above >= needed; }, &int_buffers[0][0], WIDTH, turn);
    }
    // every page above hi, then pages tied in [lo, hi) in page order up to the count
    int sure_here = 0, tied_here = 0;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      sure_here += candidate[k] >= hi;
      tied_here += candidate[k] >= lo && candidate[k] < hi;
    }
    int sure[1] = {sure_here};
    block_reduce<Sum>(sure, int_buffers[turn]);
    turn ^= 1;
    const int missing = needed - sure[0];
    int tied_total;
    int tied_before = block_exclusive_scan(tied_here, int_buffers[turn], tied_total);
    turn ^= 1;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const bool tied = candidate[k] >= lo && candidate[k] < hi;
      tied_before += tied;  // inclusive of this page
      keep[k] = candidate[k] >= hi || (tied && tied_before <= missing);
      if (n <= top_k) keep[k] = base + k > 0 && base + k < last;
    }
  } else {
    const float gamma = p.row_gammas ? p.row_values[b * p.stride_vb + head * p.stride_vh]
                                     : p.gamma;
    // a margin above float32 rounding of the sums: the kept mass reaches gamma even where
    // rounding makes it ambiguous, at the cost of a page there
    const float target = gamma - forced + 2e-6f;
    float lo = top * 0.f, hi = top;
    if constexpr (WAYS == BINS) {
      typedef unsigned long long u64;
      hi = top * (1.f + 1e-6f) + 1e-30f;  // above every share: the sum there is 0
      const u64 fixed_target = target > 0.f ? __double2ull_ru(double(target) * FIXED_ONE) : 0;
      bisect_binned<P, u64>(candidate, lo, hi,
                            [](float share) { return __float2ull_rz(share * FIXED_ONE); },
                            [fixed_target](u64 mass) { return mass >= fixed_target; });
    } else {
      bisect<P, WAYS, float>(
          candidate, lo, hi, [](float share, float tau) { return share >= tau ? share : 0.f; },
          [target](float mass) { return mass >= target; }, &float_buffers[0][0], WIDTH, turn);
    }
    // gamma = 1 keeps every page (even shares that underflow to 0); a target the forced
    // pages already meet keeps no middle page
    lo = gamma >= 1.f ? -0.5f : (gamma - forced <= 0.f ? 2.f : lo);
#pragma unroll
    for (int k = 0; k < P; ++k)  // shares are +0 or more: -0 is an unreadable middle page
      keep[k] = candidate[k] >= lo || __float_as_uint(candidate[k]) == 0x80000000u;
  }

  // compaction: sink, kept middle pages in order, current page
  int kept_here = 0;
#pragma unroll
  for (int k = 0; k < P; ++k) kept_here += keep[k];
  int kept;
  int slot = 1 + block_exclusive_scan(kept_here, int_buffers[turn], kept);
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (keep[k]) lists[slot++] = base + k;
  if (threadIdx.x == 0) {
    lists[0] = 0;
    if (last > 0) lists[kept + 1] = last;
    *count_out = kept + min(n, 2);
  }
}

}  // namespace

// One build per (pages per thread, K_B, G rounded up to a power of two): cuda/select.py
// compiles this file with -DSELECT_P=<P> -DSELECT_WAYS=<K_B> -DSELECT_GROUP=<G> for the
// launches it makes (every (P, K_B) pair in one file took NVRTC a minute); so does
// cuda/estimate_select.py for its file, which includes this one
#ifndef SELECT_P
#define SELECT_P 8
#endif
#ifndef SELECT_WAYS
#define SELECT_WAYS 4
#endif
#ifndef SELECT_GROUP
#define SELECT_GROUP 4
#endif

#ifndef MOIRA_DEVICE_ONLY  // estimate_select.cu takes select_row, not the kernel
#define MOIRA_SELECT(P, WAYS, GP)                                                  \
  extern "C" __global__ void __launch_bounds__(32 * MAX_WARPS, 1)                  \
      moira_select_p##P##_w##WAYS##_g##GP(const Params p) {                        \
    select_row<P, WAYS, GP>(p);                                                    \
  }
#define MOIRA_SELECT_BUILD(P, WAYS, GP) MOIRA_SELECT(P, WAYS, GP)

MOIRA_SELECT_BUILD(SELECT_P, SELECT_WAYS, SELECT_GROUP)
#endif
