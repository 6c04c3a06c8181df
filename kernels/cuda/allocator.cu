// The caching allocator (see allocator.h for why reuse needs no events).
#include "kernels/cuda/allocator.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_context.h"
#include "tensor/backend.h"

namespace areno::cuda {
namespace {

constexpr size_t kSmallLimit = size_t(1) << 20;   // rounded to 512 B below, 2 MiB above
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = size_t(2) << 20;

size_t round_size(size_t n) {
  if (n <= kSmallLimit) return (n + kSmallRound - 1) / kSmallRound * kSmallRound;
  return (n + kLargeRound - 1) / kLargeRound * kLargeRound;
}

std::string mib(size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", double(bytes) / double(1 << 20));
  return buf;
}

struct DevicePool {
  std::multimap<size_t, void*> free_blocks;  // rounded size -> block
  AllocatorStats stats;
};

class CachingAllocator {
 public:
  void* allocate(size_t nbytes, int device, size_t* rounded_out) {
    size_t rounded = round_size(nbytes);
    *rounded_out = rounded;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      DevicePool& pool = pool_for(device);
      // Best fit, wasting at most an eighth of the block.
      auto it = pool.free_blocks.lower_bound(rounded);
      if (it != pool.free_blocks.end() && it->first - rounded <= it->first / 8) {
        void* p = it->second;
        size_t block = it->first;
        pool.free_blocks.erase(it);
        *rounded_out = block;
        pool.stats.cached_bytes -= block;
        note_allocated(pool, block);
        return p;
      }
    }
    DeviceGuard guard(device);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, rounded);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear, then retry with the cache returned to the driver
      empty(device);
      e = cudaMalloc(&p, rounded);
      if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        AllocatorStats s = stats(device);
        throw std::runtime_error("CUDA out of memory on cuda:" + std::to_string(device) +
                                 ": tried to allocate " + mib(nbytes) + "; the device has " +
                                 mib(free_b) + " free of " + mib(total_b) + " and areno holds " +
                                 mib(s.allocated_bytes) + " in live tensors");
      }
    }
    ARENO_CUDA_CHECK(e);
    std::lock_guard<std::mutex> lock(mutex_);
    note_allocated(pool_for(device), rounded);
    return p;
  }

  void release(void* p, size_t rounded, int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    DevicePool& pool = pool_for(device);
    pool.free_blocks.emplace(rounded, p);
    pool.stats.cached_bytes += rounded;
    pool.stats.allocated_bytes -= rounded;
  }

  void empty(int device) {
    std::vector<void*> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      DevicePool& pool = pool_for(device);
      for (auto& [size, p] : pool.free_blocks) blocks.push_back(p);
      pool.free_blocks.clear();
      pool.stats.cached_bytes = 0;
    }
    if (blocks.empty()) return;
    DeviceGuard guard(device);
    // Cached blocks may still be in use by queued kernels that freed them on
    // the host side; cudaFree waits for the device, so this is safe.
    for (void* p : blocks) ARENO_CUDA_CHECK(cudaFree(p));
  }

  AllocatorStats stats(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    return pool_for(device).stats;
  }

 private:
  static void note_allocated(DevicePool& pool, size_t rounded) {
    pool.stats.allocated_bytes += rounded;
    if (pool.stats.allocated_bytes > pool.stats.peak_bytes)
      pool.stats.peak_bytes = pool.stats.allocated_bytes;
  }

  DevicePool& pool_for(int device) {
    if (device < 0) throw std::runtime_error("cuda allocator: negative device index");
    if (size_t(device) >= pools_.size()) pools_.resize(size_t(device) + 1);
    return pools_[size_t(device)];
  }

  std::mutex mutex_;
  std::vector<DevicePool> pools_;
};

// Never destroyed: tensors may be freed during static destruction.
CachingAllocator& allocator() {
  static CachingAllocator* a = new CachingAllocator();
  return *a;
}

}  // namespace

std::shared_ptr<Storage> allocate_storage(size_t nbytes, int index) {
  Device device = Device::cuda(index);
  if (nbytes == 0) return std::make_shared<Storage>(nullptr, 0, device, nullptr);
  device_context(index);  // validates the index before any allocation
  size_t rounded = 0;
  void* p = allocator().allocate(nbytes, index, &rounded);
  return std::make_shared<Storage>(p, nbytes, device,
                                   [rounded, index](void* q) { allocator().release(q, rounded, index); });
}

std::shared_ptr<void> allocate_scratch(size_t nbytes, int index) {
  if (nbytes == 0) nbytes = 1;
  size_t rounded = 0;
  void* p = allocator().allocate(nbytes, index, &rounded);
  return std::shared_ptr<void>(p, [rounded, index](void* q) { allocator().release(q, rounded, index); });
}

void empty_cache(int index) { allocator().empty(index); }

AllocatorStats allocator_stats(int index) { return allocator().stats(index); }

}  // namespace areno::cuda

namespace areno {

size_t cuda_peak_allocated_bytes(int index) { return cuda::allocator().stats(index).peak_bytes; }

}  // namespace areno
