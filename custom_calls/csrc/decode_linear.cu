// Linears for decode-sized steps: y_g [M, N_g] = x [M, K] bf16 . W_g for up to kMaxGroups weights that read the
// same x (q/k/v, gate/up) in one launch, M <= 16. A weight is either e4m3 [N_g, K] with a scale [N_g] per output
// channel (W8A16), or bf16 [K, N_g] as nnx.Linear keeps its kernel.
//
// Such a step is bound by reading the weights, so each weight element is read once, (widened to bf16 in
// registers) and fed to the tensor cores (mma.sync m16n8k16, f32 accumulation) as the A operand, 16 output
// channels a tile, with the tokens as B, 8 a tile: 16 rows cost what one does. Within one k16 step of an mma the
// order of k is free, and so is the order of a tile's channels: a lane's weight loads are 16 contiguous bytes and
// its activation loads the 16 activations they multiply, not the mma's interleaved fragment layout (`Weights`
// below: an e4m3 lane reads along K, a bf16 [K, N] lane reads its channels along N on 16 rows of K). A launch
// costs a few microseconds of ramp and tail whatever it reads, so the weights of one input share one. A step's
// live rows (the first ones; the rest pad its bucket) may be given: past them no activation is read and no product
// made, and those outputs are zeros. Gated, two e4m3 weights of one shape (an MLP's gate and up) give one output,
// silu(gate) * up, made where the two sums meet: no product kernel after the launch, half the bytes written.
//
// Grid (sum of N_g / tile_n, splits): a CTA owns tile_n = 16 * warp_tiles * warps_n output channels of one weight
// (gated: tile_n / 2 channels of both) and one of `splits` slices of K. Its warps form warps_n columns of
// 16 * warp_tiles channels by kWarps / warps_n rows that take the slice's kChunkK-wide chunks in turn, each
// chunk's loads issued before the chunk before it is multiplied. At 16 rows the activations are as many bytes as
// e4m3 weight tiles they multiply: a warp's warp_tiles m16 tiles share them in registers, the warps of a row share
// them through L1. The warps' sums meet in shared memory. Splits of one tile meet in a thread-block cluster's
// distributed shared memory on sm_90 (no second kernel), elsewhere as f32 partials in the workspace that a second
// kernel sums.
#include <cooperative_groups.h>

#include "common.h"

namespace jaxserve {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kChunkK = 64;   // k per chunk: 4 lanes x 16 of a weight's K
constexpr int kMaxRows = 16;  // tokens: two n8 tiles
constexpr int kMaxClusterSplits = 8;  // the portable cluster size
constexpr int kMergeThreads = 256;
constexpr int kMaxGroups = 3;

enum class Format { kE4m3NK, kBf16KN };  // e4m3 [N, K] with a scale per channel; bf16 [K, N]

struct LinearParams {
  const __nv_bfloat16* x;             // [M, K]
  const int32_t* live;                // [1]: the live rows (null: all M)
  const void* w[kMaxGroups];          // e4m3 [N_g, K] or bf16 [K, N_g]
  const float* scale[kMaxGroups];     // [N_g] (null: no scale)
  __nv_bfloat16* y[kMaxGroups];       // [M, N_g]
  int n[kMaxGroups];
  int tile_begin[kMaxGroups + 1];     // each weight's first CTA column, then the grid's width
  int col_begin[kMaxGroups + 1];      // each weight's first column in the partials, then their width
  float* partial;                     // [splits, M, sum N_g] when splits > 1 outside a cluster
  int groups, m, k, chunks_per_split;
  bool cluster;                       // splits meet in the cluster's shared memory
  bool gated;                         // y[0] = silu(gate) * up of w[0] (gate) and w[1] (up), one N
};

// a[i] for a small runtime i without indexing the parameter space
template <typename T, int N>
__device__ __forceinline__ T Pick(const T (&a)[N], int i) {
  return i == 0 ? a[0] : i == 1 ? a[1] : a[2];
}

// The weight (group) that owns CTA column `column`.
__device__ __forceinline__ int GroupOf(const LinearParams& p, int column) {
  int g = 0;
#pragma unroll
  for (int i = 1; i < kMaxGroups; ++i) g += i < p.groups && column >= p.tile_begin[i];
  return g;
}

__device__ __forceinline__ float Scaled(float v, const float* scale, int channel) {
  return scale ? v * scale[channel] : v;
}

// A gated launch's output channel from its gate and up sums.
__device__ __forceinline__ __nv_bfloat16 Gated(const LinearParams& p, float gate, float up, int channel) {
  return __float2bfloat16(SiluMul(Scaled(gate, p.scale[0], channel), Scaled(up, p.scale[1], channel)));
}

// Two e4m3 bytes of `word` (picked by a __byte_perm selector that puts each in the low byte of a 16-bit half)
// -> bf16x2. Sign, exponent and mantissa moved into place give value * 2^-120 exactly, subnormals included;
// one bf16x2 FMA by 2^120 (0x7B80; + -0 keeps a zero's sign) restores the value, exactly. e4m3's NaN patterns
// (never written by the quantizer) come out finite. The moves are integer multiply-adds, issued to the FMA pipe
// beside the ALU pipe's byte permutes and addressing (3% faster than shifts and masks on an H200): x16 puts
// exponent and mantissa at bits 4-10 and the sign at bit 11 of each half, and adding the sign bit x15 carries it
// to bit 15 with bit 11 cleared; no half carries into the next.
__device__ __forceinline__ uint32_t WidenPair(uint32_t word, uint32_t selector) {
  const uint32_t placed = __byte_perm(word, 0u, selector) * 16u;
  const uint32_t scaled = (placed & 0x08000800u) * 15u + placed;
  uint32_t out;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(scaled), "r"(0x7B807B80u), "r"(0x80008000u));
  return out;
}
constexpr uint32_t kLowPair = 0x4140;   // bytes 0, 1
constexpr uint32_t kHighPair = 0x4342;  // bytes 2, 3
constexpr uint32_t kLowHalves = 0x5410;   // the low bf16 of two words
constexpr uint32_t kHighHalves = 0x7632;  // the high bf16 of two words

__device__ __forceinline__ void Unpack(const uint4& v, uint32_t* w) {
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
}

// A warp's weight tiles by format: where lane (g = lane / 4, t = lane % 4) loads a chunk from, how its loads
// become tile a's A fragment of k16 step j (rows g and g + 8; columns 2t, 2t + 1 | 2t + 8, 2t + 9), and which of
// the warp's 16 * kTiles channels a fragment row is (Channel). Logical columns {2t, 2t + 1 | 2t + 8, 2t + 9} of
// step j are physical k 16t + 4j + {0, 1 | 2, 3} in both: what the activation loads hold.
template <Format F, int kTiles>
struct Weights;

// e4m3 [N, K]: a lane reads 16 bytes along K (all four k16 steps) of rows g and g + 8 of each tile; the low and
// high byte pairs of word j are step j's columns.
template <int kTiles>
struct Weights<Format::kE4m3NK, kTiles> {
  struct Regs {
    uint32_t v[kTiles][2][4];
  };
  const uint8_t* rows[kTiles][2];

  // The CTA's columns from n0 on, the warp's from `column` on; columns from `half` on (whole tiles) are w2's
  // channels from n0 on (gated), the others w's.
  __device__ __forceinline__ Weights(const void* w, const void* w2, int half, int k, int /*n*/, int n0, int column,
                                     int g, int t) {
#pragma unroll
    for (int a = 0; a < kTiles; ++a)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool second = column + 16 * a >= half;
        const int channel = n0 + column + Channel(a, g, h) - (second ? half : 0);
        rows[a][h] = static_cast<const uint8_t*>(second ? w2 : w) + static_cast<int64_t>(channel) * k + 16 * t;
      }
  }
  __device__ __forceinline__ void Load(Regs& r, int c) const {
#pragma unroll
    for (int a = 0; a < kTiles; ++a)
#pragma unroll
      for (int h = 0; h < 2; ++h) Unpack(__ldcs(reinterpret_cast<const uint4*>(rows[a][h] + c * kChunkK)), r.v[a][h]);
  }
  __device__ __forceinline__ static void Fragment(const Regs& r, int a, int j, uint32_t* frag) {
    frag[0] = WidenPair(r.v[a][0][j], kLowPair);
    frag[1] = WidenPair(r.v[a][1][j], kLowPair);
    frag[2] = WidenPair(r.v[a][0][j], kHighPair);
    frag[3] = WidenPair(r.v[a][1][j], kHighPair);
  }
  __device__ __forceinline__ static int Channel(int a, int g, int h) { return 16 * a + g + 8 * h; }
};

// bf16 [K, N]: a lane reads its 2 * kTiles adjacent channels (one 4 * kTiles-byte load) on each of K rows
// 16t .. 16t + 15 of a chunk, the warp's 8 lanes of one t a row's 32 * kTiles contiguous bytes. Tile a's rows
// g and g + 8 are the lane's channels 2a and 2a + 1: one word of each K row, whose two halves go to the two rows.
template <int kTiles>
struct Weights<Format::kBf16KN, kTiles> {
  static_assert(kTiles == 2 || kTiles == 4, "one 8- or 16-byte load a K row");
  struct Regs {
    uint32_t v[16][kTiles];
  };
  const __nv_bfloat16* first;  // row 16t of chunk 0, the lane's first channel
  int n;

  __device__ __forceinline__ Weights(const void* w, const void* /*w2*/, int /*half*/, int /*k*/, int n_, int n0,
                                     int column, int g, int t)
      : first(static_cast<const __nv_bfloat16*>(w) + static_cast<int64_t>(16 * t) * n_ + n0 + column +
              2 * kTiles * g),
        n(n_) {}
  __device__ __forceinline__ void Load(Regs& r, int c) const {
    const __nv_bfloat16* row = first + static_cast<int64_t>(c) * kChunkK * n;
#pragma unroll
    for (int i = 0; i < 16; ++i, row += n) {
      if constexpr (kTiles == 4) {
        Unpack(__ldcs(reinterpret_cast<const uint4*>(row)), r.v[i]);
      } else {
        const uint2 v = __ldcs(reinterpret_cast<const uint2*>(row));
        r.v[i][0] = v.x;
        r.v[i][1] = v.y;
      }
    }
  }
  __device__ __forceinline__ static void Fragment(const Regs& r, int a, int j, uint32_t* frag) {
    frag[0] = __byte_perm(r.v[4 * j][a], r.v[4 * j + 1][a], kLowHalves);
    frag[1] = __byte_perm(r.v[4 * j][a], r.v[4 * j + 1][a], kHighHalves);
    frag[2] = __byte_perm(r.v[4 * j + 2][a], r.v[4 * j + 3][a], kLowHalves);
    frag[3] = __byte_perm(r.v[4 * j + 2][a], r.v[4 * j + 3][a], kHighHalves);
  }
  __device__ __forceinline__ static int Channel(int a, int g, int h) { return 2 * kTiles * g + 2 * a + h; }
};

__device__ __forceinline__ void Mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One kChunkK-wide chunk of a warp's weights and activations, in registers. A lane's activation loads are its
// tokens' (B column g of each n8 tile) physical k 16t .. 16t + 15: step j's words 2j and 2j + 1.
template <Format F, int kTiles, int kRowTiles>
struct Chunk {
  using Tiles = Weights<F, kTiles>;
  typename Tiles::Regs w;
  uint32_t x[kRowTiles][8];

  __device__ __forceinline__ void Load(const Tiles& tiles, const __nv_bfloat16* const (&x_rows)[kRowTiles],
                                       const bool (&x_live)[kRowTiles], int c) {
    tiles.Load(w, c);
#pragma unroll
    for (int b = 0; b < kRowTiles; ++b)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        Unpack(x_live[b] ? __ldg(reinterpret_cast<const uint4*>(x_rows[b] + c * kChunkK) + i) : make_uint4(0, 0, 0, 0),
               x[b] + 4 * i);
  }

  // live_tiles: the n8 row tiles holding a live row (the same for the whole CTA)
  __device__ __forceinline__ void Multiply(float (&acc)[kTiles][kRowTiles][4], int live_tiles) const {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int a = 0; a < kTiles; ++a) {
        uint32_t frag[4];
        Tiles::Fragment(w, a, j, frag);
#pragma unroll
        for (int b = 0; b < kRowTiles; ++b)
          if (b < live_tiles) Mma(acc[a][b], frag, x[b][2 * j], x[b][2 * j + 1]);
      }
  }
};

template <Format F, int kRowTiles, int kWarpsN, int kTiles>
__global__ void __launch_bounds__(kThreads) DecodeLinearKernel(LinearParams p) {
  using Tiles = Weights<F, kTiles>;
  constexpr int kWarpsK = kWarps / kWarpsN, kWarpN = 16 * kTiles, kTileN = kWarpN * kWarpsN;
  constexpr int kPerThread = CeilDiv(kTileN * kMaxRows, kThreads);
  // the warps' sums ([row] padded against bank conflicts), then the CTA's ([row][channel]) for its cluster
  __shared__ float sums[kWarps][kWarpN][kMaxRows + 1];
  float* tile = &sums[0][0][0];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // the CTA's output channels: kTileN of one weight, or gated the first `half` columns' of gate, the rest's of up
  const int half = p.gated ? kTileN / 2 : kTileN;
  const int group = GroupOf(p, blockIdx.x), n = Pick(p.n, group);
  const int wn = warp % kWarpsN, wk = warp / kWarpsN, n0 = (blockIdx.x - Pick(p.tile_begin, group)) * half;
  const float* const scale = Pick(p.scale, group);
  __nv_bfloat16* const y = Pick(p.y, group);
  const int begin = blockIdx.y * p.chunks_per_split;
  const int end = min(begin + p.chunks_per_split, p.k / kChunkK);
  const Tiles tiles(Pick(p.w, group), p.gated ? p.w[1] : p.w[0], half, p.k, n, n0, kWarpN * wn, g, t);

  const __nv_bfloat16* x_rows[kRowTiles];
  bool x_live[kRowTiles];  // tokens past the live ones read as zeros
  const int live = p.live ? max(0, min(*p.live, p.m)) : p.m, live_tiles = CeilDiv(live, 8);
#pragma unroll
  for (int b = 0; b < kRowTiles; ++b) {
    x_live[b] = 8 * b + g < live;
    x_rows[b] = p.x + static_cast<int64_t>(min(8 * b + g, p.m - 1)) * p.k + 16 * t;
  }

  // Two chunks' registers: the next chunk's loads are in flight while the current one is multiplied.
  float acc[kTiles][kRowTiles][4] = {};
  Chunk<F, kTiles, kRowTiles> even, odd;
  int c = begin + wk;
  if (c < end) even.Load(tiles, x_rows, x_live, c);
  while (c < end) {
    if (c + kWarpsK < end) odd.Load(tiles, x_rows, x_live, c + kWarpsK);
    even.Multiply(acc, live_tiles);
    if ((c += kWarpsK) >= end) break;
    if (c + kWarpsK < end) even.Load(tiles, x_rows, x_live, c + kWarpsK);
    odd.Multiply(acc, live_tiles);
    c += kWarpsK;
  }

#pragma unroll
  for (int a = 0; a < kTiles; ++a)
#pragma unroll
    for (int b = 0; b < kRowTiles; ++b)
#pragma unroll
      for (int r = 0; r < 4; ++r) sums[warp][Tiles::Channel(a, g, r / 2)][8 * b + 2 * t + r % 2] = acc[a][b][r];
  __syncthreads();
  const auto column_sum = [&](int row, int col) {  // the CTA's sum of one output, over its warp rows
    float s = 0.f;
#pragma unroll
    for (int k_row = 0; k_row < kWarpsK; ++k_row) s += sums[k_row * kWarpsN + col / kWarpN][col % kWarpN][row];
    return s;
  };
  if (p.gated && gridDim.y == 1) {  // a channel's gate and up sums meet in one thread
    for (int i = threadIdx.x; i < half * p.m; i += kThreads) {
      const int row = i / half, c = i % half;
      y[static_cast<int64_t>(row) * n + n0 + c] = Gated(p, column_sum(row, c), column_sum(row, c + half), n0 + c);
    }
    return;
  }
  const int outputs = kTileN * p.m;
  float out[kPerThread];
#pragma unroll
  for (int o = 0; o < kPerThread; ++o) {
    const int i = threadIdx.x + o * kThreads;
    out[o] = i < outputs ? column_sum(i / kTileN, i % kTileN) : 0.f;
  }
  if (gridDim.y > 1 && p.cluster) __syncthreads();  // every sum read before `tile` (over them) is written
#pragma unroll
  for (int o = 0; o < kPerThread; ++o) {
    const int i = threadIdx.x + o * kThreads, row = i / kTileN, col = i % kTileN;
    if (i >= outputs) break;
    if (gridDim.y == 1)
      y[static_cast<int64_t>(row) * n + n0 + col] = __float2bfloat16(Scaled(out[o], scale, n0 + col));
    else if (p.cluster)
      tile[i] = out[o];
    else  // gated: gate's columns, then up's
      p.partial[(static_cast<int64_t>(blockIdx.y) * p.m + row) * p.col_begin[kMaxGroups] +
                (col < half ? Pick(p.col_begin, group) + n0 + col : p.col_begin[1] + n0 + col - half)] = out[o];
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (gridDim.y > 1 && p.cluster) {  // CTA r of the cluster finishes outputs r, r + splits, ...
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const int splits = gridDim.y;
    for (int i = blockIdx.y + splits * threadIdx.x; i < half * p.m; i += splits * kThreads) {
      const int row = i / half, c = i % half, at = row * kTileN + c;
      float s = 0.f, up = 0.f;
      for (int r = 0; r < splits; ++r) {
        const float* rank = cluster.map_shared_rank(tile, r);
        s += rank[at];
        if (p.gated) up += rank[at + half];
      }
      y[static_cast<int64_t>(row) * n + n0 + c] =
          p.gated ? Gated(p, s, up, n0 + c) : __float2bfloat16(Scaled(s, scale, n0 + c));
    }
    cluster.sync();  // no CTA leaves while another reads its shared memory
  }
#endif
}

// Gated: one thread an output channel, its gate and up partials.
__global__ void __launch_bounds__(kMergeThreads) MergeSplitsKernel(LinearParams p, int splits) {
  const int width = p.col_begin[kMaxGroups];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kMergeThreads + threadIdx.x, size = int64_t{p.m} * width;
  if (p.gated) {
    const int n = p.n[0];
    if (i >= int64_t{p.m} * n) return;
    const int64_t at = i / n * width + i % n;
    float gate = 0.f, up = 0.f;
    for (int split = 0; split < splits; ++split) {
      gate += p.partial[split * size + at];
      up += p.partial[split * size + at + n];
    }
    p.y[0][i] = Gated(p, gate, up, i % n);
    return;
  }
  if (i >= size) return;
  float s = 0.f;
  for (int split = 0; split < splits; ++split) s += p.partial[split * size + i];
  const int row = i / width, col = i % width;
  int group = 0;
#pragma unroll
  for (int g = 1; g < kMaxGroups; ++g) group += g < p.groups && col >= p.col_begin[g];
  const int c = col - Pick(p.col_begin, group);
  Pick(p.y, group)[static_cast<int64_t>(row) * Pick(p.n, group) + c] =
      __float2bfloat16(Scaled(s, Pick(p.scale, group), c));
}

bool HasClusters() {
  static const bool has = [] {
    int device = 0, major = 0;
    return cudaGetDevice(&device) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
  }();
  return has;
}

template <Format F, int kRowTiles, int kWarpsN, int kTiles>
cudaError_t LaunchLinear(const LinearParams& p, int splits, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(p.tile_begin[kMaxGroups], splits);
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  if (p.cluster) {
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = 1;
    cluster[0].val.clusterDim.y = splits;
    cluster[0].val.clusterDim.z = 1;
    config.attrs = cluster;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, DecodeLinearKernel<F, kRowTiles, kWarpsN, kTiles>, p);
}

template <Format F, int kRowTiles>
cudaError_t DispatchTile(const LinearParams& p, int warps_n, int warp_tiles, int splits, cudaStream_t stream) {
  switch (warps_n * 10 + warp_tiles) {
    case 12: return LaunchLinear<F, kRowTiles, 1, 2>(p, splits, stream);
    case 14: return LaunchLinear<F, kRowTiles, 1, 4>(p, splits, stream);
    case 22: return LaunchLinear<F, kRowTiles, 2, 2>(p, splits, stream);
    case 24: return LaunchLinear<F, kRowTiles, 2, 4>(p, splits, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <Format F>
cudaError_t Dispatch(const LinearParams& p, int warps_n, int warp_tiles, int splits, cudaStream_t stream) {
  return p.m <= 8 ? DispatchTile<F, 1>(p, warps_n, warp_tiles, splits, stream)
                  : DispatchTile<F, 2>(p, warps_n, warp_tiles, splits, stream);
}

// Weight g of the call into p: e4m3 w [N, K] and its f32 scale [N] (args 2g, 2g + 1), or bf16 w [K, N] (arg g),
// and its output (ret g; gated: ret 0 for both).
ffi::Error ReadWeight(LinearParams& p, ffi::RemainingArgs& args, ffi::RemainingRets& rets, int g, bool kn,
                      int tile_n) {
  auto w = args.get<ffi::AnyBuffer>(kn ? g : 2 * g);
  auto y = rets.get<ffi::AnyBuffer>(p.gated ? 0 : g);
  if (!w.has_value() || !y.has_value() || (*y)->element_type() != ffi::DataType::BF16 || w->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("decode_linear: each weight must be 2-d and each y bf16");
  const auto wd = w->dimensions();
  const int64_t n = kn ? wd[1] : wd[0];
  if (w->element_type() != (kn ? ffi::DataType::BF16 : ffi::DataType::F8E4M3FN) || (kn ? wd[0] : wd[1]) != p.k ||
      n % tile_n)
    return ffi::Error::InvalidArgument("decode_linear needs bf16 w [K, N] or float8_e4m3fn w [N, K], N % (16 * "
                                       "warp_tiles * warps_n) == 0");
  if (!kn) {
    auto scale = args.get<ffi::Buffer<ffi::F32>>(2 * g + 1);
    if (!scale.has_value() || scale->element_count() != static_cast<size_t>(n))
      return ffi::Error::InvalidArgument("decode_linear: an e4m3 weight [N, K] needs an f32 scale [N]");
    p.scale[g] = scale->typed_data();
  }
  p.w[g] = w->untyped_data();
  p.y[g] = static_cast<__nv_bfloat16*>((*y)->untyped_data());
  p.n[g] = n;
  p.tile_begin[g + 1] = p.tile_begin[g] + n / tile_n;
  p.col_begin[g + 1] = p.col_begin[g] + n;
  return ffi::Error::Success();
}

// args: the weights (weights_kn: bf16 w_g [K, N_g]; else e4m3 (w_g [N_g, K], scale_g [N_g]) pairs), then (with_live)
// the live rows, int32 [1]; rets: y_g for each (gated: silu(y_0) * y_1 alone), then the workspace.
ffi::Error DecodeLinear(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        int32_t splits, int32_t warps_n, int32_t warp_tiles, int32_t with_live, int32_t weights_kn,
                        int32_t gated) {
  const auto xd = x.dimensions();
  const int per_weight = weights_kn ? 1 : 2;
  const int groups = (static_cast<int>(args.size()) - (with_live ? 1 : 0)) / per_weight;
  if (x.element_type() != ffi::DataType::BF16 || xd.size() != 2)
    return ffi::Error::InvalidArgument("decode_linear takes bf16 x [M, K]");
  if (groups < 1 || groups > kMaxGroups || args.size() != per_weight * groups + (with_live ? 1 : 0) ||
      rets.size() != (gated ? 1 : groups) + 1)
    return ffi::Error::InvalidArgument("decode_linear takes 1 to 3 weights and gives one y each (gated: one)");
  if (gated && (groups != 2 || weights_kn))
    return ffi::Error::InvalidArgument("decode_linear: gated takes two e4m3 weights, gate and up");
  if (warps_n != 1 && warps_n != 2) return ffi::Error::InvalidArgument("warps_n must be 1 or 2");
  if (warp_tiles != 2 && warp_tiles != 4) return ffi::Error::InvalidArgument("warp_tiles must be 2 or 4");
  const int m = xd[0], k = xd[1], tile_n = 16 * warp_tiles * warps_n;
  if (m < 1 || m > kMaxRows || k % kChunkK)
    return ffi::Error::InvalidArgument("decode_linear needs 1 <= M <= 16, K % 64 == 0");
  LinearParams p{static_cast<const __nv_bfloat16*>(x.untyped_data())};
  p.m = m;
  p.k = k;
  p.gated = gated;
  for (int g = 0; g < groups; ++g)
    if (ffi::Error err = ReadWeight(p, args, rets, g, weights_kn, tile_n); err.failure()) return err;
  for (int g = groups; g < kMaxGroups; ++g) {
    p.tile_begin[g + 1] = p.tile_begin[g];
    p.col_begin[g + 1] = p.col_begin[g];
  }
  if (gated) {  // one weight's CTA columns of tile_n / 2 channels each: group 0 owns them all
    if (p.n[0] != p.n[1]) return ffi::Error::InvalidArgument("decode_linear: gated needs gate and up of one N");
    for (int g = 1; g <= kMaxGroups; ++g) p.tile_begin[g] = p.n[0] / (tile_n / 2);
  }
  if (with_live) {
    auto live = args.get<ffi::Buffer<ffi::S32>>(per_weight * groups);
    if (!live.has_value() || live->element_count() != 1)
      return ffi::Error::InvalidArgument("decode_linear: the live rows must be one int32");
    p.live = live->typed_data();
  }
  auto workspace = rets.get<ffi::Buffer<ffi::F32>>(gated ? 1 : groups);
  if (!workspace.has_value()) return ffi::Error::InvalidArgument("decode_linear: the workspace must be f32");
  const int chunks = k / kChunkK;
  const bool cluster = splits > 1 && splits <= kMaxClusterSplits && HasClusters();
  if (splits < 1 || splits > chunks ||
      (splits > 1 && !cluster && (*workspace)->element_count() < size_t{1} * splits * m * p.col_begin[kMaxGroups]))
    return ffi::Error::InvalidArgument("decode_linear: splits must be in [1, K / 64] with a workspace of splits * M "
                                       "* N");
  p.partial = (*workspace)->typed_data();
  p.groups = groups;
  p.chunks_per_split = CeilDiv(chunks, splits);
  p.cluster = cluster;
  const cudaError_t err = weights_kn ? Dispatch<Format::kBf16KN>(p, warps_n, warp_tiles, splits, stream)
                                     : Dispatch<Format::kE4m3NK>(p, warps_n, warp_tiles, splits, stream);
  if (err != cudaSuccess) {
    cudaGetLastError();  // the error is this call's: later calls' launch checks must not see it
    return ffi::Error::Internal(std::string("decode_linear launch: ") + cudaGetErrorString(err));
  }
  if (splits > 1 && !cluster)
    MergeSplitsKernel<<<CeilDiv(m * (gated ? p.n[0] : p.col_begin[kMaxGroups]), kMergeThreads), kMergeThreads, 0,
                        stream>>>(p, splits);
  return LaunchStatus("decode_linear launch");
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDecodeLinear, jaxserve::DecodeLinear,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("splits")
                                  .Attr<int32_t>("warps_n")
                                  .Attr<int32_t>("warp_tiles")
                                  .Attr<int32_t>("with_live")
                                  .Attr<int32_t>("weights_kn")
                                  .Attr<int32_t>("gated"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
