#include "nn/io/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

namespace areno {

namespace fs = std::filesystem;

namespace {

std::string folder_of(const std::string& path) {
  const std::string dir = fs::path(path).parent_path().string();
  return dir.empty() ? "." : dir;
}

}  // namespace

AtomicFile::AtomicFile(std::string path, unsigned mode) : path_(std::move(path)) {
  static std::atomic<uint64_t> counter{0};
  tmp_ = fmt::format("{}.tmp-{}-{}", path_, ::getpid(), counter++);
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode_t(mode & 07777));
  if (fd_ < 0) {
    const int err = errno;
    throw std::runtime_error(fmt::format("cannot write {}: cannot create {}: {}", path_, tmp_, std::strerror(err)));
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicFile::fail(const std::string& what, int err) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
  committed_ = true;  // nothing left to remove
  throw std::runtime_error(fmt::format("cannot write {}: {}: {}", path_, what, std::strerror(err)));
}

void AtomicFile::write(const void* data, size_t n) {
  if (fd_ < 0) throw std::logic_error(fmt::format("AtomicFile {}: write after finish", path_));
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) fail("write failed", errno);
    if (w == 0) fail("write failed", ENOSPC);
    p += w;
    n -= size_t(w);
  }
}

void AtomicFile::finish() {
  if (fd_ < 0) return;
  if (::fsync(fd_) != 0) fail("fsync failed", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("close failed", errno);
}

void AtomicFile::rename_into_place() {
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail(fmt::format("cannot rename {} over it", tmp_), errno);
  committed_ = true;
}

void AtomicFile::commit() {
  finish();
  rename_into_place();
  sync_dir(folder_of(path_));
}

void write_file_atomic(const std::string& path, std::string_view data, unsigned mode) {
  AtomicFile f(path, mode);
  f.write(data);
  f.commit();
}

AtomicFile& FileSet::add(const std::string& path) {
  files_.push_back(std::make_unique<AtomicFile>(path));
  return *files_.back();
}

void FileSet::commit() {
  for (auto& f : files_) f->finish();
  std::set<std::string> dirs;
  for (auto& f : files_) {
    f->rename_into_place();
    dirs.insert(folder_of(f->path()));
  }
  for (const auto& d : dirs) sync_dir(d);
}

void sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(fmt::format("cannot open folder {} to sync it: {}", dir, std::strerror(errno)));
  // Some file systems cannot sync a folder (EINVAL); their renames are as durable as they get.
  if (::fsync(fd) != 0 && errno != EINVAL) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error(fmt::format("cannot sync folder {}: {}", dir, std::strerror(err)));
  }
  ::close(fd);
}

}  // namespace areno
