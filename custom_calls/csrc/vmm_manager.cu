// vAttention's memory manager: a KV cache that is contiguous in virtual memory, its physical pages
// mapped on demand with the CUDA virtual-memory API. One manager per device, reached from Python by a C ABI
// (ctypes: custom_calls/vmm.py) and from XLA by one FFI handler (the step fence).
//
// Mechanism only: which row a request gets, which pages to reclaim and how far to map ahead is decided by the
// Python accounting (jaxserve/cache/vattention.py), the one place that policy lives. Here:
//   - num_tensors virtual ranges (K and V of vattention's cache, or K and V of every layer), each num_rows rows of
//     row_bytes (a multiple of the page size); page i of a row sits at base + row * row_bytes + i * page;
//   - a pool of num_pages logical pages created up front (cuMemCreate), each one physical page per tensor;
//   - Map(row, n): the row's leading n pages mapped (cuMemMap + cuMemSetAccess) before it returns;
//     MapAsync: the same on the mapper thread (look-ahead);
//   - Trim(row, keep): pages past `keep` go back to the pool at once (steps run in stream order, so the next
//     writer of a page runs after its last reader), but the virtual unmap waits for the newest fence: cuMemUnmap
//     does not wait for kernels that may still read the range;
//   - fences: a CUDA event recorded on the step's stream (RecordFence, or the FFI handler JaxserveVmmFence);
//   - DLPack export of each range with a C++ deleter (a Python deleter segfaults at interpreter teardown); the
//     manager lives until vmm_destroy and the last exported array are both gone.
// The driver API is resolved at run time (cudaGetDriverEntryPointByVersion): no -lcuda, so the library loads on
// machines without a driver. A dry-run backend (no driver: fake addresses, every map and unmap checked) lets
// CPU tests drive this bookkeeping through the same C ABI.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxserve::vmm {
namespace {

namespace ffi = xla::ffi;
using Status = std::string;  // empty: success
#define VMM_RETURN_IF_ERROR(expr)      \
  do {                                 \
    Status _status = (expr);           \
    if (!_status.empty()) return _status; \
  } while (0)

thread_local std::string last_error;

// ---- DLPack v0.8 ABI (stable), declared here rather than depending on dlpack.h.
struct DLDevice { int32_t device_type, device_id; };
struct DLDataType { uint8_t code, bits; uint16_t lanes; };
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
constexpr int32_t kDLCUDA = 2;

// ---- Backends: the driver, or a dry run that checks every call.
using Handle = uint64_t;
using Fence = void*;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Status Reserve(size_t bytes, size_t align, uint64_t* base) = 0;
  virtual Status Free(uint64_t base, size_t bytes) = 0;
  virtual Status Create(size_t bytes, Handle* handle) = 0;
  virtual Status Release(Handle handle) = 0;
  virtual Status Map(uint64_t va, size_t bytes, Handle handle) = 0;  // with read/write access for the device
  virtual Status Unmap(uint64_t va, size_t bytes) = 0;
  virtual Status Record(void* stream, Fence* fence) = 0;
  virtual Status Done(Fence fence, bool* done) = 0;
  virtual Status Wait(Fence fence) = 0;  // and destroys it
  virtual void Destroy(Fence fence) = 0;
};

template <typename Fn>
Status Entry(const char* name, Fn* fn) {
  cudaDriverEntryPointQueryResult found;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(name, reinterpret_cast<void**>(fn), 12000,
                                                           cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || *fn == nullptr)
    return std::string("no CUDA driver entry point ") + name + ": " + cudaGetErrorString(err);
  return "";
}

class CudaBackend : public Backend {
 public:
  Status Init(int device) {
    device_ = device;
    VMM_RETURN_IF_ERROR(Runtime(cudaSetDevice(device), "cudaSetDevice"));
    VMM_RETURN_IF_ERROR(Runtime(cudaFree(nullptr), "cudaFree(0) (primary context)"));
    VMM_RETURN_IF_ERROR(Entry("cuGetErrorString", &error_string_));
    VMM_RETURN_IF_ERROR(Entry("cuMemAddressReserve", &reserve_));
    VMM_RETURN_IF_ERROR(Entry("cuMemAddressFree", &free_));
    VMM_RETURN_IF_ERROR(Entry("cuMemCreate", &create_));
    VMM_RETURN_IF_ERROR(Entry("cuMemRelease", &release_));
    VMM_RETURN_IF_ERROR(Entry("cuMemMap", &map_));
    VMM_RETURN_IF_ERROR(Entry("cuMemUnmap", &unmap_));
    VMM_RETURN_IF_ERROR(Entry("cuMemSetAccess", &set_access_));
    return Entry("cuMemGetAllocationGranularity", &granularity_);
  }
  Status Granularity(size_t* bytes) {
    const CUmemAllocationProp prop = Prop();
    return Driver(granularity_(bytes, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
  }
  Status Reserve(size_t bytes, size_t align, uint64_t* base) override {
    CUdeviceptr ptr = 0;
    VMM_RETURN_IF_ERROR(Driver(reserve_(&ptr, bytes, align, 0, 0), "cuMemAddressReserve"));
    *base = ptr;
    return "";
  }
  Status Free(uint64_t base, size_t bytes) override { return Driver(free_(base, bytes), "cuMemAddressFree"); }
  Status Create(size_t bytes, Handle* handle) override {
    const CUmemAllocationProp prop = Prop();
    CUmemGenericAllocationHandle h;
    VMM_RETURN_IF_ERROR(Driver(create_(&h, bytes, &prop, 0), "cuMemCreate"));
    *handle = h;
    return "";
  }
  Status Release(Handle handle) override { return Driver(release_(handle), "cuMemRelease"); }
  Status Map(uint64_t va, size_t bytes, Handle handle) override {
    VMM_RETURN_IF_ERROR(Driver(map_(va, bytes, 0, handle, 0), "cuMemMap"));
    CUmemAccessDesc access = {};
    access.location = Prop().location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return Driver(set_access_(va, bytes, &access, 1), "cuMemSetAccess");
  }
  Status Unmap(uint64_t va, size_t bytes) override { return Driver(unmap_(va, bytes), "cuMemUnmap"); }
  Status Record(void* stream, Fence* fence) override {
    cudaEvent_t event;
    VMM_RETURN_IF_ERROR(Runtime(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate"));
    *fence = event;
    return Runtime(cudaEventRecord(event, static_cast<cudaStream_t>(stream)), "cudaEventRecord");
  }
  Status Done(Fence fence, bool* done) override {
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(fence));
    *done = err == cudaSuccess;
    return err == cudaSuccess || err == cudaErrorNotReady ? "" : Runtime(err, "cudaEventQuery");
  }
  Status Wait(Fence fence) override {
    const Status status = Runtime(cudaEventSynchronize(static_cast<cudaEvent_t>(fence)), "cudaEventSynchronize");
    Destroy(fence);
    return status;
  }
  void Destroy(Fence fence) override { cudaEventDestroy(static_cast<cudaEvent_t>(fence)); }
  // Driver calls from a new thread (the mapper) need the device's context current there.
  Status Bind() { return Runtime(cudaSetDevice(device_), "cudaSetDevice"); }

 private:
  CUmemAllocationProp Prop() const {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device_;
    return prop;
  }
  Status Driver(CUresult result, const char* what) {
    if (result == CUDA_SUCCESS) return "";
    const char* text = "unknown error";
    if (error_string_) error_string_(result, &text);
    return std::string(what) + ": " + text;
  }
  static Status Runtime(cudaError_t err, const char* what) {
    return err == cudaSuccess ? "" : std::string(what) + ": " + cudaGetErrorString(err);
  }

  int device_ = 0;
  PFN_cuGetErrorString_v6000 error_string_ = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve_ = nullptr;
  PFN_cuMemAddressFree_v10020 free_ = nullptr;
  PFN_cuMemCreate_v10020 create_ = nullptr;
  PFN_cuMemRelease_v10020 release_ = nullptr;
  PFN_cuMemMap_v10020 map_ = nullptr;
  PFN_cuMemUnmap_v10020 unmap_ = nullptr;
  PFN_cuMemSetAccess_v10020 set_access_ = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity_ = nullptr;
};

// No driver: addresses are numbers, fences complete when the test says so (or when waited on), and the
// driver's rules are checked: no map over a mapped page, no unmap of an unmapped one, nothing leaked.
class DryBackend : public Backend {
 public:
  ~DryBackend() override {
    if (!mapped_.empty() || !handles_.empty() || !ranges_.empty())
      fprintf(stderr, "vmm dry run: leaked %zu mappings, %zu pages, %zu ranges\n", mapped_.size(), handles_.size(),
              ranges_.size());
  }
  Status Reserve(size_t bytes, size_t align, uint64_t* base) override {
    next_va_ = (next_va_ + align - 1) / align * align;
    *base = next_va_;
    ranges_[next_va_] = bytes;
    next_va_ += bytes;
    return "";
  }
  Status Free(uint64_t base, size_t bytes) override {
    auto it = ranges_.find(base);
    if (it == ranges_.end() || it->second != bytes) return "dry run: free of an unknown range";
    ranges_.erase(it);
    return "";
  }
  Status Create(size_t, Handle* handle) override {
    *handle = ++next_handle_;
    handles_.insert(*handle);
    return "";
  }
  Status Release(Handle handle) override {
    return handles_.erase(handle) ? "" : "dry run: release of an unknown page";
  }
  Status Map(uint64_t va, size_t, Handle handle) override {
    if (!handles_.count(handle)) return "dry run: map of an unknown page";
    return mapped_.insert(va).second ? "" : "dry run: map over a mapped address " + std::to_string(va);
  }
  Status Unmap(uint64_t va, size_t) override {
    return mapped_.erase(va) ? "" : "dry run: unmap of an unmapped address " + std::to_string(va);
  }
  Status Record(void*, Fence* fence) override {
    *fence = reinterpret_cast<Fence>(++recorded_);
    return "";
  }
  Status Done(Fence fence, bool* done) override {
    *done = reinterpret_cast<uint64_t>(fence) <= completed_;
    return "";
  }
  Status Wait(Fence fence) override {
    completed_ = std::max<uint64_t>(completed_, reinterpret_cast<uint64_t>(fence));
    return "";
  }
  void Destroy(Fence) override {}
  void Complete(uint64_t upto) { completed_ = std::max(completed_, upto); }
  size_t NumMappedAddresses() const { return mapped_.size(); }

 private:
  uint64_t next_va_ = uint64_t{1} << 40, next_handle_ = 0, recorded_ = 0, completed_ = 0;
  std::map<uint64_t, size_t> ranges_;
  std::set<Handle> handles_;
  std::set<uint64_t> mapped_;
};

// ---- The manager.
struct Config {
  int device, num_rows, num_tensors;
  int64_t row_bytes, num_pages, page_size;
};

class Manager {
 public:
  Manager(Config config, std::unique_ptr<Backend> backend) : cfg_(config), backend_(std::move(backend)) {}
  ~Manager() {
    Stop();
    const Status status = Teardown();
    if (!status.empty()) fprintf(stderr, "vmm manager teardown: %s\n", status.c_str());
  }

  Status Init() {
    if (cfg_.row_bytes <= 0 || cfg_.row_bytes % cfg_.page_size)
      return "row_bytes must be a positive multiple of the page size " + std::to_string(cfg_.page_size);
    rows_.resize(cfg_.num_rows);
    for (int t = 0; t < cfg_.num_tensors; ++t) {
      uint64_t base;
      VMM_RETURN_IF_ERROR(backend_->Reserve(RangeBytes(), cfg_.page_size, &base));
      bases_.push_back(base);
    }
    handles_.resize(cfg_.num_pages);
    for (int64_t p = cfg_.num_pages - 1; p >= 0; --p) {  // free_ pops from the back: page 0 first
      for (int t = 0; t < cfg_.num_tensors; ++t) {
        Handle h;
        VMM_RETURN_IF_ERROR(backend_->Create(cfg_.page_size, &h));
        handles_[p].push_back(h);
      }
      free_.push_back(p);
    }
    thread_ = std::thread([this] { MapperLoop(); });
    return "";
  }

  Status Map(int row, int64_t num_pages) {
    std::lock_guard<std::mutex> lock(mu_);
    VMM_RETURN_IF_ERROR(CheckRow(row, num_pages));
    VMM_RETURN_IF_ERROR(TakeAsyncError());
    return MapLocked(row, num_pages);
  }

  Status MapAsync(int row, int64_t num_pages) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      VMM_RETURN_IF_ERROR(CheckRow(row, num_pages));
      queue_.emplace_back(row, num_pages);
    }
    wake_.notify_all();
    return "";
  }

  // Waits until every queued look-ahead map is done; reports the first that failed.
  Status Sync() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
    VMM_RETURN_IF_ERROR(TakeAsyncError());
    return ReapFences(false);
  }

  Status Trim(int row, int64_t keep) {
    std::lock_guard<std::mutex> lock(mu_);
    VMM_RETURN_IF_ERROR(CheckRow(row, keep));
    for (auto& [queued_row, num_pages] : queue_)  // a look-ahead not yet mapped must not undo the trim
      if (queued_row == row) num_pages = std::min(num_pages, keep);
    auto& pages = rows_[row];
    for (int64_t i = static_cast<int64_t>(pages.size()) - 1; i >= keep; --i) {
      pending_unmap_[{row, i}] = fences_recorded_;  // the newest fence covers every step that read the page
      free_.push_back(pages[i]);
      pages.pop_back();
    }
    return ReapFences(false);
  }

  Status RecordFence(void* stream) {
    std::lock_guard<std::mutex> lock(mu_);
    Fence fence;
    VMM_RETURN_IF_ERROR(backend_->Record(stream, &fence));
    fences_.emplace_back(++fences_recorded_, fence);
    return ReapFences(false);
  }

  int64_t NumMapped(int row) {
    std::lock_guard<std::mutex> lock(mu_);
    return row >= 0 && row < cfg_.num_rows ? static_cast<int64_t>(rows_[row].size()) : -1;
  }
  int64_t NumFree() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(free_.size());
  }
  int64_t NumDeferred() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(pending_unmap_.size());
  }
  Status Poll() {
    std::lock_guard<std::mutex> lock(mu_);
    return ReapFences(false);
  }
  uint64_t Base(int tensor) const { return tensor >= 0 && tensor < cfg_.num_tensors ? bases_[tensor] : 0; }
  int64_t RangeBytes() const { return cfg_.row_bytes * cfg_.num_rows; }
  int64_t PageSize() const { return cfg_.page_size; }
  int Device() const { return cfg_.device; }
  Backend* backend() { return backend_.get(); }
  std::mutex& mu() { return mu_; }

 private:
  Status CheckRow(int row, int64_t num_pages) const {
    if (row < 0 || row >= cfg_.num_rows) return "row " + std::to_string(row) + " out of range";
    if (num_pages < 0 || num_pages * cfg_.page_size > cfg_.row_bytes)
      return std::to_string(num_pages) + " pages exceed a row of " + std::to_string(cfg_.row_bytes) + " bytes";
    return "";
  }

  Status MapLocked(int row, int64_t num_pages) {
    auto& pages = rows_[row];
    while (static_cast<int64_t>(pages.size()) < num_pages) {
      if (free_.empty()) return "page pool exhausted (" + std::to_string(cfg_.num_pages) + " pages)";
      const int64_t index = static_cast<int64_t>(pages.size());
      VMM_RETURN_IF_ERROR(FinishUnmap(row, index));
      const int64_t page = free_.back();
      for (int t = 0; t < cfg_.num_tensors; ++t)
        VMM_RETURN_IF_ERROR(backend_->Map(Address(t, row, index), cfg_.page_size, handles_[page][t]));
      free_.pop_back();
      pages.push_back(page);
    }
    return "";
  }

  // A page whose virtual unmap still waits on a fence is about to be mapped again: wait, then unmap.
  Status FinishUnmap(int row, int64_t index) {
    auto it = pending_unmap_.find({row, index});
    if (it == pending_unmap_.end()) return "";
    while (completed_ < it->second) {
      VMM_RETURN_IF_ERROR(backend_->Wait(fences_.front().second));
      completed_ = fences_.front().first;
      fences_.pop_front();
    }
    return ReapFences(false);
  }

  // Retires completed fences (in stream order) and unmaps every page no running step can still read.
  Status ReapFences(bool wait_all) {
    while (!fences_.empty()) {
      bool done = false;
      if (wait_all) {
        VMM_RETURN_IF_ERROR(backend_->Wait(fences_.front().second));
        done = true;
      } else {
        VMM_RETURN_IF_ERROR(backend_->Done(fences_.front().second, &done));
        if (done) backend_->Destroy(fences_.front().second);
      }
      if (!done) break;
      completed_ = fences_.front().first;
      fences_.pop_front();
    }
    for (auto it = pending_unmap_.begin(); it != pending_unmap_.end();) {
      if (it->second > completed_) {
        ++it;
        continue;
      }
      for (int t = 0; t < cfg_.num_tensors; ++t)
        VMM_RETURN_IF_ERROR(backend_->Unmap(Address(t, it->first.first, it->first.second), cfg_.page_size));
      it = pending_unmap_.erase(it);
    }
    return "";
  }

  uint64_t Address(int tensor, int row, int64_t index) const {
    return bases_[tensor] + static_cast<uint64_t>(row) * cfg_.row_bytes + index * cfg_.page_size;
  }

  Status TakeAsyncError() {
    Status error;
    std::swap(error, async_error_);
    return error;
  }

  void MapperLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    if (auto* cuda = dynamic_cast<CudaBackend*>(backend_.get())) async_error_ = cuda->Bind();
    while (true) {
      wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      busy_ = true;
      while (!queue_.empty()) {
        const auto [row, num_pages] = queue_.front();
        queue_.pop_front();
        const Status status = MapLocked(row, num_pages);
        if (!status.empty() && async_error_.empty()) async_error_ = status;
      }
      busy_ = false;
      idle_.notify_all();
    }
  }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  Status Teardown() {
    std::lock_guard<std::mutex> lock(mu_);
    Status first;
    auto keep = [&first](Status s) { if (first.empty()) first = std::move(s); };
    for (int s = 0; s < cfg_.num_rows && !bases_.empty(); ++s)
      for (int64_t i = static_cast<int64_t>(rows_[s].size()) - 1; i >= 0; --i)
        pending_unmap_[{s, i}] = fences_recorded_;
    keep(ReapFences(true));
    for (auto& page : handles_)
      for (Handle h : page) keep(backend_->Release(h));
    for (uint64_t base : bases_) keep(backend_->Free(base, RangeBytes()));
    return first;
  }

  const Config cfg_;
  std::unique_ptr<Backend> backend_;
  std::vector<uint64_t> bases_;
  std::vector<std::vector<Handle>> handles_;           // page -> one physical page per tensor
  std::vector<int64_t> free_;                          // pool pages no row holds
  std::vector<std::vector<int64_t>> rows_;            // row -> pool pages of its leading virtual pages
  std::map<std::pair<int, int64_t>, uint64_t> pending_unmap_;  // (row, index) -> fence its unmap waits for
  std::deque<std::pair<uint64_t, Fence>> fences_;      // recorded, not yet seen complete, oldest first
  uint64_t fences_recorded_ = 0, completed_ = 0;
  std::deque<std::pair<int, int64_t>> queue_;          // look-ahead maps for the mapper thread
  Status async_error_;
  bool busy_ = false, stop_ = false;
  std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::thread thread_;
};

// The handle Python holds, and the per-device registry the FFI fence handler reads.
struct Box { std::shared_ptr<Manager> manager; };
std::mutex registry_mu;
std::map<int, std::weak_ptr<Manager>> registry;

struct Export {
  DLManagedTensor tensor;
  std::vector<int64_t> shape;
  std::shared_ptr<Manager> manager;  // keeps the range reserved while an array aliases it
};

void DeleteExport(DLManagedTensor* tensor) { delete static_cast<Export*>(tensor->manager_ctx); }

int Fail(Status status) {
  if (status.empty()) return 0;
  last_error = std::move(status);
  return -1;
}

Manager* Get(void* handle) { return handle ? static_cast<Box*>(handle)->manager.get() : nullptr; }

ffi::Error FenceHandler(cudaStream_t stream, int32_t device, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) {
  std::shared_ptr<Manager> manager;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = registry.find(device);
    if (it != registry.end()) manager = it->second.lock();
  }
  if (!manager) return ffi::Error::Success();  // no vAttention cache on this device: nothing to fence
  const Status status = manager->RecordFence(stream);
  return status.empty() ? ffi::Error::Success() : ffi::Error::Internal("vmm fence: " + status);
}

}  // namespace
}  // namespace jaxserve::vmm

using jaxserve::vmm::Fail;
using jaxserve::vmm::Get;

extern "C" {

// All functions return 0 (or a count) on success and -1 on failure, vmm_last_error() saying why.
const char* vmm_last_error() { return jaxserve::vmm::last_error.c_str(); }

// The driver's recommended page size for device memory on `device` (2 MiB on the stock driver).
int vmm_granularity(int device, int64_t* bytes) {
  jaxserve::vmm::CudaBackend backend;
  size_t size = 0;
  jaxserve::vmm::Status status = backend.Init(device);
  if (status.empty()) status = backend.Granularity(&size);
  *bytes = static_cast<int64_t>(size);
  return Fail(status);
}

// num_tensors ranges of num_rows * row_bytes, num_pages logical pages of page_size bytes per tensor.
// dry_run: no driver (CPU tests of the bookkeeping).
int vmm_create(int device, int num_rows, int num_tensors, int64_t row_bytes, int64_t num_pages,
               int64_t page_size, int dry_run, void** out) {
  using namespace jaxserve::vmm;
  *out = nullptr;
  if (num_rows <= 0 || num_tensors <= 0 || num_pages <= 0 || page_size <= 0)
    return Fail("num_rows, num_tensors, num_pages and page_size must be > 0");
  std::unique_ptr<Backend> backend;
  if (dry_run) {
    backend = std::make_unique<DryBackend>();
  } else {
    auto cuda = std::make_unique<CudaBackend>();
    if (int rc = Fail(cuda->Init(device))) return rc;
    backend = std::move(cuda);
  }
  auto manager = std::make_shared<Manager>(Config{device, num_rows, num_tensors, row_bytes, num_pages, page_size},
                                           std::move(backend));
  if (int rc = Fail(manager->Init())) return rc;
  if (!dry_run) {
    std::lock_guard<std::mutex> lock(registry_mu);
    registry[device] = manager;
  }
  *out = new Box{manager};
  return 0;
}

// Drops Python's reference; the pages and ranges go when the last exported array dies too.
int vmm_destroy(void* handle) {
  delete static_cast<jaxserve::vmm::Box*>(handle);
  return 0;
}

int64_t vmm_page_size(void* m) { return Get(m)->PageSize(); }
uint64_t vmm_base(void* m, int tensor) { return Get(m)->Base(tensor); }
int vmm_map(void* m, int row, int64_t num_pages) { return Fail(Get(m)->Map(row, num_pages)); }
int vmm_map_async(void* m, int row, int64_t num_pages) { return Fail(Get(m)->MapAsync(row, num_pages)); }
int vmm_sync(void* m) { return Fail(Get(m)->Sync()); }
int vmm_trim(void* m, int row, int64_t keep_pages) { return Fail(Get(m)->Trim(row, keep_pages)); }
int vmm_record_fence(void* m, void* stream) { return Fail(Get(m)->RecordFence(stream)); }
int vmm_poll(void* m) { return Fail(Get(m)->Poll()); }
int64_t vmm_num_mapped(void* m, int row) { return Get(m)->NumMapped(row); }
int64_t vmm_num_free_pages(void* m) { return Get(m)->NumFree(); }
int64_t vmm_num_deferred(void* m) { return Get(m)->NumDeferred(); }

// Dry run only: fences 1..upto have completed; the number of mapped page addresses.
int64_t vmm_dry_complete_fences(void* m, uint64_t upto) {
  auto* dry = dynamic_cast<jaxserve::vmm::DryBackend*>(Get(m)->backend());
  if (!dry) return Fail("not a dry-run manager");
  std::lock_guard<std::mutex> lock(Get(m)->mu());
  dry->Complete(upto);
  return static_cast<int64_t>(dry->NumMappedAddresses());
}

// A DLManagedTensor* over range `tensor` (row-major `shape`, DLPack dtype code/bits), deleted by C++.
int vmm_export_dlpack(void* m, int tensor, int ndim, const int64_t* shape, uint8_t code, uint8_t bits, void** out) {
  using namespace jaxserve::vmm;
  Box* box = static_cast<Box*>(m);
  *out = nullptr;
  int64_t bytes = bits / 8;
  for (int i = 0; i < ndim; ++i) bytes *= shape[i];
  if (box->manager->Base(tensor) == 0 || bits % 8 || bytes > box->manager->RangeBytes())
    return Fail("export of " + std::to_string(bytes) + " bytes does not fit range " + std::to_string(tensor));
  auto* e = new Export{{}, std::vector<int64_t>(shape, shape + ndim), box->manager};
  e->tensor.dl_tensor = DLTensor{reinterpret_cast<void*>(box->manager->Base(tensor)),
                                 DLDevice{kDLCUDA, box->manager->Device()}, ndim, DLDataType{code, bits, 1},
                                 e->shape.data(), nullptr, 0};
  e->tensor.manager_ctx = e;
  e->tensor.deleter = DeleteExport;
  *out = &e->tensor;
  return 0;
}

}  // extern "C"

// XLA FFI: records a fence on the step's stream for the device's manager. Give it any array the step
// computes last (input 0 aliased to output 0): the cache's readers are then queued before it. Not
// command-buffer compatible: a replayed graph would not tell the manager.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveVmmFence, jaxserve::vmm::FenceHandler,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());
