// The host allocator: 64-byte aligned blocks, the large ones cached by size
// class (as kernels/cuda/allocator.cu caches device blocks).
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "kernels/cpu/cpu_backend.h"

namespace areno::cpu {

namespace {

// Large host blocks are kept after release and handed out again for the same
// rounded size: glibc returns big blocks to the kernel (mmap), and every new
// one costs page faults and zeroing, which was a quarter of a CPU training
// step. Blocks of at least 128 KiB (glibc's first mmap threshold; from 4 MiB
// until 2026-12-04, when the 0.5-3 MB activations of `small`'s 512-token
// prefill still page-faulted on every op: 149k faults in 10 runs, 87k
// after, most of those the weights' load), in size classes; at most a
// quarter of physical memory and at most 4 GiB (ARENO_CPU_CACHE_MB
// overrides) stays cached.
class HostBlockCache {
 public:
  static constexpr size_t kMin = size_t(128) << 10;

  static HostBlockCache& get() {
    static HostBlockCache* c = new HostBlockCache();  // never destroyed: storages may outlive statics
    return *c;
  }
  // Small blocks: 64-byte multiples (plain malloc). Large ones: size classes a
  // quarter power of two apart, so tensors whose size drifts from step to step
  // (logits of a varying number of rows, a growing KV history) reuse blocks.
  // Pages past the requested size are never touched, so the rounding costs
  // address space, not memory.
  static size_t rounded(size_t n) {
    if (n < kMin) return (std::max<size_t>(n, 1) + 63) / 64 * 64;
    size_t p = kMin;
    while (p * 2 <= n) p *= 2;  // p <= n < 2p
    const size_t round = p < (size_t(4) << 20) ? size_t(64) << 10 : size_t(2) << 20;
    for (size_t q = 1; q <= 4; ++q)
      if (n <= p + p / 4 * q) return (p + p / 4 * q + round - 1) / round * round;
    return 2 * p;
  }

  void* take(size_t size) {
    if (size < kMin) return nullptr;
    std::lock_guard<std::mutex> lk(mu_);
    auto it = free_.find(size);
    if (it == free_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    cached_ -= size;
    return p;
  }
  void give(void* p, size_t size) {
    if (size >= kMin) {
      std::lock_guard<std::mutex> lk(mu_);
      if (cached_ + size <= cap_) {
        free_[size].push_back(p);
        cached_ += size;
        return;
      }
    }
    std::free(p);
  }
  void clear() {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [size, v] : free_)
      for (void* p : v) std::free(p);
    free_.clear();
    cached_ = 0;
  }

 private:
  HostBlockCache() {
    if (const char* env = std::getenv("ARENO_CPU_CACHE_MB")) {
      cap_ = size_t(std::strtoull(env, nullptr, 10)) << 20;
    } else {
      const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
      cap_ = pages > 0 && page > 0 ? std::min(size_t(pages) * size_t(page) / 4, size_t(4) << 30) : size_t(1) << 30;
    }
  }
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
  size_t cached_ = 0, cap_ = 0;
};

// Whether large blocks are advised as huge pages (ARENO_CPU_HUGEPAGES=0: no).
bool huge_pages() {
  static const bool on = [] {
    const char* env = std::getenv("ARENO_CPU_HUGEPAGES");
    return env == nullptr || std::string(env) != "0";
  }();
  return on;
}

// A new block of `size` bytes for a request of `nbytes`. From 2 MiB on it is
// aligned to 2 MiB and the requested bytes' whole 2 MiB pages are advised as
// transparent huge pages (Linux's default mode, `madvise`, gives them only
// where asked; the rounding's tail stays in 4 KiB pages and untouched, so it
// still costs no memory). Weights are copied into such blocks at load, and a
// read streaming through them crosses no 4 KiB page boundary, where the
// hardware prefetcher stops, and misses the TLB 512 times less often: on the
// 2-core Zen 3, a streaming sum over 1 GiB 27.4-28.8 against 23.6-25.2 GB/s,
// `small` decode f32 76.5-79.3 against 67.5-75.4 tokens/s, bf16 174-177
// against 137-153 (docs/perf.md). ARENO_CPU_HUGEPAGES=0 turns it off.
void* fresh_block(size_t size, size_t nbytes) {
  constexpr size_t kHuge = size_t(2) << 20;
  if (!huge_pages() || nbytes < kHuge) return std::aligned_alloc(64, size);
  void* p = std::aligned_alloc(kHuge, (size + kHuge - 1) / kHuge * kHuge);  // a multiple of the alignment
  if (p) (void)madvise(p, nbytes / kHuge * kHuge, MADV_HUGEPAGE);          // advice: failure is harmless
  return p;
}

}  // namespace

std::shared_ptr<Storage> CpuBackend::allocate(size_t nbytes, Device device) {
  if (!device.is_cpu())
    throw std::invalid_argument("cpu allocate: device " + device.str() + " is not the CPU");
  auto& cache = HostBlockCache::get();
  const size_t size = HostBlockCache::rounded(nbytes);
  void* p = cache.take(size);
  if (!p) p = fresh_block(size, nbytes);
  if (!p) {
    cache.clear();
    p = fresh_block(size, nbytes);
  }
  if (!p) throw std::bad_alloc();
  return std::make_shared<Storage>(p, nbytes, device, [size](void* q) { HostBlockCache::get().give(q, size); });
}

// An anonymous private mapping: the kernel's pages read as zero and are
// committed when first written. Page-aligned (so 64-byte aligned). Below 1 MiB
// a filled block from the cache is as cheap. Not advised as huge pages: the
// KV pool (this mapping's user) would commit 2 MiB per layer's K and V at its
// first block, for `small` pp4096 3-7 % faster in three alternations and
// no clear difference in five more.
std::shared_ptr<Storage> CpuBackend::allocate_lazy_zeroed(size_t nbytes, Device device) {
  if (!device.is_cpu())
    throw std::invalid_argument("cpu allocate: device " + device.str() + " is not the CPU");
  if (nbytes < (size_t(1) << 20)) return nullptr;
  void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    HostBlockCache::get().clear();
    p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  if (p == MAP_FAILED) throw std::bad_alloc();
  return std::make_shared<Storage>(p, nbytes, device, [nbytes](void* q) { munmap(q, nbytes); });
}

}  // namespace areno::cpu
