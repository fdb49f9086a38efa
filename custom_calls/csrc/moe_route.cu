// MoE routing on XLA's stream: each token's top-k experts from its router logits, then the grouped GEMM's row
// plan for the pairs routed to this device's experts (pallas_kernels/grouped_matmul_mgpu.py reads it). XLA runs
// the same as a softmax, a top-k, a sort, a bincount, scans and searches: 13 to 26 small kernels a MoE layer, at
// decode sizes half as long as the layer's expert GEMMs.
//
// Pairs (token t, pick j) sit at p = t * top_k + j. The plan: pairs sorted by local expert g form the sorted rows;
// group g's rows start at row_start[g], its tiles read block_m rows each from base[g] (row_start[g] rounded down to
// row_align) on, and its pair at sorted row r lands at padded row tile_start[g] * block_m + r - base[g]. Rows within
// a group come in no fixed order (shared-memory atomics rank them): every row's product is the same wherever it
// lands.
#include <algorithm>
#include <cfloat>

#include "common.h"

namespace jaxserve {
namespace {

constexpr int kPlanThreads = 1024;        // the most the plan's one CTA takes: a warp a token up to 32 tokens
constexpr int kMaxExperts = 512;          // a token's logits in at most 16 registers a lane; the local ones' four
                                          // int32 arrays in shared memory (8 KiB at most)
constexpr int kPickThreads = 256;         // a warp per token
constexpr int kMaxTopK = 32;              // a lane holds each pick
constexpr int kFusedMaxTokens = 128;      // up to this many tokens the plan's CTA picks the experts too: one launch,
                                          // the pairs' groups in shared memory (16 KiB at most)
constexpr unsigned kFullMask = 0xffffffffu;

struct RouteArgs {
  const void* logits;
  const int32_t* num_live;     // [1]: tokens from here on are padding, routed nowhere
  const int32_t* expert_base;  // [1]: this device's first expert
  int tokens, experts, top_k, local_experts, block_m, row_align, max_tiles, num_rows;
  bool renormalize;
  float* weights;              // [tokens, top_k]
  int32_t* sorted_tokens;      // [num_rows]: the token of each sorted row, 0 past them
  int32_t* tile_groups;        // [max_tiles]
  int32_t* tile_rows;          // [max_tiles]
  int32_t* num_tiles;          // [1]
  int32_t* pair_rows;          // [tokens, top_k]: padded row, max_tiles * block_m for pairs in no local group
  int block_m_log2;            // block_m and row_align are powers of two: the plan's one-warp scan shifts and
                               // masks where a division would cost ~20 dependent instructions
};

__device__ __forceinline__ float Load(const float* row, int e) { return row[e]; }
__device__ __forceinline__ float Load(const __nv_bfloat16* row, int e) { return __bfloat162float(row[e]); }

// A logit as an unsigned key in the same order (-0 as +0), 0 for NaN (no candidate); every other key is > 0.
__device__ __forceinline__ uint32_t OrderKey(float v) {
  if (v != v) return 0u;
  const uint32_t u = v == 0.f ? 0u : __float_as_uint(v);
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}

__device__ __forceinline__ float KeyValue(uint32_t key) {
  return __uint_as_float(key & 0x80000000u ? key & 0x7fffffffu : ~key);
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

// One warp: token t's top_k experts by logit (lane j keeps pick j), their softmax weights (over all experts, or
// renormalised over the picks), and each pair's local expert in pair_groups (-1: padding, or another device's). The
// token's logits stay in registers, expert lane + 32 i in slot i of kSlots (experts <= 32 kSlots: a round's
// compares are the slots a lane has, not kMaxExperts' 16); NaN logits are no candidates (too few: the rest of the
// picks route nowhere). A padding token (t >= num_live) picks nothing: weight 0, routed nowhere. num_live and
// expert_base: read once by the caller.
template <typename T, int kSlots>
__device__ void PickExperts(const RouteArgs& a, int t, int lane, int num_live, int expert_base,
                            int32_t* pair_groups) {
  if (t >= num_live) {
    if (lane < a.top_k) {
      a.weights[t * a.top_k + lane] = 0.f;
      pair_groups[t * a.top_k + lane] = -1;
    }
    return;
  }
  const T* row = static_cast<const T*>(a.logits) + static_cast<int64_t>(t) * a.experts;
  float logits[kSlots];
  float top = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int e = lane + 32 * i;
    logits[i] = e < a.experts ? Load(row, e) : NAN;
    top = fmaxf(top, logits[i]);
  }
  top = WarpMax(top);
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) total += logits[i] == logits[i] ? expf(logits[i] - top) : 0.f;
  total = WarpSum(total);
  // Round j: the warp's largest key (REDUX), then among its holders the lowest expert (the complement's largest);
  // the holder clears it. A lane's own candidates: the first slot of its largest key, the lowest expert there.
  uint32_t keys[kSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) keys[i] = OrderKey(logits[i]);
  float mine = 0.f;
  int my_index = -1;
  for (int j = 0; j < a.top_k; ++j) {
    uint32_t best = 0u;
    int best_index = 0;
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if (keys[i] > best) best = keys[i], best_index = lane + 32 * i;
    const uint32_t top_key = __reduce_max_sync(kFullMask, best);
    if (top_key == 0u) break;
    const int index = ~static_cast<int>(
        __reduce_max_sync(kFullMask, best == top_key ? ~static_cast<uint32_t>(best_index) : 0u));
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if (lane + 32 * i == index) keys[i] = 0u;
    if (lane == j) mine = KeyValue(top_key), my_index = index;
  }
  float weight = my_index >= 0 ? expf(mine - top) / total : 0.f;
  if (a.renormalize) weight /= WarpSum(weight);
  if (lane < a.top_k) {
    const int pair = t * a.top_k + lane, local = my_index - expert_base;
    const bool routed = my_index >= 0 && local >= 0 && local < a.local_experts;
    a.weights[pair] = weight;
    pair_groups[pair] = routed ? local : -1;
  }
}

template <typename T, int kSlots>
__global__ void __launch_bounds__(kPickThreads) PickKernel(RouteArgs a) {
  const int t = blockIdx.x * (kPickThreads / 32) + threadIdx.x / 32;
  if (t < a.tokens) PickExperts<T, kSlots>(a, t, threadIdx.x % 32, *a.num_live, *a.expert_base, a.pair_rows);
}

// Warp 0: each group's first sorted row, aligned base and first tile (each lane scans a run of groups, the lanes
// meet by shuffles); totals = (routed rows, planned tiles). tile_start holds the groups' tile counts on entry.
__device__ void ScanGroups(const RouteArgs& a, const int32_t* count, int32_t* row_start, int32_t* base,
                           int32_t* tile_start, int32_t* totals, int lane) {
  const int run = CeilDiv(a.local_experts, 32);
  const int first = min(lane * run, a.local_experts), end = min(first + run, a.local_experts);
  int rows = 0;
  for (int g = first; g < end; ++g) rows += count[g];
  int rows_before = rows;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int up = __shfl_up_sync(kFullMask, rows_before, offset);
    if (lane >= offset) rows_before += up;
  }
  rows_before -= rows;
  int tiles = 0;
  for (int g = first, r = rows_before; g < end; r += count[g], ++g) {
    row_start[g] = r;
    base[g] = r & -a.row_align;
    tile_start[g] = count[g] > 0 ? (r + count[g] - base[g] + a.block_m - 1) >> a.block_m_log2 : 0;
    tiles += tile_start[g];
  }
  int tiles_before = tiles;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int up = __shfl_up_sync(kFullMask, tiles_before, offset);
    if (lane >= offset) tiles_before += up;
  }
  if (lane == 31) totals[0] = rows_before + rows, totals[1] = tiles_before;
  tiles_before -= tiles;
  for (int g = first; g < end; ++g) {
    const int n = tile_start[g];
    tile_start[g] = tiles_before;
    tiles_before += n;
  }
}

// One CTA: counts the pairs per local expert, plans the tiles, then ranks each pair within its group (a
// shared-memory atomic) into its sorted row and padded row. With `pick`, it picks the experts first, into shared
// memory; else PickKernel left each pair's group in pair_rows.
template <typename T, int kSlots>
__global__ void __launch_bounds__(kPlanThreads) PlanKernel(RouteArgs a, bool pick) {
  extern __shared__ int32_t groups[];   // count, row_start, base, tile_start: [local_experts] each; with `pick`,
                                        // each pair's group: [tokens * top_k]
  __shared__ int32_t totals[2];
  int32_t *count = groups, *row_start = count + a.local_experts, *base = row_start + a.local_experts;
  int32_t* tile_start = base + a.local_experts;
  int32_t* pair_groups = pick ? tile_start + a.local_experts : a.pair_rows;
  const int lane = threadIdx.x % 32, pairs = a.tokens * a.top_k;
  if (pick) {
    const int num_live = *a.num_live, expert_base = *a.expert_base;
    for (int t = threadIdx.x / 32; t < a.tokens; t += blockDim.x / 32)
      PickExperts<T, kSlots>(a, t, lane, num_live, expert_base, pair_groups);
  }
  for (int g = threadIdx.x; g < a.local_experts; g += blockDim.x) count[g] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x)
    if (const int g = pair_groups[p]; g >= 0) atomicAdd(&count[g], 1);
  __syncthreads();
  if (threadIdx.x < 32) ScanGroups(a, count, row_start, base, tile_start, totals, lane);
  __syncthreads();
  for (int g = threadIdx.x; g < a.local_experts; g += blockDim.x) {
    const int tiles = count[g] > 0 ? (row_start[g] + count[g] - base[g] + a.block_m - 1) >> a.block_m_log2 : 0;
    for (int i = 0; i < tiles && tile_start[g] + i < a.max_tiles; ++i) {
      a.tile_groups[tile_start[g] + i] = g;
      a.tile_rows[tile_start[g] + i] = base[g] + (i << a.block_m_log2);
    }
  }
  for (int i = totals[1] + threadIdx.x; i < a.max_tiles; i += blockDim.x) a.tile_groups[i] = a.tile_rows[i] = 0;
  for (int r = totals[0] + threadIdx.x; r < a.num_rows; r += blockDim.x) a.sorted_tokens[r] = 0;
  if (threadIdx.x == 0) *a.num_tiles = totals[1];
  __syncthreads();   // the counts become each group's next free rank
  for (int g = threadIdx.x; g < a.local_experts; g += blockDim.x) count[g] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int g = pair_groups[p];
    if (g < 0) {
      a.pair_rows[p] = a.max_tiles * a.block_m;
      continue;
    }
    const int r = row_start[g] + atomicAdd(&count[g], 1);
    a.sorted_tokens[r] = p / a.top_k;
    a.pair_rows[p] = (tile_start[g] << a.block_m_log2) + r - base[g];
  }
}

template <typename T, int kSlots>
ffi::Error Launch(cudaStream_t stream, const RouteArgs& a) {
  const bool fused = a.tokens <= kFusedMaxTokens;
  const size_t shared = sizeof(int32_t) * (4 * a.local_experts + (fused ? a.tokens * a.top_k : 0));
  if (!fused) PickKernel<T, kSlots><<<CeilDiv(a.tokens, kPickThreads / 32), kPickThreads, 0, stream>>>(a);
  // picking in the CTA: a warp a token (up to kPlanThreads / 32, then several each); fewer threads sync sooner
  const int threads = fused ? std::clamp(32 * a.tokens, 128, kPlanThreads) : kPlanThreads;
  PlanKernel<T, kSlots><<<1, threads, shared, stream>>>(a, fused);
  return LaunchStatus("moe_route launch");
}

// The fewest register slots a lane that hold the experts' logits: 1, 2, 4, 8 or 16.
template <typename T>
ffi::Error LaunchForExperts(cudaStream_t stream, const RouteArgs& a) {
  if (a.experts <= 32) return Launch<T, 1>(stream, a);
  if (a.experts <= 64) return Launch<T, 2>(stream, a);
  if (a.experts <= 128) return Launch<T, 4>(stream, a);
  if (a.experts <= 256) return Launch<T, 8>(stream, a);
  return Launch<T, kMaxExperts / 32>(stream, a);
}

ffi::Error MoeRoute(cudaStream_t stream, ffi::AnyBuffer logits, ffi::Buffer<ffi::S32> num_live,
                    ffi::Buffer<ffi::S32> expert_base, ffi::Result<ffi::Buffer<ffi::F32>> weights,
                    ffi::Result<ffi::Buffer<ffi::S32>> sorted_tokens, ffi::Result<ffi::Buffer<ffi::S32>> tile_groups,
                    ffi::Result<ffi::Buffer<ffi::S32>> tile_rows, ffi::Result<ffi::Buffer<ffi::S32>> num_tiles,
                    ffi::Result<ffi::Buffer<ffi::S32>> pair_rows, int32_t top_k, int32_t renormalize,
                    int32_t local_experts, int32_t block_m, int32_t row_align) {
  const auto dims = logits.dimensions();
  const auto type = logits.element_type();
  if (dims.size() != 2 || (type != ffi::DataType::F32 && type != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("logits must be [tokens, experts] in f32 or bf16");
  RouteArgs a{logits.untyped_data(), num_live.typed_data(), expert_base.typed_data(),
              static_cast<int>(dims[0]), static_cast<int>(dims[1]), top_k, local_experts, block_m, row_align,
              static_cast<int>(tile_groups->element_count()), static_cast<int>(sorted_tokens->element_count()),
              renormalize != 0, weights->typed_data(), sorted_tokens->typed_data(), tile_groups->typed_data(),
              tile_rows->typed_data(), num_tiles->typed_data(), pair_rows->typed_data()};
  const size_t pairs = static_cast<size_t>(a.tokens) * top_k;
  if (top_k < 1 || top_k > kMaxTopK || top_k > a.experts || a.experts > kMaxExperts)
    return ffi::Error::InvalidArgument("top_k must be in [1, min(32, experts)], experts at most 512");
  const auto power_of_two = [](int v) { return v > 0 && (v & (v - 1)) == 0; };
  if (local_experts < 1 || local_experts > a.experts || !power_of_two(block_m) || !power_of_two(row_align))
    return ffi::Error::InvalidArgument("local_experts must be in [1, experts]; block_m and row_align powers of two");
  a.block_m_log2 = __builtin_ctz(block_m);
  if (weights->element_count() != pairs || pair_rows->element_count() != pairs ||
      sorted_tokens->element_count() < pairs || tile_rows->element_count() != tile_groups->element_count() ||
      num_tiles->element_count() != 1 || num_live.element_count() != 1 || expert_base.element_count() != 1)
    return ffi::Error::InvalidArgument("weights and pair_rows must be [tokens, top_k], sorted_tokens at least as "
                                       "long, tile_groups and tile_rows alike; num_tiles, num_live, expert_base [1]");
  if (a.tokens == 0) return ffi::Error::Success();
  return type == ffi::DataType::F32 ? LaunchForExperts<float>(stream, a) : LaunchForExperts<__nv_bfloat16>(stream, a);
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMoeRoute, jaxserve::MoeRoute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int32_t>("top_k")
                                  .Attr<int32_t>("renormalize")
                                  .Attr<int32_t>("local_experts")
                                  .Attr<int32_t>("block_m")
                                  .Attr<int32_t>("row_align"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
