// Attend in CUDA C++ (KernelOptions(attend="cuda"); built and launched by cuda/attend.py).
//
// The same self-planning split-KV attention as triton/attend.py's kernel (plan_row, the
// online softmax in the log2 domain, the softmax denominator summed from the bf16-rounded
// weights, a single-chunk row written directly, a split row's partials and log-sum-exp for
// Merge), with the K/V pipeline Triton would not build: every page id of the chunk staged in
// shared memory first, then STAGES pages' K and V in flight at once by cp.async (zero-filled
// past seq_len), so a program computes one page while the next ones load. Why: Triton's
// pipeliner keeps one K/V tile per program and nothing in flight while it computes;
// FlashInfer's decode kernel, which pipelines, is 4-11% faster at equal row lengths
// (docs/design/attend.md).
//
// A program (row = (request, KV head), chunk) runs 4 warps; warp w takes tokens
// [16 w, 16 w + 16) of each 64-token page, for the G query heads padded to the 16 rows of
// mma.m16n8k16 (bf16 in, float32 out): S = Q K^T from Q fragments held in registers and K by
// ldmatrix, P V with V by ldmatrix.trans. Shared-memory rows are XOR-swizzled (swizzled()) so
// the copies and both ldmatrix forms are free of bank conflicts. The 4 warps' (max, sum,
// output) merge through shared memory at the end.

namespace {

#include "common.cuh"

constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
constexpr int STAGED_IDS = 256;  // page ids staged per segment of a chunk

// ATTEND_TIMELINE = 1 (the "attend" probe of moira.benchmarking.timeline, never the engine's
// build): each program writes when it started, when its first page landed and
// when it ended (the global timer, ns, and its SM's clock), its SM and its page count
#ifndef ATTEND_TIMELINE
#define ATTEND_TIMELINE 0
#endif
constexpr int TIMELINE_FIELDS = 8;  // moira.benchmarking.timeline.FIELDS

// Dynamic shared memory of a program (mirrored by cuda/attend.py's shared_bytes): the
// stages' K and V tiles, the staged page ids (int64) and token counts (int32)
__host__ __device__ constexpr int shared_bytes(int d, int stages) {
  return stages * 2 * PAGE * d * 2 + STAGED_IDS * (8 + 4);
}

// mirrored field by field by cuda/attend.py's Params (ctypes); strides in elements
struct Params {
  const bf16* query;
  const bf16* key_cache;
  const bf16* value_cache;
  const int* block_table;
  const int* seq_lens;
  const int* page_lists;
  const int* page_counts;
  bf16* out;
  float* partial_out;
  float* partial_lse;
  i64 stride_qb, stride_qh;
  i64 stride_kp, stride_kt, stride_kh;
  i64 stride_vp, stride_vt, stride_vh;
  i64 stride_bt, stride_pb, stride_ph, stride_cb, stride_ch;
  i64 stride_ob, stride_oh, stride_od;
  int num_kv_heads, max_pages, group, chunk_floor, chunks_per_row;
  int step_rows, step_programs, short_pages;
  float qk_scale_log2;
  unsigned long long* timeline;  // [programs][TIMELINE_FIELDS] (ATTEND_TIMELINE builds only)
};

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

__device__ __forceinline__ void cp_async16(void* shared, const void* global, int bytes) {
  // bytes < 16 zero-fills the rest: 0 for a token past seq_len or a page outside the table
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(address), "l"(global), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* shared) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* shared) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// d += a b: a 16x16 bf16 (row), b 16x8 bf16 (col), d 16x8 float32
__device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0,
                                    u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x by the SFU, as Triton's tl.exp2 (2^-inf = 0)
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// two floats rounded to bf16 (round to nearest even) in one word, `low` in the low half; adds
// the rounded values to rounded_sum
__device__ __forceinline__ u32 pack_bf16(float low, float high, float& rounded_sum) {
  u32 pair;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(pair) : "f"(high), "f"(low));
  rounded_sum += __uint_as_float(pair << 16) + __uint_as_float(pair & 0xffff0000u);
  return pair;
}

// Element offset of 16-byte chunk `chunk` of row `row` in a K or V tile. The XOR swizzle
// keeps every 32-byte global sector in one aligned 32-byte shared granule (rows padded by 16
// bytes split every odd row's sectors: 1.5x the L2 sectors and 2.6x the shared wavefronts
// of the copies, in Nsight Compute) and puts the 8 rows an ldmatrix phase reads in 8
// different bank groups.
template <int D>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) * 8);
}

template <int D, int STAGES>
__device__ __forceinline__ void attend_program(const Params& p, unsigned char* shared) {
  constexpr int TILE = PAGE * D;  // one page's K (or V), rows of D elements
  // [STAGES][K, V][64][D], each row's 16-byte chunk c at chunk c ^ (row % 8) (swizzled)
  bf16* tiles = reinterpret_cast<bf16*>(shared);
  i64* page_ids = reinterpret_cast<i64*>(shared + STAGES * 2 * TILE * 2);
  int* page_tokens = reinterpret_cast<int*>(page_ids + STAGED_IDS);  // tokens read per page

  const int row = blockIdx.x, chunk_id = blockIdx.y;
  const int b = row / p.num_kv_heads, head = row % p.num_kv_heads;
#if ATTEND_TIMELINE
  const unsigned long long start_ns = global_ns(), start_clock = clock64();
  unsigned long long first_ns = 0, first_clock = 0;
  unsigned long long* record =
      p.timeline + (i64(blockIdx.y) * gridDim.x + blockIdx.x) * TIMELINE_FIELDS;
  auto write_record = [&](int pages) {
    if (threadIdx.x == 0) {
      const unsigned long long end_clock = clock64();
      const unsigned long long fields[TIMELINE_FIELDS] = {
          start_ns, first_ns, global_ns(), start_clock, first_clock, end_clock, smid(),
          unsigned(pages)};
      for (int f = 0; f < TIMELINE_FIELDS; ++f) record[f] = fields[f];
    }
  };
#endif
  // plan_row (triton/attend.py): Eq. (4) with the short-row floor
  const int count = p.page_counts[b * p.stride_cb + head * p.stride_ch];
  int floor_pages = p.chunk_floor;
  if (count <= p.short_pages) floor_pages = max(2, cdiv(count * p.step_rows, p.step_programs));
  const int chunk = max(floor_pages, cdiv(count, p.chunks_per_row));
  const int chunks = max(cdiv(count, chunk), 1);
  if (chunk_id >= chunks) {
#if ATTEND_TIMELINE
    write_record(0);
#endif
    return;
  }
  const int first = chunk_id * chunk, last = min(first + chunk, count);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates
  const int seq_len = p.seq_lens[b];
  const int* row_pages = p.page_lists + b * p.stride_pb + head * p.stride_ph;
  const int* row_table = p.block_table + b * p.stride_bt;
  const bf16* keys = p.key_cache + head * p.stride_kh;
  const bf16* values = p.value_cache + head * p.stride_vh;

  // Q as A fragments, rows g and g + 8 (query heads of the group; zero past G)
  u32 q[D / 16][4];
  const bf16* query = p.query + b * p.stride_qb + i64(head) * p.group * p.stride_qh;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int qrow = g + 8 * (i % 2), col = kk * 16 + 2 * t + 8 * (i / 2);
      q[kk][i] = qrow < p.group
          ? *reinterpret_cast<const u32*>(query + qrow * p.stride_qh + col) : 0u;
    }
  }

  float running_max[2] = {-infinity(), -infinity()};
  float running_sum[2] = {0.f, 0.f};  // this lane's columns; the quad's sum at the end
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  // Each warp copies only the 16 tokens of each page it computes, so no other warp waits for
  // its copies and the page loop needs the warp's own barrier, not the program's (a barrier
  // per page held 14% of the stall samples in Nsight Compute; the program's 128 threads
  // copying whole pages timed within about 1% of this, ahead at CV 0, behind on spreads, and
  // were removed). A lane copies the same (token, 16-byte column) pieces of every
  // page: its addresses are a per-lane base plus constants, so a page costs a few adds per
  // piece. (A loop from threadIdx.x with a run-time trip count recomputed two 64-bit products
  // and selects per piece: 2.5x Triton's instructions.)
  constexpr int PIECES_PER_TOKEN = D / 8;
  constexpr int TOKENS_PER_PASS = 32 / PIECES_PER_TOKEN;  // 2 at D = 128, 4 at D = 64
  constexpr int PASSES = 16 / TOKENS_PER_PASS;
  const int piece_token = warp * 16 + lane / PIECES_PER_TOKEN;
  const int piece_chunk = lane % PIECES_PER_TOKEN;
  const bf16* k_base = keys + piece_token * p.stride_kt + piece_chunk * 8;
  const bf16* v_base = values + piece_token * p.stride_vt + piece_chunk * 8;
  const i64 k_pass = TOKENS_PER_PASS * p.stride_kt, v_pass = TOKENS_PER_PASS * p.stride_vt;
  // Swizzled offsets as a lane's own offset XOR a constant per pass (or per 16 columns
  // below): a pass adds tokens with no carry into row & 7 (TOKENS_PER_PASS is 2 or 4 over a
  // warp's rows 16 w + {0, 1} / {0..3}), so the swizzle of its rows is the
  // lane's XOR that of the pass; a page then costs no address arithmetic but these constants
  const int piece_at = swizzled<D>(piece_token, piece_chunk);

  auto load_page = [&](int i, int stage) {  // page i of the segment into a stage
    // a page outside the table has id 0 and no tokens: its addresses are valid, none is read
    const i64 page = page_ids[i];
    const int tokens = page_tokens[i];
    const bf16* k_src = k_base + page * p.stride_kp;
    const bf16* v_src = v_base + page * p.stride_vp;
    bf16* k_tile = tiles + stage * 2 * TILE;
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      const int bytes = piece_token + pass * TOKENS_PER_PASS < tokens ? 16 : 0;
      const int at = (piece_at ^ (pass * TOKENS_PER_PASS & 7) * 8) + pass * TOKENS_PER_PASS * D;
      cp_async16(k_tile + at, k_src + pass * k_pass, bytes);
      cp_async16(k_tile + TILE + at, v_src + pass * v_pass, bytes);
    }
  };

  // a lane's ldmatrix rows: K's (tokens 0-7, 8-15 by matrix / 2) at columns 0-7 or 8-15 (by
  // matrix % 2) and V's transposed the other way round; column block kk adds kk * 16, an XOR
  const int matrix = lane / 8, matrix_row = lane % 8;
  const int k_lane = swizzled<D>(matrix / 2 * 8 + matrix_row, matrix % 2);
  const int v_lane = swizzled<D>(matrix % 2 * 8 + matrix_row, matrix / 2);

  auto attend_page = [&](int stage, int tokens) {  // this warp's 16 tokens of a staged page
    const bf16* k_tile = tiles + stage * 2 * TILE + warp * 16 * D;
    const bf16* v_tile = k_tile + TILE;
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};  // tokens 0-7, 8-15
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // K rows (tokens) x 8 dims: (0-7, lo), (0-7, hi), (8-15, lo), (8-15, hi)
      u32 k[4];
      ldmatrix_x4(k, k_tile + (k_lane ^ kk * 16));
      mma(s[0], q[kk], k[0], k[1]);
      mma(s[1], q[kk], k[2], k[3]);
    }
    float tile_max[2] = {-infinity(), -infinity()};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int token = warp * 16 + n * 8 + 2 * t + i % 2;
        s[n][i] = token < tokens ? s[n][i] * p.qk_scale_log2 : -infinity();
        tile_max[i / 2] = fmaxf(tile_max[i / 2], s[n][i]);
      }
    }
    float rescale[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(FULL, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(FULL, tile_max[r], 2));
      const float new_max = fmaxf(running_max[r], tile_max[r]);
      const float shift = new_max == -infinity() ? 0.f : new_max;  // nothing read yet
      rescale[r] = exp2_approx(running_max[r] - shift);
      running_max[r] = new_max;
      running_sum[r] *= rescale[r];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        s[n][2 * r] = exp2_approx(s[n][2 * r] - shift);
        s[n][2 * r + 1] = exp2_approx(s[n][2 * r + 1] - shift);
      }
    }
    // the weights as the A fragment of P V (S's accumulator layout is A's, two k halves)
    u32 weights[4];
    weights[0] = pack_bf16(s[0][0], s[0][1], running_sum[0]);
    weights[1] = pack_bf16(s[0][2], s[0][3], running_sum[1]);
    weights[2] = pack_bf16(s[1][0], s[1][1], running_sum[0]);
    weights[3] = pack_bf16(s[1][2], s[1][3], running_sum[1]);
    // once the running max settles most pages leave it unchanged (rescale exactly 1): the
    // accumulator's D / 2 multiplies per lane are skipped for the warp
    if (__any_sync(FULL, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][0] *= rescale[0];
        acc[n][1] *= rescale[0];
        acc[n][2] *= rescale[1];
        acc[n][3] *= rescale[1];
      }
    }
#pragma unroll
    for (int nn = 0; nn < D / 16; ++nn) {
      // V rows (tokens) x 8 dims, transposed: (0-7, lo), (8-15, lo), (0-7, hi), (8-15, hi)
      u32 v[4];
      ldmatrix_x4_trans(v, v_tile + (v_lane ^ nn * 16));
      mma(acc[2 * nn], weights, v[0], v[1]);
      mma(acc[2 * nn + 1], weights, v[2], v[3]);
    }
  };

  for (int segment = first; segment < last; segment += STAGED_IDS) {
    const int pages = min(STAGED_IDS, last - segment);
    __syncthreads();  // the previous segment's tiles and ids are no longer read
    for (int i = threadIdx.x; i < pages; i += THREADS) {
      // an entry outside the block table reads nothing (a bad list must not read another
      // request's page), and the current page only its tokens before seq_len
      const int logical = row_pages[segment + i];
      const bool in_table = logical >= 0 && logical < p.max_pages;
      page_ids[i] = in_table ? row_table[logical] : 0;
      page_tokens[i] = in_table ? max(0, min(PAGE, seq_len - logical * PAGE)) : 0;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
      if (i < pages) load_page(i, i);
      cp_async_commit();
    }
    // page i's stage and page i + STAGES - 1's (i - 1's), rotated rather than divided
    int stage = 0, next_stage = STAGES - 1;
    for (int i = 0; i < pages; ++i) {
      cp_async_wait<STAGES - 2>();
      // page i landed for this warp, the only one that reads its rows; page i - 1's stage
      // is free
      __syncwarp();
#if ATTEND_TIMELINE
      if (segment == first && i == 0) first_ns = global_ns(), first_clock = clock64();
#endif
      // the next copy goes out before page i is computed, into page i - 1's stage, so
      // STAGES - 1 pages are in flight while it is (issued after it, one fewer: none at 2)
      if (i + STAGES - 1 < pages) load_page(i + STAGES - 1, next_stage);
      cp_async_commit();
      attend_page(stage, page_tokens[i]);
      next_stage = stage;
      stage = stage + 1 == STAGES ? 0 : stage + 1;
    }
    cp_async_wait<0>();
  }

  // the four warps' partial softmaxes, merged through shared memory
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    running_sum[r] += __shfl_xor_sync(FULL, running_sum[r], 1);
    running_sum[r] += __shfl_xor_sync(FULL, running_sum[r], 2);
  }
  __syncthreads();
  // rows of D + 8 floats: a quad's float2 stores and the 8 rows of a warp's store fill two
  // bank wavefronts, the fewest for 256 bytes (rows of D floats would take eight)
  constexpr int OUT_ROW = D + 8;
  float* warp_out = reinterpret_cast<float*>(shared);  // [WARPS][16][OUT_ROW]
  float* warp_max = warp_out + WARPS * 16 * OUT_ROW;   // [WARPS][16]
  float* warp_sum = warp_max + WARPS * 16;             // [WARPS][16]
  static_assert(WARPS * 16 * (OUT_ROW + 2) * 4 <= shared_bytes(D, STAGES),
                "the merge's rows must fit in the tiles' shared memory");
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      *reinterpret_cast<float2*>(warp_out + (warp * 16 + g + 8 * r) * OUT_ROW + n * 8 + 2 * t) =
          make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
    }
  }
  if (t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      warp_max[warp * 16 + g + 8 * r] = running_max[r];
      warp_sum[warp * 16 + g + 8 * r] = running_sum[r];
    }
  }
  __syncthreads();
  const i64 slot = (i64(row) * p.chunks_per_row + chunk_id) * p.group;
  for (int e = threadIdx.x; e < p.group * D; e += THREADS) {
    const int qrow = e / D, d = e % D;
    float row_max = -infinity();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) row_max = fmaxf(row_max, warp_max[w * 16 + qrow]);
    const float shift = row_max == -infinity() ? 0.f : row_max;
    float total = 0.f, value = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float weight = exp2_approx(warp_max[w * 16 + qrow] - shift);
      total += warp_sum[w * 16 + qrow] * weight;
      value += warp_out[(w * 16 + qrow) * OUT_ROW + d] * weight;
    }
    const float result = total == 0.f ? 0.f : value / total;  // no keys: zeros, lse -inf
    if (chunks == 1) {
      p.out[b * p.stride_ob + (i64(head) * p.group + qrow) * p.stride_oh + d * p.stride_od] =
          to_bf16(result);
    } else {
      p.partial_out[(slot + qrow) * D + d] = result;
      if (d == 0) {
        p.partial_lse[slot + qrow] =
            total == 0.f ? -infinity() : (row_max + log2f(total)) * 0.6931471805599453f;
      }
    }
  }
#if ATTEND_TIMELINE
  __syncthreads();  // every thread's output written
  write_record(last - first);
#endif
}

}  // namespace

// Programs per SM that the shared memory allows (228 KB per SM, 1 KB of it reserved per
// program), at most 4: the register budget is set so the registers allow as many (at 2 stages
// and D = 128, 3 programs where 175 registers would have allowed 2).
__host__ __device__ constexpr int programs_per_sm(int d, int stages) {
  const int fit = 233472 / (shared_bytes(d, stages) + 1024);
  return fit < 4 ? fit : 4;
}

#define MOIRA_ATTEND(D, STAGES)                                                        \
  extern "C" __global__ void __launch_bounds__(THREADS, programs_per_sm(D, STAGES))      \
      moira_attend_d##D##_s##STAGES(const Params p) {                                   \
    extern __shared__ __align__(16) unsigned char shared[];                             \
    attend_program<D, STAGES>(p, shared);                                               \
  }

MOIRA_ATTEND(64, 2)
MOIRA_ATTEND(64, 3)
MOIRA_ATTEND(64, 4)
MOIRA_ATTEND(128, 2)
MOIRA_ATTEND(128, 3)
MOIRA_ATTEND(128, 4)
