// Estimate and Select in one launch, one program per (request, KV head) row
// (estimate_select_cuda.py; decode.py uses it for steps of many rows).
//
// The step's two first kernels, run by one 256-thread program per row: the token's cache write
// and the filled page's summary; then two groups of 4 warps, each acting as one of
// estimate_cuda.cu's programs: group 0 computes the sink's log-mass exactly and group 1 the
// current page's (exact_page, on a named barrier per group), then each streams half of the
// row's middle-page tiles through the mvar loop (mvar_pages); the log-masses go to shared
// memory instead of global memory, and after one barrier Select's row program (select_row,
// any mode) runs on them with the same 256 threads. The arithmetic is the two kernels', in the
// same order, so the lists and counts are theirs bit for bit. Why: the CUDA Estimate's grid
// of short programs reads its summaries at 1.9-2.4 TB/s, a chain of dependent loads repeated
// over ~4 waves, and Select then pays its own launch and reloads the log-masses (NOTES,
// session 56). Here a step of 256 rows is one wave of two programs per SM, each with 32 KB of
// summaries in flight. A step of few rows would stream every row's summaries through one SM
// each, so decode.py keeps the two kernels there.

#include "moira_cuda.cuh"  // once, here: the two files' own includes then find it included

#define MOIRA_DEVICE_ONLY
namespace est {
#include "estimate_cuda.cu"
}
namespace sel {
#include "select_cuda.cu"
}
#undef MOIRA_DEVICE_ONLY

namespace {

constexpr int GROUPS = 2;  // groups of est::THREADS threads
constexpr int THREADS = GROUPS * est::THREADS;

// mirrored field by field by estimate_select_cuda.Params (ctypes). The two kernels' own
// parameters (their log_masses and its strides unused: the log-masses stay in shared memory)
struct Params {
  est::Params estimate;
  sel::Params select;
  int masses_stride;  // floats per query head in the shared log-masses: the table's width
  unsigned long long* timeline;  // [rows][TIMELINE_FIELDS] (FUSED_TIMELINE builds only)
};

// FUSED_TIMELINE = 1 (estimate_select_cuda.TIMELINE, a probe for tune_kernels.py --kinds
// fusedparts, never the engine's build): each program writes the global timer (ns) at its
// start, after the token's write, after group 0's exact page and its mvar tiles, after group
// 1's, after the barrier before Select, and at its end
#ifndef FUSED_TIMELINE
#define FUSED_TIMELINE 0
#endif
constexpr int TIMELINE_FIELDS = 8;  // estimate_select_cuda.TIMELINE_FIELDS

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
  sel::select_row<P, WAYS, GP>(s, row);
  if (marks && threadIdx.x == 0) mark(p, 7);
}

// A cluster of CLUSTER programs per row (estimate_select_cluster): this program's rank
__device__ __forceinline__ int cluster_rank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return int(rank);
}

// every thread of the cluster's programs; shared-memory writes before it are visible to every
// program of the cluster after it (not .aligned: a warp need not have reconverged)
__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release;\n"
               "barrier.cluster.wait.acquire;\n" ::: "memory");
}

// the float at `local`'s offset in the shared memory of the cluster's program `rank`
__device__ __forceinline__ float load_from_rank(const float* local, int rank) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned remote;
  float value;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(value) : "r"(remote) : "memory");
  return value;
}

// The same step for steps of fewer rows, with a cluster of CLUSTER programs per row (about
// one wave: rows x CLUSTER programs), so that a row's summaries stream through CLUSTER SMs
// instead of one (one program per row at 32 rows was 25 us slower than the two kernels,
// session 56). Its 2 x CLUSTER groups of est::THREADS threads are the CUDA Estimate's
// programs: the first group computes the sink's log-mass exactly, the last the current page's
// (after the token's write and the page's summary, in the last program), and the others share
// the row's middle-page tiles as its mvar programs; each writes its log-masses into its own
// program's shared memory. After a cluster barrier the first program gathers the row's
// log-masses from the others' shared memory, a second barrier lets them exit, and it runs
// Select's row program on them alone, as the one-program kernel does. The arithmetic is the
// two kernels' (the mvar tiles' share only differs), so the lists and counts are theirs bit
// for bit.
template <int D, int GP, int P, int WAYS, int CLUSTER>
__device__ void estimate_select_cluster(const Params& p) {
  static_assert(CLUSTER >= 2, "one program per row: estimate_select_row");
  constexpr int WORKERS = CLUSTER * GROUPS;  // the sink's, WORKERS - 2 mvar, the current page's
  extern __shared__ __align__(16) float masses[];  // [GP][masses_stride]
  const est::Params& e = p.estimate;
  const int rank = cluster_rank();
  const int row = blockIdx.x / CLUSTER;
  const int b = row / e.num_kv_heads, head = row % e.num_kv_heads;
  const int* row_table = e.block_table + b * e.stride_bt;
  const int seq_len = e.seq_lens[b];
  const int pages_in_row = min(cdiv(seq_len, PAGE), e.max_pages);
  const int last = pages_in_row - 1;
  const int worker = rank * GROUPS + threadIdx.x / est::THREADS;
  const bool estimated = pages_in_row > e.dense_below_pages;  // else Select keeps the row
  est::Params local = e;  // the log-masses of this row, in this program's shared memory
  local.log_masses = masses;
  local.stride_lr = 0;
  local.stride_lg = p.masses_stride;
  local.mvar_programs = WORKERS - 2;
  if (rank == CLUSTER - 1) {
    if (e.num_slots > 0) {  // this step's token first: the current page's keys include it
      est::write_new_token<D>(e, b, head);
      __syncthreads();
    }
    if (pages_in_row > 0 && seq_len == pages_in_row * PAGE)  // the step filled the page
      est::summarize_page<D>(e, row_table[last], head);
  }
  if (estimated) {
    if (worker == WORKERS - 1)  // the current page (a single page is this worker's alone)
      est::exact_page<D, GP, GROUPS>(local, row, b, head, last, seq_len, row_table);
    else if (worker == 0 && last > 0)
      est::exact_page<D, GP, GROUPS>(local, row, b, head, 0, seq_len, row_table);
    else if (worker > 0 && worker < WORKERS - 1)
      est::mvar_pages<D, GP, GROUPS>(local, row, b, head, last, row_table, worker - 1);
  }
  cluster_barrier();  // every program's log-masses written
  if (rank == 0 && estimated) {
    // each page's log-masses from the program whose worker computed them (mvar_pages'
    // shares); every load before a store, so the gather is one round trip
    typedef est::MvarShape<D, GP> S;
    const int share = cdiv(cdiv(max(last, 0), S::TILE), WORKERS - 2);
    float value[P][GP];
    int from[P];  // the page's program, 0 where nothing is gathered
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int page = threadIdx.x + k * THREADS;
      const int owner = page == last ? WORKERS - 1 : page == 0 ? 0 : 1 + page / S::TILE / share;
      from[k] = page < pages_in_row ? owner / GROUPS : 0;
#pragma unroll
      for (int g = 0; g < GP; ++g)
        value[k][g] = from[k] > 0 && g < e.group
            ? load_from_rank(masses + g * p.masses_stride + page, from[k]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < P; ++k)
#pragma unroll
      for (int g = 0; g < GP; ++g)
        if (from[k] > 0 && g < e.group)
          masses[g * p.masses_stride + threadIdx.x + k * THREADS] = value[k][g];
  }
  cluster_barrier();  // the first program has read the others' shared memory
  if (rank != 0) return;
  __syncthreads();  // its gathered log-masses visible to all its threads
  sel::Params s = p.select;
  s.log_masses = masses;
  s.stride_lr = 0;
  s.stride_lg = p.masses_stride;
  sel::select_row<P, WAYS, GP>(s, row);
}

}  // namespace

// One build per (D, G rounded up to a power of two, Select's pages per thread, K_B):
// estimate_select_cuda.py compiles this file with -DFUSED_D, -DSELECT_GROUP, -DSELECT_P,
// -DSELECT_WAYS (select_cuda.cu, included above, sets the last three's defaults)
#ifndef FUSED_D
#define FUSED_D 128
#endif

// and cluster size (-DFUSED_CLUSTER, 1: one program per row)
#ifndef FUSED_CLUSTER
#define FUSED_CLUSTER 1
#endif

#define MOIRA_ESTIMATE_SELECT(D, GP, P, WAYS)                                          \
  extern "C" __global__ void __launch_bounds__(THREADS, 2)                             \
      moira_estimate_select_d##D##_g##GP##_p##P##_w##WAYS(const Params p) {            \
    estimate_select_row<D, GP, P, WAYS>(p);                                            \
  }
#define MOIRA_ESTIMATE_SELECT_CLUSTER(D, GP, P, WAYS, C)                               \
  extern "C" __global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(THREADS, 2)   \
      moira_estimate_select_d##D##_g##GP##_p##P##_w##WAYS##_c##C(const Params p) {     \
    estimate_select_cluster<D, GP, P, WAYS, C>(p);                                     \
  }
#define MOIRA_ESTIMATE_SELECT_BUILD(D, GP, P, WAYS) MOIRA_ESTIMATE_SELECT(D, GP, P, WAYS)
#define MOIRA_ESTIMATE_SELECT_CLUSTER_BUILD(D, GP, P, WAYS, C) \
  MOIRA_ESTIMATE_SELECT_CLUSTER(D, GP, P, WAYS, C)

#if FUSED_CLUSTER == 1
MOIRA_ESTIMATE_SELECT_BUILD(FUSED_D, SELECT_GROUP, SELECT_P, SELECT_WAYS)
#else
MOIRA_ESTIMATE_SELECT_CLUSTER_BUILD(FUSED_D, SELECT_GROUP, SELECT_P, SELECT_WAYS, FUSED_CLUSTER)
#endif
