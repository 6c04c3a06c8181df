#pragma once
// The caching device allocator. cudaMalloc/cudaFree are slow and cudaFree
// synchronizes the device, so freed blocks are kept in per-device free lists
// keyed by their (rounded) size and handed out again. Reuse is safe without
// events because every kernel of a device runs on its one stream: a block
// freed on the host is only reused by work enqueued after the work that used it.
#include <cstddef>
#include <memory>

#include "tensor/storage.h"

namespace areno::cuda {

// A block of at least `nbytes` on device `index`; its deleter returns it to
// the cache. Throws std::runtime_error on out-of-memory (after emptying the
// cache and retrying) with the requested and free sizes.
std::shared_ptr<Storage> allocate_storage(size_t nbytes, int index);

// Scratch memory for a kernel's temporaries (same cache), freed by the
// shared_ptr; valid for work enqueued on the device's stream.
std::shared_ptr<void> allocate_scratch(size_t nbytes, int index);

// Returns every cached block of `index` to the driver.
void empty_cache(int index);

struct AllocatorStats {
  size_t allocated_bytes = 0;  // handed out now
  size_t cached_bytes = 0;     // held in free lists
  size_t peak_bytes = 0;       // max of allocated_bytes
};
AllocatorStats allocator_stats(int index);

}  // namespace areno::cuda
