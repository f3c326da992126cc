// Estimate and Select in one launch, one program per (request, KV head) row
// (cuda/estimate_select.py; decode.py uses it for steps of many rows).
//
// The step's two first kernels, run by one 256-thread program per row: the token's cache write
// and the filled page's summary; then two groups of 4 warps, each acting as one of
// estimate.cu's programs: group 0 computes the sink's log-mass exactly and group 1 the
// current page's (exact_page, on a named barrier per group), then each streams half of the
// row's middle-page tiles through the mvar loop (mvar_pages); the log-masses go to shared
// memory instead of global memory, and after one barrier Select's row program (select_row,
// any mode) runs on them with the same 256 threads. The log-masses are the CUDA Estimate's bit
// for bit; Select's sums are the CUDA Select's in the same order where cuda/select.py's shape
// also gives its row program 256 threads of P pages (tables of 1,025-2,048 pages) and in
// another order elsewhere (narrower tables, and "auto"'s wider ones up to 4,096 pages), where
// a near-tie could part the lists (none did in the tests or in the tuning sweeps' checks).
// Why: the CUDA Estimate's grid of short programs reads its summaries at 1.9-2.4 TB/s, a
// chain of dependent loads repeated over ~4 waves, and Select then pays its own launch and
// reloads the log-masses (docs/design/select.md, "The fused Estimate + Select"). Here a step
// of 256 rows is one wave of two programs per SM, each with 32 KB of summaries in flight. A
// step of few rows would stream every row's summaries through one SM each, so decode.py
// keeps the two kernels there.

#include "common.cuh"  // once, here: the two files' own includes then find it included

#define MOIRA_DEVICE_ONLY
namespace est {
#include "estimate.cu"
}
namespace sel {
#include "select.cu"
}
#undef MOIRA_DEVICE_ONLY

namespace {

constexpr int GROUPS = 2;  // groups of est::THREADS threads
constexpr int THREADS = GROUPS * est::THREADS;

// mirrored field by field by cuda/estimate_select.py's Params (ctypes). The two kernels' own
// parameters (their log_masses and its strides unused: the log-masses stay in shared memory)
struct Params {
  est::Params estimate;
  sel::Params select;
  int masses_stride;  // floats per query head in the shared log-masses: the table's width
  unsigned long long* timeline;  // [rows][TIMELINE_FIELDS] (FUSED_TIMELINE builds only)
};

// FUSED_TIMELINE = 1 (the "estimate_select" probe of moira.benchmarking.timeline, never the
// engine's build): each program writes the global timer (ns) at its
// start, after the token's write, after group 0's exact page and its mvar tiles, after group
// 1's, after the barrier before Select, and at its end
#ifndef FUSED_TIMELINE
#define FUSED_TIMELINE 0
#endif
constexpr int TIMELINE_FIELDS = 8;  // moira.benchmarking.timeline.FIELDS

__device__ __forceinline__ void mark(const Params& p, int field) {
#if FUSED_TIMELINE
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  p.timeline[blockIdx.x * TIMELINE_FIELDS + field] = t;
#endif
}

template <int D, int GP, int P, int WAYS>
__device__ void estimate_select_row(const Params& p) {
  extern __shared__ __align__(16) float masses[];  // [GP][masses_stride]
  const est::Params& e = p.estimate;
  const int row = blockIdx.x;
  const int b = row / e.num_kv_heads, head = row % e.num_kv_heads;
  const int* row_table = e.block_table + b * e.stride_bt;
  const int seq_len = e.seq_lens[b];
  const int pages_in_row = min(cdiv(seq_len, PAGE), e.max_pages);
  const int last = pages_in_row - 1;
  const bool marks = FUSED_TIMELINE && threadIdx.x % est::THREADS == 0;
  if (marks && threadIdx.x == 0) mark(p, 0);
  if (e.num_slots > 0) {  // this step's token first: the current page's keys include it
    est::write_new_token<D>(e, b, head);
    __syncthreads();
  }
  if (marks && threadIdx.x == 0) mark(p, 1);
  if (pages_in_row > 0 && seq_len == pages_in_row * PAGE)  // the step filled the page
    est::summarize_page<D>(e, row_table[last], head);
  if (pages_in_row > e.dense_below_pages) {  // else Select keeps the whole row
    est::Params local = e;  // the log-masses of this row, in shared memory
    local.log_masses = masses;
    local.stride_lr = 0;
    local.stride_lg = p.masses_stride;
    local.mvar_programs = GROUPS;
    const int group = threadIdx.x / est::THREADS;
    // group 0: the sink, group 1: the current page; a single page is group 1's alone
    if (group == 1 || last > 0)
      est::exact_page<D, GP, GROUPS>(local, row, b, head, group == 0 ? 0 : last, seq_len,
                                     row_table);
    if (marks) mark(p, 2 + 2 * group);
    est::mvar_pages<D, GP, GROUPS>(local, row, b, head, last, row_table, group);
    if (marks) mark(p, 3 + 2 * group);
  }
  __syncthreads();  // every log-mass written
  if (marks && threadIdx.x == 0) mark(p, 6);
  sel::Params s = p.select;
  s.log_masses = masses;
  s.stride_lr = 0;
  s.stride_lg = p.masses_stride;
  sel::select_row<P, WAYS, GP>(s);
  if (marks && threadIdx.x == 0) mark(p, 7);
}

}  // namespace

// One build per (D, G rounded up to a power of two, Select's pages per thread, K_B):
// cuda/estimate_select.py compiles this file with -DFUSED_D, -DSELECT_GROUP, -DSELECT_P,
// -DSELECT_WAYS (select.cu, included above, sets the last three's defaults)
#ifndef FUSED_D
#define FUSED_D 128
#endif

#define MOIRA_ESTIMATE_SELECT(D, GP, P, WAYS)                                          \
  extern "C" __global__ void __launch_bounds__(THREADS, 2)                             \
      moira_estimate_select_d##D##_g##GP##_p##P##_w##WAYS(const Params p) {            \
    estimate_select_row<D, GP, P, WAYS>(p);                                            \
  }
#define MOIRA_ESTIMATE_SELECT_BUILD(D, GP, P, WAYS) MOIRA_ESTIMATE_SELECT(D, GP, P, WAYS)

MOIRA_ESTIMATE_SELECT_BUILD(FUSED_D, SELECT_GROUP, SELECT_P, SELECT_WAYS)
