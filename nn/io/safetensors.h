#pragma once
// safetensors checkpoints (https://github.com/huggingface/safetensors):
//   [u64 little-endian N][N bytes of JSON header, space padded][data buffer]
// The header maps tensor names to {"dtype", "shape", "data_offsets": [begin,
// end)} (offsets relative to the data buffer) plus an optional
// "__metadata__" object of string -> string.
//
// Reading maps the file and parses only the header; a tensor's bytes are
// touched when it is loaded, and loading returns a CPU tensor that views the
// mapping (copy-on-write, so writing into it never changes the file).
// Sharded checkpoints (model.safetensors.index.json + shards) read through
// SafetensorsCheckpoint as one name -> tensor view.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "nn/io/atomic_file.h"
#include "tensor/tensor.h"

namespace areno {

// Where one tensor lives in a safetensors file.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte range in the data buffer
};

// safetensors dtype strings of our dtypes ("F32", "BF16", "BOOL", ...).
std::string_view safetensors_dtype_name(DType t);
// The inverse; throws std::runtime_error for dtypes we cannot hold (U8, F8_E4M3, ...)
// and for strings that are no safetensors dtype at all.
DType safetensors_dtype_from_name(std::string_view name);

struct MappedFile;  // the read-only mapping that loaded tensors keep alive

class SafetensorsFile {
 public:
  // Maps `path` and validates the whole header (every entry's dtype, shape and
  // offsets); throws std::runtime_error naming the file and the tensor.
  explicit SafetensorsFile(const std::string& path);
  // The same over bytes already in memory (data compiled into the program):
  // `bytes` must outlive the object and its tensors; loads copy. `name`
  // stands for the path in messages.
  static SafetensorsFile from_memory(const std::string& name, std::string_view bytes);

  const std::string& path() const { return path_; }
  // Tensor names in the order of their data in the file.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // Throws std::out_of_range-like std::runtime_error when absent.
  const SafetensorsEntry& entry(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t file_size() const;

  // A CPU tensor viewing the mapping. Data the format leaves misaligned for
  // its dtype is copied instead, so kernels always see aligned memory. Two
  // loads of one name through one SafetensorsFile share memory (the mapping is
  // private to the process): clone() or load_copy() before writing into one
  // if the other must keep the file's values.
  Tensor load(const std::string& name) const;
  // A CPU tensor with its own memory (the file may then be replaced).
  Tensor load_copy(const std::string& name) const;
  // Drops the mapped pages of `name` from this process (a later load reads
  // them from the file again): after copying a tensor out, so that loading a
  // checkpoint does not hold the file's pages and the copies at once.
  void release_pages(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  void parse();  // the header of map_
  const uint8_t* data_of(const SafetensorsEntry& e) const;

  std::string path_;
  std::shared_ptr<MappedFile> map_;
  uint64_t data_start_ = 0;  // 8 + header length
  std::vector<std::string> names_;
  std::unordered_map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors (any device, any strides, any of our dtypes) to `path`.
// As the Python package does, data is laid out sorted by element size (largest
// first) and then name so every tensor is aligned for its dtype, and the header
// is space padded to a multiple of 8 bytes. The file goes through AtomicFile
// (nn/io/atomic_file.h): written beside `path`, fsynced and renamed over it, so
// readers mapping an old version keep a valid file and a failed write leaves
// the old one. Throws std::invalid_argument on duplicate or empty names and
// undefined tensors, std::runtime_error naming the file and the reason on I/O
// errors.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Loads every tensor of a file as CPU tensors viewing the mapping, in file order.
std::vector<std::pair<std::string, Tensor>> load_safetensors(const std::string& path);

// ---- sharded checkpoints ----

// One lazy name -> tensor view over a single .safetensors file or a sharded
// checkpoint. `path` is a .safetensors file, a *.safetensors.index.json, or a
// directory holding model.safetensors.index.json or model.safetensors.
// Opening maps every shard and checks that each tensor named by the index is
// in its shard; tensor data is only read on load().
class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(const std::string& path);

  // Sorted names.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const SafetensorsEntry& entry(const std::string& name) const;
  Tensor load(const std::string& name) const;
  // The file holding `name`.
  const SafetensorsFile& file_of(const std::string& name) const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // The index's "metadata" values (as JSON text for non-strings), or the
  // single file's __metadata__.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;  // what the user opened, for messages
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, size_t> where_;  // name -> index into files_
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` into `dir` as shards of at most `max_shard_bytes` of tensor
// data (a larger tensor gets a shard of its own), named as transformers does:
// <prefix>-00001-of-00003.safetensors plus <prefix>.safetensors.index.json
// with "metadata": {"total_size": bytes} and a sorted "weight_map". A single
// shard is written as <prefix>.safetensors without an index (also as
// transformers does). Tensors keep their given order across shards. `metadata`
// goes into every shard's __metadata__. Returns the file names written.
//
// Every file is written and fsynced before the first one is renamed into
// place (FileSet), so a failed save (disk full) leaves the folder's previous
// checkpoint as it was. Once the new files are in place, the files of an older
// layout with the same prefix are removed (remove_stale_shards): a stale index
// would otherwise be preferred by the loader over a new single file, and stale
// shards would linger.
std::vector<std::string> save_safetensors_sharded(
    const std::string& dir, const std::vector<std::pair<std::string, Tensor>>& tensors,
    uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata = {},
    const std::string& prefix = "model");

// The parts of save_safetensors_sharded, for a caller that writes more files
// with the checkpoint (config.json): stages the shards and the index into
// `files` (written and checked, not yet in place) and returns their names;
// after files.commit(), remove_stale_shards removes <prefix>.safetensors,
// <prefix>.safetensors.index.json and <prefix>-NNNNN-of-NNNNN.safetensors files
// in `dir` not named in `keep` (the stale index first).
std::vector<std::string> stage_safetensors_sharded(
    FileSet& files, const std::string& dir, const std::vector<std::pair<std::string, Tensor>>& tensors,
    uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata = {},
    const std::string& prefix = "model");
void remove_stale_shards(const std::string& dir, const std::vector<std::string>& keep,
                         const std::string& prefix = "model");

}  // namespace areno
