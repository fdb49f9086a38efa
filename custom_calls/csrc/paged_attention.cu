// Paged decode attention (one query per sequence) on XLA's CUDA stream.
//
// Grid: (kv_heads * head_tiles, num_splits, batch). A CTA owns one kv head, a
// tile of up to G query heads sharing it (GQA: each KV page is read once for
// the whole group) and one of num_splits even slices of the sequence's live
// tokens (split-K, so small batches still fill the GPU). Per chunk of
// kChunkTokens tokens the CTA caches the slots' row offsets in shared memory,
// computes all scores (K pass), applies an online-softmax update, then
// accumulates P·V (V pass) into per-row-group sums kept in shared memory. Each
// token row is read by kLanes lanes with one load each (16 bytes; 8 for FP8),
// coalesced, and each lane issues kRowLoadsInFlight independent loads before
// first use. num_splits > 1 writes unnormalised partials (acc, max, sum) to
// the workspace and a second kernel merges them; `partials` writes them for
// any num_splits and merges none (the caller merges them with its own:
// cascade attention's shared prefix).
//
// Templates: Q is q's and the output's type, C the cache's: Q itself, or FP8
// e4m3 under any Q. An FP8 cache is read as stored, each element widened to
// f32; its scales are the caller's (folded into q and the output).
#include <atomic>
#include <cfloat>
#include <type_traits>

#include "common.h"

namespace jaxserve {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunkTokens = 256;   // tokens staged per CTA iteration
constexpr int kRowLoadsInFlight = 8;  // independent row loads per lane
constexpr int kMaxGroupTile = 8;    // query heads per CTA (registers bound it)
constexpr int kMaxSplits = 128;     // bound of the merge kernel's smem
constexpr float kLog2e = 1.4426950408889634f;

struct DecodeParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* kv_lens;
  const int32_t* block_tables;
  void* out;
  float* partial_acc;  // [B, Hq, S, D]
  float* partial_ml;   // [B, Hq, S, 2]: running max (log2 domain), sum
  int num_q_heads, group, head_tiles;
  int max_blocks, block_size, num_blocks;
  int64_t slot_stride;  // elements between consecutive cache slots: Hkv * D
  float q_scale;        // folds sm_scale, log2(e) and 1/soft_cap into q
  float cap_log2e;      // soft_cap * log2(e); 0 when there is no cap
  int window;           // 0: no sliding window
  int num_splits;
  bool partials;        // write partials to the workspace, not the output
  bool merge;           // a second kernel merges the splits' partials into the output
};

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Lane layout shared by the kernel's phases for cache element type C, head_dim D.
template <typename C, int D>
struct Layout {
  using Vec = typename Elem<C>::Vec;
  static constexpr int kVec = Elem<C>::kPerVec;
  static constexpr int kLanes = D / kVec < 32 ? D / kVec : 32;  // lanes per token row
  static constexpr int kChunks = D / (kVec * kLanes);           // loads per lane per row
  static constexpr int kGroups = kWarps * (32 / kLanes);        // token rows in flight per CTA
  static constexpr int kUnroll = kRowLoadsInFlight / kChunks;
  static constexpr int kPerLane = kChunks * kVec;               // head_dim elements per lane
  __device__ static int Dim(int lane_in_row, int c, int e) { return (c * kLanes + lane_in_row) * kVec + e; }
};

template <typename C, int D, int G>
struct SharedState {
  int64_t row_offset[kChunkTokens];             // element offset of each token's K/V row
  float score[kChunkTokens][G];                 // log2-domain scores, then probabilities
  float acc[Layout<C, D>::kGroups][G][D];       // per row group P·V sums, kept here between
                                                // chunks so q and acc never share registers
  float run_max[G], run_sum[G], rescale[G];
};

// This lane's slice of q (the cache's layout: kVec elements per chunk), scaled, in f32.
template <typename Q, typename C, int D, int G>
__device__ void LoadQuery(const DecodeParams& p, int b, int head0, int heads_here, int lane_in_row,
                          float (&qf)[G][Layout<C, D>::kPerLane]) {
  using Lay = Layout<C, D>;
  const Q* q = static_cast<const Q*>(p.q);
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < Lay::kChunks; ++c) {
      float f[Lay::kVec] = {};
      if (g < heads_here) {
        const Q* row = q + (static_cast<int64_t>(b) * p.num_q_heads + head0 + g) * D;
        LoadFloats<Q, Lay::kVec>(row + Lay::Dim(lane_in_row, c, 0), f);
      }
#pragma unroll
      for (int e = 0; e < Lay::kVec; ++e) qf[g][c * Lay::kVec + e] = f[e] * p.q_scale;
    }
  }
}

template <typename C, int D, int G>
__device__ void LoadRows(const C* cache, const SharedState<C, D, G>& sh, int i0, int n, int lane_in_row,
                         typename Layout<C, D>::Vec (&rows)[Layout<C, D>::kUnroll][Layout<C, D>::kChunks]) {
  using Lay = Layout<C, D>;
#pragma unroll
  for (int u = 0; u < Lay::kUnroll; ++u) {
    const int i = i0 + u * Lay::kGroups;
#pragma unroll
    for (int c = 0; c < Lay::kChunks; ++c) {
      rows[u][c] = {};
      if (i < n) {
        const C* src = cache + sh.row_offset[i] + Lay::Dim(lane_in_row, c, 0);
        rows[u][c] = __ldg(reinterpret_cast<const typename Lay::Vec*>(src));
      }
    }
  }
}

// K pass: score[i][g] = log2-domain logit of token i for head g.
template <typename Q, typename C, int D, int G>
__device__ void ScoreChunk(const DecodeParams& p, SharedState<C, D, G>& sh, int n, int b, int head0,
                           int heads_here, int row_group, int lane_in_row) {
  using Lay = Layout<C, D>;
  const C* k_cache = static_cast<const C*>(p.k_cache);
  float qf[G][Lay::kPerLane];  // reloaded per chunk (L1 hit) so it is not live in the V pass
  LoadQuery<Q, C, D, G>(p, b, head0, heads_here, lane_in_row, qf);
  // Warp-uniform trip count: the shuffles below need every lane of the warp.
  for (int base = 0; base < n; base += Lay::kGroups * Lay::kUnroll) {
    const int i0 = base + row_group;
    typename Lay::Vec rows[Lay::kUnroll][Lay::kChunks];
    LoadRows<C, D, G>(k_cache, sh, i0, n, lane_in_row, rows);
#pragma unroll
    for (int u = 0; u < Lay::kUnroll; ++u) {
      float dot[G] = {};
#pragma unroll
      for (int c = 0; c < Lay::kChunks; ++c) {
        float kf[Lay::kVec];
        Elem<C>::ToFloat(rows[u][c], kf);
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int e = 0; e < Lay::kVec; ++e) dot[g] = fmaf(qf[g][c * Lay::kVec + e], kf[e], dot[g]);
      }
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int off = Lay::kLanes / 2; off > 0; off >>= 1) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], off);
      const int i = i0 + u * Lay::kGroups;
      if (i < n && lane_in_row == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) sh.score[i][g] = p.cap_log2e > 0.f ? p.cap_log2e * tanhf(dot[g]) : dot[g];
      }
    }
  }
}

// Online softmax over one chunk: warp w owns heads w, w + kWarps, ...
template <typename C, int D, int G>
__device__ void SoftmaxChunk(SharedState<C, D, G>& sh, int n, int warp, int lane) {
  for (int g = warp; g < G; g += kWarps) {
    float chunk_max = -FLT_MAX;
    for (int i = lane; i < n; i += 32) chunk_max = fmaxf(chunk_max, sh.score[i][g]);
    const float old_max = sh.run_max[g];
    const float new_max = fmaxf(old_max, WarpMax(chunk_max));
    float sum = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float prob = exp2f(sh.score[i][g] - new_max);
      sh.score[i][g] = prob;
      sum += prob;
    }
    sum = WarpSum(sum);
    if (lane == 0) {
      const float rescale = exp2f(old_max - new_max);
      sh.rescale[g] = rescale;
      sh.run_sum[g] = sh.run_sum[g] * rescale + sum;
      sh.run_max[g] = new_max;
    }
  }
}

// This lane's slice of its row group's accumulator in shared memory.
template <typename C, int D, int G>
__device__ __forceinline__ float& AccAt(SharedState<C, D, G>& sh, int row_group, int lane_in_row, int g, int j) {
  using Lay = Layout<C, D>;
  return sh.acc[row_group][g][Lay::Dim(lane_in_row, j / Lay::kVec, j % Lay::kVec)];
}

// V pass: acc[g][:] = acc[g][:] * rescale[g] + sum_i prob[i][g] * v[i][:].
template <typename C, int D, int G>
__device__ void AccumulateChunk(const DecodeParams& p, SharedState<C, D, G>& sh, int n, int row_group,
                                int lane_in_row) {
  using Lay = Layout<C, D>;
  const C* v_cache = static_cast<const C*>(p.v_cache);
  float acc[G][Lay::kPerLane];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int j = 0; j < Lay::kPerLane; ++j) acc[g][j] = AccAt(sh, row_group, lane_in_row, g, j) * sh.rescale[g];
  for (int base = 0; base < n; base += Lay::kGroups * Lay::kUnroll) {
    const int i0 = base + row_group;
    typename Lay::Vec rows[Lay::kUnroll][Lay::kChunks];
    LoadRows<C, D, G>(v_cache, sh, i0, n, lane_in_row, rows);
#pragma unroll
    for (int u = 0; u < Lay::kUnroll; ++u) {
      const int i = i0 + u * Lay::kGroups;
      if (i >= n) break;
      float prob[G];
#pragma unroll
      for (int g = 0; g < G; ++g) prob[g] = sh.score[i][g];
#pragma unroll
      for (int c = 0; c < Lay::kChunks; ++c) {
        float vf[Lay::kVec];
        Elem<C>::ToFloat(rows[u][c], vf);
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int e = 0; e < Lay::kVec; ++e) acc[g][c * Lay::kVec + e] = fmaf(prob[g], vf[e], acc[g][c * Lay::kVec + e]);
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int j = 0; j < Lay::kPerLane; ++j) AccAt(sh, row_group, lane_in_row, g, j) = acc[g][j];
}

// Sums the CTA's row groups and writes the output (one split) or a partial.
template <typename Q, typename C, int D, int G>
__device__ void WriteResult(const DecodeParams& p, const SharedState<C, D, G>& sh, int b, int head0,
                            int heads_here, int split) {
  for (int idx = threadIdx.x; idx < heads_here * D; idx += kThreads) {
    const int g = idx / D, d = idx % D;
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < Layout<C, D>::kGroups; ++r) sum += sh.acc[r][g][d];
    const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + head0 + g;
    if (!p.partials) {
      const float denom = sh.run_sum[g];
      static_cast<Q*>(p.out)[bh * D + d] = Elem<Q>::Store(denom > 0.f ? sum / denom : 0.f);
    } else {
      const int64_t part = bh * p.num_splits + split;
      p.partial_acc[part * D + d] = sum;
      if (d == 0) {
        p.partial_ml[part * 2] = sh.run_max[g];
        p.partial_ml[part * 2 + 1] = sh.run_sum[g];
      }
    }
  }
}

template <typename Q, typename C, int D, int G>
__global__ void __launch_bounds__(kThreads) PagedDecodeKernel(const DecodeParams p) {
  using Lay = Layout<C, D>;
  __shared__ SharedState<C, D, G> sh;
  const int kv_head = blockIdx.x / p.head_tiles, tile = blockIdx.x % p.head_tiles;
  const int split = blockIdx.y, b = blockIdx.z;
  const int head0 = kv_head * p.group + tile * G;
  const int heads_here = min(G, p.group - tile * G);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lane_in_row = lane % Lay::kLanes, row_group = threadIdx.x / Lay::kLanes;

  // Live tokens [first, len), cut into num_splits even slices.
  const int len = min(max(p.kv_lens[b], 0), p.max_blocks * p.block_size);
  const int first = p.window > 0 ? max(0, len - p.window) : 0;
  const int per_split = CeilDiv(len - first, p.num_splits);
  const int begin = first + split * per_split;
  const int end = min(begin + per_split, len);

  for (int idx = threadIdx.x; idx < Lay::kGroups * G * D; idx += kThreads) (&sh.acc[0][0][0])[idx] = 0.f;
  if (threadIdx.x < G) {
    sh.run_max[threadIdx.x] = -FLT_MAX;
    sh.run_sum[threadIdx.x] = 0.f;
  }
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks;
  for (int start = begin; start < end; start += kChunkTokens) {
    const int n = min(kChunkTokens, end - start);
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const int t = start + i;
      const int block = min(max(table[t / p.block_size], 0), p.num_blocks - 1);
      const int64_t slot = static_cast<int64_t>(block) * p.block_size + t % p.block_size;
      sh.row_offset[i] = slot * p.slot_stride + static_cast<int64_t>(kv_head) * D;
    }
    __syncthreads();
    ScoreChunk<Q, C, D, G>(p, sh, n, b, head0, heads_here, row_group, lane_in_row);
    __syncthreads();
    SoftmaxChunk<C, D, G>(sh, n, warp, lane);
    __syncthreads();
    AccumulateChunk<C, D, G>(p, sh, n, row_group, lane_in_row);
    __syncthreads();
  }
  __syncthreads();  // zeroed acc and run state are visible even when the slice is empty
  WriteResult<Q, C, D, G>(p, sh, b, head0, heads_here, split);
}

// Merges num_splits partials per (sequence, head): grid B * Hq, one head each.
template <typename Q, int D>
__global__ void __launch_bounds__(kThreads) MergeSplitsKernel(const DecodeParams p) {
  __shared__ float weight[kMaxSplits];
  __shared__ float denom;
  const int64_t bh = blockIdx.x;
  const float* ml = p.partial_ml + bh * p.num_splits * 2;
  if (threadIdx.x < 32) {
    float m = -FLT_MAX;
    for (int s = threadIdx.x; s < p.num_splits; s += 32) m = fmaxf(m, ml[2 * s]);
    m = WarpMax(m);
    float sum = 0.f;
    for (int s = threadIdx.x; s < p.num_splits; s += 32) {
      weight[s] = exp2f(ml[2 * s] - m);
      sum += weight[s] * ml[2 * s + 1];
    }
    sum = WarpSum(sum);
    if (threadIdx.x == 0) denom = sum;
  }
  __syncthreads();
  const float* acc = p.partial_acc + bh * p.num_splits * D;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float sum = 0.f;
    for (int s = 0; s < p.num_splits; ++s) sum = fmaf(weight[s], acc[s * D + d], sum);
    static_cast<Q*>(p.out)[bh * D + d] = Elem<Q>::Store(denom > 0.f ? sum / denom : 0.f);
  }
}

template <typename Q, typename C, int D, int G>
void Launch(const DecodeParams& p, int batch, int kv_heads, cudaStream_t stream) {
  const dim3 grid(kv_heads * p.head_tiles, p.num_splits, batch);
  PagedDecodeKernel<Q, C, D, G><<<grid, kThreads, 0, stream>>>(p);
  if (p.merge) MergeSplitsKernel<Q, D><<<batch * p.num_q_heads, kThreads, 0, stream>>>(p);
}

// Tensor-core decode over an FP8 cache under a bf16 or f16 q, or a cache in q's bf16 or f16 (a group of up to 16
// query heads, power-of-two pages). A CTA owns one (sequence, kv head, split); its warps take 16-key chunks in
// turn, each warp copying its next chunks into its own shared-memory ring (cp.async) while it computes one, and
// merge their softmax states at the end. Per chunk, S^T = K q^T and O^T += V^T P^T run as mma.sync m16n8k16 with
// f32 sums (in f16 over an FP8 cache, in the cache's type over a 16-bit one): the chunk's 16 keys (S) and 16 of
// head_dim (O) are the rows (A), q's heads the 8 columns (B), so a group of up to 8 heads costs one mma a k-step
// and few registers. Since a sum does not depend on its order, each lane takes whole pieces of a row: for S, a
// quarter of two K rows (q's B fragments take the same permutation of head_dim); for O, an eighth of each of four
// V rows (O's rows come out permuted and are stored where they belong), the key pairs the A fragment wants built
// by byte permutes. e4m3 widens to f16 exactly, two at a time; S's C fragment becomes P^T's B fragment by one 8x8
// transpose (movmatrix) a half.
namespace tc {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeys = 16;  // keys a warp's chunk: the 16 rows of S^T, one 16-key step of O^T
constexpr int kMaxHeads = 16;
// Chunks in a warp's ring (kStages - 1 in flight while one is read) and CTAs an SM, by the cache's element bytes
// (E) and q's 8-head column tiles (NT): over FP8, one tile fits 4 CTAs of 3 slots (48 KiB a CTA at D = 128) in
// registers and shared memory, two tiles 3 of 4 slots; a 16-bit chunk is twice the bytes and registers: 3 CTAs of 2
// slots (64 KiB), two tiles 2 CTAs
template <int E, int NT> constexpr int kStages = E == 1 ? (NT == 1 ? 3 : 4) : 2;
template <int E, int NT> constexpr int kCtasPerSm = E == 1 ? (NT == 1 ? 4 : 3) : (NT == 1 ? 3 : 2);

__device__ __forceinline__ uint32_t Fp8PairToHalf2(uint32_t two) {  // low byte -> low half
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return uint32_t{h.x} | (uint32_t{h.y} << 16);
}

__device__ __forceinline__ float ClipHalf(float x) { return fminf(fmaxf(x, -65504.f), 65504.f); }  // f16's range

__device__ __forceinline__ uint32_t PackHalf2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t PackBf162(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The mma's input type T (__half or __nv_bfloat16): two floats packed (f16 clipped to its range, which bf16's values
// can pass).
template <typename T>
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) return PackHalf2(ClipHalf(lo), ClipHalf(hi));
  else return PackBf162(lo, hi);
}

__device__ __forceinline__ uint32_t Transpose8x8(uint32_t x) {  // a b16 8x8 matrix's fragment, transposed
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A lane (g, j) = (lane / 4, lane % 4) of a fragment holds A rows g and g + 8, B and C column g (B) or columns
// 2j, 2j + 1 (C).
template <int D, int E>
struct Chunk {
  uint32_t k[2][D * E / 16];  // keys g, g + 8: this lane's quarter of each row (4 elements a k-step)
  uint32_t v[4][D * E / 32];  // keys 2j, 2j + 1, 2j + 8, 2j + 9: this lane's eighth of each row
};

struct Range {
  const int32_t* table;
  int begin, end, kv_head, bs_shift;
};

// Byte offset of key's K/V row (keys past the range read its last one: masked, and finite).
template <int D, int E>
__device__ __forceinline__ int64_t RowOffset(const DecodeParams& p, const Range& r, int key) {
  key = min(key, r.end - 1);
  const int block = min(max(r.table[key >> r.bs_shift], 0), p.num_blocks - 1);
  const int64_t slot = (static_cast<int64_t>(block) << r.bs_shift) + (key & (p.block_size - 1));
  return (slot * p.slot_stride + static_cast<int64_t>(r.kv_head) * D) * E;
}

__device__ __forceinline__ void CopyAsync16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
               :: "r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))), "l"(src));
}

// A ring slot: K then V rows of a chunk's 16 keys, D * E bytes each, their 16-byte units swizzled by the key
// (unit u of key k at u ^ (k % units)) so that the fragment reads below hit distinct banks.
template <int D, int E>
struct Slot {
  static constexpr int kRow = D * E;
  static constexpr int kUnits = kRow / 16;
  static constexpr int kBytes = 2 * kKeys * kRow;
  __device__ static int Offset(int key, int byte) {
    return key * kRow + (((byte / 16) ^ (key % kUnits)) * 16) + byte % 16;
  }
};

// Queues the copy of chunk key0's K and V rows into a slot: each lane copies whole units.
template <int D, int E>
__device__ __forceinline__ void IssueChunk(const DecodeParams& p, const Range& r, int key0, int lane,
                                           uint8_t* slot) {
  using S = Slot<D, E>;
  const auto* k_cache = static_cast<const uint8_t*>(p.k_cache);
  const auto* v_cache = static_cast<const uint8_t*>(p.v_cache);
#pragma unroll
  for (int q = 0; q < kKeys * S::kUnits / 32; ++q) {
    const int i = lane + 32 * q, key = i / S::kUnits, byte = i % S::kUnits * 16;
    const int64_t row = RowOffset<D, E>(p, r, key0 + key) + byte;
    CopyAsync16(slot + S::Offset(key, byte), k_cache + row);
    CopyAsync16(slot + kKeys * S::kRow + S::Offset(key, byte), v_cache + row);
  }
}

// N bytes of a key's row in the slot, from its byte `at` (16-byte pieces, or one of 8), as words.
template <int D, int E, int N>
__device__ __forceinline__ void ReadBytes(const uint8_t* rows, int key, int at, uint32_t* w) {
  if constexpr (N == 8) {
    const uint2 x = *reinterpret_cast<const uint2*>(rows + Slot<D, E>::Offset(key, at));
    w[0] = x.x, w[1] = x.y;
  } else {
#pragma unroll
    for (int b = 0; b < N; b += 16) {
      const uint4 x = *reinterpret_cast<const uint4*>(rows + Slot<D, E>::Offset(key, at + b));
      w[b / 4] = x.x, w[b / 4 + 1] = x.y, w[b / 4 + 2] = x.z, w[b / 4 + 3] = x.w;
    }
  }
}

template <int D, int E>
__device__ __forceinline__ void ReadChunk(const uint8_t* slot, int lane, Chunk<D, E>& c) {
  const int g = lane / 4, j = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) ReadBytes<D, E, D * E / 4>(slot, g + 8 * h, j * (D * E / 4), c.k[h]);
  const int keys[4] = {2 * j, 2 * j + 1, 2 * j + 8, 2 * j + 9};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    ReadBytes<D, E, D * E / 8>(slot + kKeys * Slot<D, E>::kRow, keys[i], g * (D * E / 8), c.v[i]);
}

// q^T's B fragments (head g of column tile t) in the mma's type T, scaled later in f32: k-step s holds head_dim
// j * D / 4 + 4s + {0, 1} (b0 b1) and + {2, 3} (b2 b3), the order K's elements take. f16 takes bf16's values up to
// its range.
template <typename Q, typename T, int D, int NT>
__device__ void LoadQueryFragments(const DecodeParams& p, int b, int head0, int lane, uint32_t (&qb)[NT][D / 16][2]) {
  const int g = lane / 4, j = lane % 4;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float f[D / 4] = {};
    if (g + 8 * t < p.group) {
      const Q* src = static_cast<const Q*>(p.q) + (static_cast<int64_t>(b) * p.num_q_heads + head0 + g + 8 * t) * D;
      LoadFloats<Q, D / 4>(src + j * (D / 4), f);
    }
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      qb[t][s][0] = Pack<T>(f[4 * s], f[4 * s + 1]);
      qb[t][s][1] = Pack<T>(f[4 * s + 2], f[4 * s + 3]);
    }
  }
}

template <int NT>
struct Softmax {  // heads 8t + 2j + e: the running max (log2 domain, all lanes of a column) and this lane's sum
  float m[NT][2], l[NT][2];
  __device__ Softmax() {
#pragma unroll
    for (int t = 0; t < NT; ++t) m[t][0] = m[t][1] = -FLT_MAX, l[t][0] = l[t][1] = 0.f;
  }
};

// K's A fragment for k-step k: keys g and g + 8 at head_dim 4k + {0, 1} (a0 a1, a2 a3) and + {2, 3} (a4-a7) of the
// lane's quarter of the rows; an FP8 word holds all four, widened in pairs, a 16-bit row's two words hold them.
template <int D, int E>
__device__ __forceinline__ void KeyFragment(const Chunk<D, E>& c, int k, uint32_t (&a)[4]) {
  if constexpr (E == 1) {
    a[0] = Fp8PairToHalf2(c.k[0][k]), a[1] = Fp8PairToHalf2(c.k[1][k]);
    a[2] = Fp8PairToHalf2(c.k[0][k] >> 16), a[3] = Fp8PairToHalf2(c.k[1][k] >> 16);
  } else {
    a[0] = c.k[0][2 * k], a[1] = c.k[1][2 * k], a[2] = c.k[0][2 * k + 1], a[3] = c.k[1][2 * k + 1];
  }
}

// S^T for the chunk (keys g, g + 8 against heads 2j, 2j + 1 of each tile), scaled, capped and masked.
template <typename T, int D, int E, int NT>
__device__ __forceinline__ void Scores(const DecodeParams& p, const Range& r, int key0, int lane,
                                       const uint32_t (&qb)[NT][D / 16][2], const Chunk<D, E>& c,
                                       float (&s)[NT][4]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    uint32_t a[4];
    KeyFragment<D, E>(c, k, a);
#pragma unroll
    for (int t = 0; t < NT; ++t) Mma<T>(s[t], a, qb[t][k][0], qb[t][k][1]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int key = key0 + lane / 4 + 8 * (i / 2);
    const bool live = key >= r.begin && key < r.end;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float x = s[t][i] * p.q_scale;
      if (p.cap_log2e > 0.f) x = p.cap_log2e * tanhf(x);
      s[t][i] = live ? x : -INFINITY;
    }
  }
}

// V^T's A fragments for O^T tiles 2w and 2w + 1 (E = 1) or tile w (E = 2) from word w of the lane's four rows:
// rows g and g + 8 are consecutive head_dims of the word, columns the key pairs (2j, 2j + 1) and (2j + 8, 2j + 9).
template <int D, int E>
__device__ __forceinline__ void ValueFragments(const Chunk<D, E>& c, int w, uint32_t (&a)[2][4]) {
  if constexpr (E == 1) {   // bytes {0, 1} of the word are tile 2w's rows g and g + 8, bytes {2, 3} tile 2w + 1's
    const uint32_t lo01 = __byte_perm(c.v[0][w], c.v[1][w], 0x5140), hi01 = __byte_perm(c.v[0][w], c.v[1][w], 0x7362);
    const uint32_t lo89 = __byte_perm(c.v[2][w], c.v[3][w], 0x5140), hi89 = __byte_perm(c.v[2][w], c.v[3][w], 0x7362);
    a[0][0] = Fp8PairToHalf2(lo01), a[0][1] = Fp8PairToHalf2(lo01 >> 16);
    a[0][2] = Fp8PairToHalf2(lo89), a[0][3] = Fp8PairToHalf2(lo89 >> 16);
    a[1][0] = Fp8PairToHalf2(hi01), a[1][1] = Fp8PairToHalf2(hi01 >> 16);
    a[1][2] = Fp8PairToHalf2(hi89), a[1][3] = Fp8PairToHalf2(hi89 >> 16);
  } else {   // the word's low half is tile w's row g, its high half row g + 8
    a[0][0] = __byte_perm(c.v[0][w], c.v[1][w], 0x5410), a[0][1] = __byte_perm(c.v[0][w], c.v[1][w], 0x7632);
    a[0][2] = __byte_perm(c.v[2][w], c.v[3][w], 0x5410), a[0][3] = __byte_perm(c.v[2][w], c.v[3][w], 0x7632);
  }
}

template <typename T, int D, int E, int NT>
__device__ __forceinline__ void AttendChunk(const DecodeParams& p, const Range& r, int key0, int lane,
                                            const uint32_t (&qb)[NT][D / 16][2], const Chunk<D, E>& c,
                                            Softmax<NT>& sm, float (&acc)[NT][D / 16][4]) {
  float s[NT][4];
  Scores<T, D, E, NT>(p, r, key0, lane, qb, c, s);
  float alpha[NT][2];
  uint32_t pb[NT][2];  // P^T's B fragments: keys 2j, 2j + 1 (and + 8) of head g
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {  // column 2j + e: keys g and g + 8 here, the rest in the lanes of the same j
      float top = fmaxf(s[t][e], s[t][2 + e]);
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
      const float m = fmaxf(sm.m[t][e], top);
      alpha[t][e] = exp2f(sm.m[t][e] - m);
      sm.m[t][e] = m;
      s[t][e] = exp2f(s[t][e] - m), s[t][2 + e] = exp2f(s[t][2 + e] - m);
      sm.l[t][e] = sm.l[t][e] * alpha[t][e] + s[t][e] + s[t][2 + e];
    }
    pb[t][0] = Transpose8x8(Pack<T>(s[t][0], s[t][1]));
    pb[t][1] = Transpose8x8(Pack<T>(s[t][2], s[t][3]));
  }
  constexpr int kTilesAWord = 2 / E;
#pragma unroll
  for (int w = 0; w < D * E / 32; ++w) {
    uint32_t a[2][4];
    ValueFragments<D, E>(c, w, a);
#pragma unroll
    for (int h = 0; h < kTilesAWord; ++h) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float (&o)[4] = acc[t][kTilesAWord * w + h];
        o[0] *= alpha[t][0], o[1] *= alpha[t][1], o[2] *= alpha[t][0], o[3] *= alpha[t][1];
        Mma<T>(o, a[h], pb[t][0], pb[t][1]);
      }
    }
  }
}

template <int D, int NT>
struct Shared {
  float acc[kWarps][8 * NT][D + 4];  // + 4: a warp's stores spread over the banks; over the rings
  float m[kWarps][8 * NT], l[kWarps][8 * NT];
};

// O^T tile u's rows g and g + 8 are head_dim g * D / 8 + 2u and + 1 (the elements of V a lane read).
template <int D, int NT>
__device__ void StoreWarpState(Shared<D, NT>& sh, int warp, int lane, Softmax<NT>& sm,
                               const float (&acc)[NT][D / 16][4]) {
  const int g = lane / 4, j = lane % 4;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int head = 8 * t + 2 * j + e;
      float l = sm.l[t][e];
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      if (g == 0) sh.m[warp][head] = sm.m[t][e], sh.l[warp][head] = l;
#pragma unroll
      for (int u = 0; u < D / 16; ++u) {
        sh.acc[warp][head][g * (D / 8) + 2 * u] = acc[t][u][e];
        sh.acc[warp][head][g * (D / 8) + 2 * u + 1] = acc[t][u][2 + e];
      }
    }
  }
}

template <typename Q, int D, int NT>
__device__ void MergeWarps(const DecodeParams& p, const Shared<D, NT>& sh, int b, int head0, int split) {
  for (int idx = threadIdx.x; idx < p.group * D; idx += kThreads) {
    const int g = idx / D, d = idx % D;
    float top = -FLT_MAX;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) top = fmaxf(top, sh.m[w][g]);
    float sum = 0.f, denom = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = exp2f(sh.m[w][g] - top);
      sum = fmaf(weight, sh.acc[w][g][d], sum);
      denom = fmaf(weight, sh.l[w][g], denom);
    }
    const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + head0 + g;
    if (!p.partials) {
      static_cast<Q*>(p.out)[bh * D + d] = Elem<Q>::Store(denom > 0.f ? sum / denom : 0.f);
    } else {
      const int64_t part = bh * p.num_splits + split;
      p.partial_acc[part * D + d] = sum;
      if (d == 0) p.partial_ml[part * 2] = top, p.partial_ml[part * 2 + 1] = denom;
    }
  }
}

template <int D, int E, int NT>
constexpr int SharedBytes() {
  constexpr int kRings = kWarps * kStages<E, NT> * Slot<D, E>::kBytes;
  return sizeof(Shared<D, NT>) > kRings ? sizeof(Shared<D, NT>) : kRings;
}

// Q: q's and the output's type; C: the cache's (FP8 e4m3, or Q); the mma runs in f16 over FP8, else in Q.
template <typename Q, typename C, int D, int NT>
__global__ void __launch_bounds__(kThreads, (kCtasPerSm<sizeof(C), NT>))
    DecodeKernel(const DecodeParams p, int bs_shift) {
  constexpr int E = sizeof(C), kSlots = kStages<E, NT>;
  using T = std::conditional_t<E == 1, __half, Q>;
  using S = Slot<D, E>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int kv_head = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head0 = kv_head * p.group;
  // Live tokens [first, len), cut into num_splits slices of whole chunks.
  const int len = min(max(p.kv_lens[b], 0), p.max_blocks * p.block_size);
  const int first = p.window > 0 ? max(0, len - p.window) : 0;
  const int per_split = CeilDiv(CeilDiv(len - first, p.num_splits), kKeys) * kKeys;
  const Range r{p.block_tables + static_cast<int64_t>(b) * p.max_blocks, first + split * per_split,
                min(first + (split + 1) * per_split, len), kv_head, bs_shift};
  const int chunks = r.end > r.begin ? CeilDiv(r.end - r.begin, kKeys) : 0;
  const int mine = chunks > warp ? CeilDiv(chunks - warp, kWarps) : 0;  // this warp's: warp, warp + kWarps, ...
  uint8_t* ring = smem + warp * kSlots * S::kBytes;
#pragma unroll
  for (int i = 0; i < kSlots - 1; ++i) {
    if (i < mine) IssueChunk<D, E>(p, r, r.begin + (warp + i * kWarps) * kKeys, lane, ring + i * S::kBytes);
    asm volatile("cp.async.commit_group;\n" ::);  // empty groups too: the wait below counts groups
  }
  uint32_t qb[NT][D / 16][2];  // loaded while the first chunks are in flight
  LoadQueryFragments<Q, T, D, NT>(p, b, head0, lane, qb);
  Softmax<NT> sm;
  float acc[NT][D / 16][4] = {};
  for (int i = 0; i < mine; ++i) {
    const int ahead = i + kSlots - 1;  // its slot was read in the last iteration (every lane is past it)
    if (ahead < mine)
      IssueChunk<D, E>(p, r, r.begin + (warp + ahead * kWarps) * kKeys, lane, ring + ahead % kSlots * S::kBytes);
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group %0;\n" :: "n"(kSlots - 1));  // chunk i's copies, this lane's
    __syncwarp();                                                    // and every lane's
    Chunk<D, E> c;
    ReadChunk<D, E>(ring + i % kSlots * S::kBytes, lane, c);
    __syncwarp();
    AttendChunk<T, D, E, NT>(p, r, r.begin + (warp + i * kWarps) * kKeys, lane, qb, c, sm, acc);
  }
  asm volatile("cp.async.wait_all;\n" ::);
  __syncthreads();  // the merge's buffer lies over the rings
  auto& sh = *reinterpret_cast<Shared<D, NT>*>(smem);
  StoreWarpState<D, NT>(sh, warp, lane, sm, acc);
  __syncthreads();
  MergeWarps<Q, D, NT>(p, sh, b, head0, split);
}

template <typename Q, typename C, int D, int NT>
void Launch(const DecodeParams& p, int batch, int kv_heads, int bs_shift, cudaStream_t stream) {
  constexpr int kBytes = SharedBytes<D, sizeof(C), NT>();
  // More than the default 48 KiB of dynamic shared memory: a function attribute of each device's context, raised
  // once per device (a bit each; devices past 64 raise it every launch)
  static std::atomic<uint64_t> raised{0};
  int device = 0;
  cudaGetDevice(&device);
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (!(raised.load(std::memory_order_relaxed) & bit)) {
    cudaFuncSetAttribute(DecodeKernel<Q, C, D, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    raised.fetch_or(bit);
  }
  const dim3 grid(kv_heads, p.num_splits, batch);
  DecodeKernel<Q, C, D, NT><<<grid, kThreads, kBytes, stream>>>(p, bs_shift);
  if (p.merge) MergeSplitsKernel<Q, D><<<batch * p.num_q_heads, jaxserve::kThreads, 0, stream>>>(p);
}

template <typename Q, typename C>
void Dispatch(const DecodeParams& p, int head_dim, int batch, int kv_heads, int bs_shift, cudaStream_t s) {
  const bool two = p.group > 8;
  if (head_dim == 64) (two ? Launch<Q, C, 64, 2> : Launch<Q, C, 64, 1>)(p, batch, kv_heads, bs_shift, s);
  else (two ? Launch<Q, C, 128, 2> : Launch<Q, C, 128, 1>)(p, batch, kv_heads, bs_shift, s);
}

template <typename Q>
ffi::Error Dispatch(const DecodeParams& p, bool fp8, int head_dim, int batch, int kv_heads, int bs_shift,
                    cudaStream_t s) {
  (fp8 ? Dispatch<Q, __nv_fp8_e4m3> : Dispatch<Q, Q>)(p, head_dim, batch, kv_heads, bs_shift, s);
  return LaunchStatus("paged_decode_attention launch");
}

// Whether the tensor-core kernel takes these shapes: a bf16 or f16 q over an FP8 cache or one of its own type,
// head_dim 64 or 128, up to 16 query heads a kv head, power-of-two pages.
bool Takes(ffi::DataType q, ffi::DataType cache, int head_dim, int group, int block_size) {
  return (q == ffi::DataType::BF16 || q == ffi::DataType::F16) && (cache == ffi::DataType::F8E4M3FN || cache == q) &&
         (head_dim == 64 || head_dim == 128) && group <= kMaxHeads && (block_size & (block_size - 1)) == 0;
}

}  // namespace tc

template <typename Q, typename C, int D>
ffi::Error DispatchGroup(const DecodeParams& p, int group_tile, int batch, int kv_heads, cudaStream_t s) {
  switch (group_tile) {
    case 1: Launch<Q, C, D, 1>(p, batch, kv_heads, s); break;
    case 2: Launch<Q, C, D, 2>(p, batch, kv_heads, s); break;
    case 4: Launch<Q, C, D, 4>(p, batch, kv_heads, s); break;
    case 8: Launch<Q, C, D, 8>(p, batch, kv_heads, s); break;
    default: return ffi::Error::InvalidArgument("unsupported query-head group tile");
  }
  return LaunchStatus("paged_decode_attention launch");
}

template <typename Q, typename C>
ffi::Error DispatchHeadDim(const DecodeParams& p, int head_dim, int group_tile, int batch, int kv_heads,
                           cudaStream_t s) {
  switch (head_dim) {
    case 64: return DispatchGroup<Q, C, 64>(p, group_tile, batch, kv_heads, s);
    case 128: return DispatchGroup<Q, C, 128>(p, group_tile, batch, kv_heads, s);
    case 256: return DispatchGroup<Q, C, 256>(p, group_tile, batch, kv_heads, s);
    default: return ffi::Error::InvalidArgument("head_dim must be 64, 128 or 256");
  }
}

// The cache holds Q itself or FP8 e4m3 (checked by the caller).
template <typename Q>
ffi::Error DispatchCache(const DecodeParams& p, ffi::DataType cache, int head_dim, int group_tile, int batch,
                         int kv_heads, cudaStream_t s) {
  if (cache == ffi::DataType::F8E4M3FN)
    return DispatchHeadDim<Q, __nv_fp8_e4m3>(p, head_dim, group_tile, batch, kv_heads, s);
  return DispatchHeadDim<Q, Q>(p, head_dim, group_tile, batch, kv_heads, s);
}

int GroupTile(int group) {
  int tile = 1;
  while (tile < group && tile < kMaxGroupTile) tile *= 2;
  return tile;
}

ffi::Error PagedDecodeAttention(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> kv_lens,
                                ffi::Buffer<ffi::S32> block_tables, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::F32>> workspace, float sm_scale,
                                int32_t sliding_window, float soft_cap, int32_t num_splits, int32_t partials) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("expected q [B,Hq,D], cache [N,bs,Hkv,D], block_tables [B,M]");
  const int batch = qd[0], q_heads = qd[1], head_dim = qd[2], kv_heads = kd[2];
  if (kd[3] != head_dim || q_heads % kv_heads != 0 || td[0] != batch)
    return ffi::Error::InvalidArgument("inconsistent q / cache / block_tables shapes");
  if (num_splits < 1 || num_splits > kMaxSplits)
    return ffi::Error::InvalidArgument("num_splits must be in [1, 128]");
  const ffi::DataType cache = k_cache.element_type();
  if (v_cache.element_type() != cache || (cache != q.element_type() && cache != ffi::DataType::F8E4M3FN))
    return ffi::Error::InvalidArgument("k_cache and v_cache must be in q's dtype or both float8_e4m3fn");
  const int group = q_heads / kv_heads, group_tile = GroupTile(group);
  const int64_t parts = int64_t{batch} * q_heads * num_splits;
  const bool spilled = num_splits > 1 || partials;
  if (spilled && static_cast<int64_t>(workspace->element_count()) < parts * (head_dim + 2))
    return ffi::Error::InvalidArgument("workspace too small for num_splits");
  if (!partials && static_cast<int64_t>(out->element_count()) < int64_t{batch} * q_heads * head_dim)
    return ffi::Error::InvalidArgument("out must hold [B,Hq,D]");
  if (batch == 0) return ffi::Error::Success();
  float* ws = workspace->typed_data();
  const DecodeParams p{
      q.untyped_data(), k_cache.untyped_data(), v_cache.untyped_data(), kv_lens.typed_data(),
      block_tables.typed_data(), out->untyped_data(), ws, ws + parts * head_dim, q_heads, group,
      CeilDiv(group, group_tile), static_cast<int>(td[1]), static_cast<int>(kd[1]), static_cast<int>(kd[0]),
      int64_t{kv_heads} * head_dim, soft_cap > 0.f ? sm_scale / soft_cap : sm_scale * kLog2e,
      soft_cap > 0.f ? soft_cap * kLog2e : 0.f, sliding_window, num_splits, spilled, num_splits > 1 && !partials};
  if (tc::Takes(q.element_type(), cache, head_dim, group, p.block_size)) {
    const int bs_shift = __builtin_ctz(static_cast<unsigned>(p.block_size));
    const bool fp8 = cache == ffi::DataType::F8E4M3FN;
    return q.element_type() == ffi::DataType::BF16
               ? tc::Dispatch<__nv_bfloat16>(p, fp8, head_dim, batch, kv_heads, bs_shift, stream)
               : tc::Dispatch<__half>(p, fp8, head_dim, batch, kv_heads, bs_shift, stream);
  }
  switch (q.element_type()) {
    case ffi::DataType::F32: return DispatchCache<float>(p, cache, head_dim, group_tile, batch, kv_heads, stream);
    case ffi::DataType::BF16:
      return DispatchCache<__nv_bfloat16>(p, cache, head_dim, group_tile, batch, kv_heads, stream);
    case ffi::DataType::F16: return DispatchCache<__half>(p, cache, head_dim, group_tile, batch, kv_heads, stream);
    default: return ffi::Error::InvalidArgument("q dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace
}  // namespace jaxserve

// Same kernels for the same buffer addresses on every call: safe to capture.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecodeAttention, jaxserve::PagedDecodeAttention,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("num_splits")
                                  .Attr<int32_t>("partials"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
