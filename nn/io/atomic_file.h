#pragma once
// The one file writer: every file areno writes (safetensors files and shards,
// the shard index, config.json, generation_config.json, the tokenizer files,
// the outputs of `areno logits` / `preprocess`, optimizer state) goes through
// AtomicFile.
//
// The data goes to a temporary file in the target's folder
// ("<name>.tmp-<pid>-<n>"); every write is checked; the temporary is fsynced,
// closed, renamed over the target, and the folder is fsynced. A reader sees the
// old file or the new one, never a half-written one, and after a crash the new
// file is either complete or absent. A failed write (disk full, file size
// limit, I/O error) throws std::runtime_error naming the target and the reason
// (strerror) and removes the temporary: the old file stays as it was.
//
// Files that belong together (a checkpoint's shards, index and config) are
// staged in a FileSet and put in place together: every file is written and
// fsynced before the first rename, so a failure while writing any of them
// leaves every old file in place.
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace areno {

class AtomicFile {
 public:
  // Creates the temporary beside `path` (the folder must exist) with
  // permissions `mode` (less the process umask): 0644 for weights and
  // configs; 0600 for what holds a user's data (the Responses store).
  explicit AtomicFile(std::string path, unsigned mode = 0644);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  // Removes the temporary unless commit() put it in place.
  ~AtomicFile();

  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  // fsyncs and closes the temporary; the target is not touched yet.
  void finish();
  // finish(), then renames the temporary over the target and fsyncs the folder.
  void commit();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return tmp_; }

 private:
  friend class FileSet;
  [[noreturn]] void fail(const std::string& what, int err);
  void rename_into_place();

  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

// Writes `data` to `path` through AtomicFile (permissions as there).
void write_file_atomic(const std::string& path, std::string_view data, unsigned mode = 0644);

// Files written together and put in place together (see the top of the file).
class FileSet {
 public:
  // Starts the temporary of `path`; write into the returned file.
  AtomicFile& add(const std::string& path);
  // Finishes every file (all data on disk), then renames each over its target
  // in the order added, then fsyncs each folder once. A file not committed is
  // removed when the set is destroyed.
  void commit();

 private:
  std::vector<std::unique_ptr<AtomicFile>> files_;
};

// fsyncs the folder `dir` (so that renames and unlinks in it are durable);
// throws naming the folder when it cannot be opened or synced.
void sync_dir(const std::string& dir);

}  // namespace areno
