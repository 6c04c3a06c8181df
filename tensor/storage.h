#pragma once
// A block of memory on one device. Tensors share it through shared_ptr; views
// differ only in offset, shape and strides.
#include <cstddef>
#include <functional>
#include <memory>

#include "tensor/device.h"

namespace areno {

class Storage {
 public:
  using Deleter = std::function<void(void*)>;
  Storage(void* data, size_t nbytes, Device device, Deleter deleter)
      : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}
  ~Storage() {
    if (deleter_) deleter_(data_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

  // Fresh memory comes from the device's backend: backend(device).allocate()
  // (tensor/backend.h).
  // Memory owned elsewhere (an mmap'ed file); `owner` is kept alive.
  static std::shared_ptr<Storage> wrap(void* data, size_t nbytes, Device device,
                                       std::shared_ptr<void> owner) {
    return std::make_shared<Storage>(data, nbytes, device,
                                     [owner](void*) mutable { owner.reset(); });
  }

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  Deleter deleter_;
};

}  // namespace areno
