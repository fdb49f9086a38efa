// In-place KV-cache updates on the CPU, the CUDA library's two cache ops (cache_ops.cu) for XLA:CPU. The caches are
// aliased input -> output (input_output_aliases on donated arrays), so a decode step's write is a copy of its new
// rows, where XLA:CPU's scatter into a layer's cache costs tens of microseconds of thunk work. Byte copies: any dtype,
// an fp8 cache's bits included.
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {
namespace {

namespace ffi = xla::ffi;

// Bytes of a cache slot row (Hkv * D elements), once the two caches are checked to match.
ffi::Error SlotRowBytes(const ffi::AnyBuffer& k_cache, const ffi::AnyBuffer& v_cache, int64_t* row_bytes) {
  const auto kd = k_cache.dimensions();
  if (kd.size() != 4 || v_cache.dimensions().size() != 4 || k_cache.element_count() != v_cache.element_count() ||
      k_cache.element_type() != v_cache.element_type()) {
    return ffi::Error::InvalidArgument("k_cache and v_cache must match: [num_blocks, block_size, Hkv, D]");
  }
  *row_bytes = kd[2] * kd[3] * ffi::ByteWidth(k_cache.element_type());
  return ffi::Error::Success();
}

char* Bytes(ffi::Result<ffi::AnyBuffer>& buffer) { return static_cast<char*>(buffer->untyped_data()); }

// Token t's new K and V rows (kv [2, T, Hkv, D]: K rows, then V rows) into slot slot_mapping[t]; slots outside
// the cache (padding: -1) are skipped.
ffi::Error ReshapeAndCache(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer kv,
                           ffi::Buffer<ffi::S32> slot_mapping, ffi::Result<ffi::AnyBuffer> k_out,
                           ffi::Result<ffi::AnyBuffer> v_out) {
  int64_t row_bytes = 0;
  if (ffi::Error err = SlotRowBytes(k_cache, v_cache, &row_bytes); err.failure()) return err;
  const int64_t tokens = slot_mapping.element_count();
  if (kv.element_type() != k_cache.element_type() || kv.size_bytes() != static_cast<size_t>(2 * tokens * row_bytes)) {
    return ffi::Error::InvalidArgument("kv must be [2, T, Hkv, D] in the cache dtype, T = len(slot_mapping)");
  }
  const int64_t num_slots = k_cache.dimensions()[0] * k_cache.dimensions()[1];
  const char *k_rows = static_cast<const char*>(kv.untyped_data()), *v_rows = k_rows + tokens * row_bytes;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slot_mapping.typed_data()[t];
    if (slot < 0 || slot >= num_slots) continue;
    std::memcpy(Bytes(k_out) + slot * row_bytes, k_rows + t * row_bytes, row_bytes);
    std::memcpy(Bytes(v_out) + slot * row_bytes, v_rows + t * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

// Cache block src[i] -> dst[i] in K and V, every source read before any destination is written; pairs with an id
// outside the cache are skipped.
ffi::Error CopyBlocks(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> src,
                      ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  int64_t row_bytes = 0;
  if (ffi::Error err = SlotRowBytes(k_cache, v_cache, &row_bytes); err.failure()) return err;
  if (dst.element_count() != src.element_count()) {
    return ffi::Error::InvalidArgument("src and dst must have the same length");
  }
  const int64_t num_blocks = k_cache.dimensions()[0], block_bytes = k_cache.dimensions()[1] * row_bytes;
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (size_t i = 0; i < src.element_count(); ++i) {
    const int64_t from = src.typed_data()[i], to = dst.typed_data()[i];
    if (from >= 0 && from < num_blocks && to >= 0 && to < num_blocks) pairs.emplace_back(from, to);
  }
  std::vector<char> sources(pairs.size() * block_bytes);
  for (auto* out : {&k_out, &v_out}) {
    for (size_t i = 0; i < pairs.size(); ++i) {
      std::memcpy(sources.data() + i * block_bytes, Bytes(*out) + pairs[i].first * block_bytes, block_bytes);
    }
    for (size_t i = 0; i < pairs.size(); ++i) {
      std::memcpy(Bytes(*out) + pairs[i].second * block_bytes, sources.data() + i * block_bytes, block_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveReshapeAndCacheCpu, jaxserve::ReshapeAndCache,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCopyBlocksCpu, jaxserve::CopyBlocks,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
