#include "nn/io/safetensors.h"

#include "nn/io/atomic_file.h"
#include "nn/io/files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "tensor/autograd.h"

namespace areno {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// The Python package refuses headers above 100 MB; a larger length means a
// corrupt or foreign file, and we must not try to allocate it.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

[[noreturn]] void fail_file(const std::string& path, const std::string& what) {
  throw std::runtime_error("safetensors file '" + path + "': " + what);
}
[[noreturn]] void fail_tensor(const std::string& path, const std::string& name,
                              const std::string& what) {
  throw std::runtime_error("safetensors file '" + path + "': tensor '" + name + "': " + what);
}

// Known safetensors dtypes we do not hold, for a message better than "unknown".
bool is_foreign_safetensors_dtype(std::string_view s) {
  static const char* const kOthers[] = {"U8",       "I8",       "U16",      "I16",  "U32",
                                        "U64",      "F8_E4M3",  "F8_E5M2",  "F8_E8M0",
                                        "F4",       "F6_E2M3",  "F6_E3M2",  "C64"};
  for (const char* o : kOthers)
    if (s == o) return true;
  return false;
}

}  // namespace

// ---- dtypes ----

std::string_view safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::boolean: return "BOOL";
  }
  throw std::invalid_argument("safetensors_dtype_name: invalid dtype");
}

DType safetensors_dtype_from_name(std::string_view s) {
  if (s == "F32") return DType::f32;
  if (s == "F64") return DType::f64;
  if (s == "BF16") return DType::bf16;
  if (s == "F16") return DType::f16;
  if (s == "I32") return DType::i32;
  if (s == "I64") return DType::i64;
  if (s == "BOOL") return DType::boolean;
  if (is_foreign_safetensors_dtype(s))
    throw std::runtime_error("dtype " + std::string(s) +
                             " is not supported (areno holds F32, F64, BF16, F16, I32, I64, BOOL)");
  throw std::runtime_error("unknown dtype '" + std::string(s) + "'");
}

// ---- the mapping ----

struct MappedFile {
  void* base = nullptr;
  size_t size = 0;
  bool writable = true;  // false: read-only pages, so load() must copy
  bool mapped = true;    // false: memory the caller owns (from_memory)
  ~MappedFile() {
    if (base != nullptr && mapped) munmap(base, size);
  }
};

namespace {

std::shared_ptr<MappedFile> map_file(const std::string& path) {
  report_open(path);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_file(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail_file(path, std::string("cannot stat: ") + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail_file(path, "not a regular file");
  }
  auto m = std::make_shared<MappedFile>();
  m->size = size_t(st.st_size);
  if (m->size < 8) {
    ::close(fd);
    fail_file(path, "file is " + std::to_string(m->size) +
                        " bytes, shorter than the 8-byte header length");
  }
  // MAP_PRIVATE + PROT_WRITE: tensors viewing the file may be written in place
  // (optimizers, copy_) without touching the file or faulting. The kernel
  // counts such a mapping against the commit limit, so a file larger than
  // memory may be refused; then map read-only and have load() copy.
  void* p = ::mmap(nullptr, m->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED && errno == ENOMEM) {
    p = ::mmap(nullptr, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
    m->writable = false;
  }
  int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) fail_file(path, std::string("mmap failed: ") + std::strerror(e));
  m->base = p;
  return m;
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Parses JSON text, rejecting duplicate keys at any depth (nlohmann would keep
// the last silently, and two tensors of one name mean a corrupt file).
// `where` prefixes errors ("safetensors file 'x': header").
json parse_json_strict(std::string_view text, const std::string& where) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto cb = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: keys.emplace_back(); break;
      case json::parse_event_t::object_end: keys.pop_back(); break;
      case json::parse_event_t::key: {
        const std::string& k = parsed.get_ref<const std::string&>();
        if (!keys.back().insert(k).second) {
          throw std::runtime_error(where + " has the key '" + k + "' twice" +
                                   (depth == 1 ? " (duplicate tensor name)" : ""));
        }
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    throw std::runtime_error(where + " is not valid JSON: " + e.what());
  }
}

// A JSON number that is a non-negative integer fitting int64.
bool as_index(const json& j, uint64_t& out) {
  if (!j.is_number_unsigned()) return false;
  out = j.get<uint64_t>();
  return out <= uint64_t(INT64_MAX);
}

}  // namespace

// ---- reading ----

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  map_ = map_file(path);
  parse();
}

SafetensorsFile SafetensorsFile::from_memory(const std::string& name, std::string_view bytes) {
  auto m = std::make_shared<MappedFile>();
  m->base = const_cast<char*>(bytes.data());
  m->size = bytes.size();
  m->writable = false;
  m->mapped = false;
  if (m->size < 8)
    fail_file(name, "holds " + std::to_string(m->size) + " bytes, fewer than the 8-byte header length");
  SafetensorsFile f;
  f.path_ = name;
  f.map_ = std::move(m);
  f.parse();
  return f;
}

void SafetensorsFile::parse() {
  const std::string& path = path_;
  const auto* bytes = static_cast<const uint8_t*>(map_->base);
  const uint64_t size = map_->size;
  const uint64_t n = read_u64_le(bytes);
  if (n > kMaxHeaderBytes)
    fail_file(path, "header length " + std::to_string(n) + " exceeds the " +
                        std::to_string(kMaxHeaderBytes) + "-byte limit (corrupt file?)");
  if (n > size - 8)
    fail_file(path, "header length " + std::to_string(n) + " runs past the end of the file (" +
                        std::to_string(size) + " bytes)");
  data_start_ = 8 + n;
  const uint64_t data_size = size - data_start_;

  json header = parse_json_strict(
      std::string_view(reinterpret_cast<const char*>(bytes + 8), size_t(n)),
      "safetensors file '" + path + "': header");
  if (!header.is_object())
    fail_file(path, std::string("header must be a JSON object, got ") + header.type_name());

  std::vector<SafetensorsEntry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail_file(path, "__metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail_file(path, "__metadata__ value of '" + m.key() + "' is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) fail_tensor(path, name, "entry must be an object");
    SafetensorsEntry e;
    e.name = name;
    auto dt = v.find("dtype");
    if (dt == v.end()) fail_tensor(path, name, "missing \"dtype\"");
    if (!dt->is_string()) fail_tensor(path, name, "\"dtype\" must be a string");
    try {
      e.dtype = safetensors_dtype_from_name(dt->get<std::string>());
    } catch (const std::runtime_error& err) {
      fail_tensor(path, name, err.what());
    }
    auto sh = v.find("shape");
    if (sh == v.end()) fail_tensor(path, name, "missing \"shape\"");
    if (!sh->is_array()) fail_tensor(path, name, "\"shape\" must be an array");
    uint64_t numel = 1;
    for (const json& d : *sh) {
      uint64_t x = 0;
      if (!as_index(d, x))
        fail_tensor(path, name, "shape " + sh->dump() + " has an entry that is not a non-negative integer");
      if (__builtin_mul_overflow(numel, x, &numel) || numel > uint64_t(INT64_MAX))
        fail_tensor(path, name, "shape " + sh->dump() + " has more elements than fit in 64 bits");
      e.shape.push_back(int64_t(x));
    }
    auto off = v.find("data_offsets");
    if (off == v.end()) fail_tensor(path, name, "missing \"data_offsets\"");
    if (!off->is_array() || off->size() != 2 || !as_index((*off)[0], e.begin) ||
        !as_index((*off)[1], e.end))
      fail_tensor(path, name, "\"data_offsets\" must be two non-negative integers, got " + off->dump());
    if (e.end < e.begin)
      fail_tensor(path, name, "data_offsets " + off->dump() + " are reversed");
    if (e.end > data_size)
      fail_tensor(path, name, "data_offsets " + off->dump() + " run past the end of the data (" +
                                  std::to_string(data_size) + " bytes)");
    uint64_t expect = 0;
    if (__builtin_mul_overflow(numel, uint64_t(dtype_size(e.dtype)), &expect) ||
        expect != e.end - e.begin)
      fail_tensor(path, name, "data_offsets " + off->dump() + " hold " +
                                  std::to_string(e.end - e.begin) + " bytes but shape " +
                                  sh->dump() + " of " + dt->get<std::string>() + " needs " +
                                  std::to_string(numel) + " x " +
                                  std::to_string(dtype_size(e.dtype)));
    entries.push_back(std::move(e));
  }

  // Two tensors must never share bytes: writing one would change the other.
  std::sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const SafetensorsEntry* last = nullptr;  // the non-empty entry ending furthest so far
  for (const auto& c : entries) {
    if (c.end == c.begin) continue;
    if (last != nullptr && c.begin < last->end)
      fail_tensor(path, c.name, "data [" + std::to_string(c.begin) + ", " + std::to_string(c.end) +
                                    ") overlaps tensor '" + last->name + "' [" +
                                    std::to_string(last->begin) + ", " + std::to_string(last->end) + ")");
    if (last == nullptr || c.end > last->end) last = &c;
  }
  for (auto& e : entries) {
    names_.push_back(e.name);
    std::string key = e.name;
    entries_.emplace(std::move(key), std::move(e));
  }
}

size_t SafetensorsFile::file_size() const { return map_->size; }

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end())
    fail_file(path_, "no tensor named '" + name + "' (" + std::to_string(names_.size()) +
                         " tensors in the file)");
  return it->second;
}

const uint8_t* SafetensorsFile::data_of(const SafetensorsEntry& e) const {
  return static_cast<const uint8_t*>(map_->base) + data_start_ + e.begin;
}

namespace {

// bool tensors must hold 0 or 1: any other byte is not a valid C++ bool.
void check_bool_bytes(const uint8_t* p, uint64_t n, const std::string& path,
                      const std::string& name) {
  for (uint64_t i = 0; i < n; ++i)
    if (p[i] > 1)
      fail_tensor(path, name, "BOOL element " + std::to_string(i) + " has byte value " +
                                  std::to_string(p[i]) + " (expected 0 or 1)");
}

}  // namespace

Tensor SafetensorsFile::load(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const uint8_t* p = data_of(e);
  const uint64_t nbytes = e.end - e.begin;
  if (e.dtype == DType::boolean) check_bool_bytes(p, nbytes, path_, name);
  if (nbytes == 0) return empty(e.shape, TensorOptions(e.dtype));
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) != 0 || !map_->writable)
    return load_copy(name);
  auto storage = Storage::wrap(const_cast<uint8_t*>(p), size_t(nbytes), Device::cpu(),
                               std::static_pointer_cast<void>(map_));
  return make_tensor(std::move(storage), 0, e.shape, contiguous_strides(e.shape), e.dtype);
}

void SafetensorsFile::release_pages(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  if (!map_->mapped) return;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data_of(e));
  const uintptr_t lo = (begin + page - 1) / page * page, hi = (begin + (e.end - e.begin)) / page * page;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

Tensor SafetensorsFile::load_copy(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const uint8_t* p = data_of(e);
  const uint64_t nbytes = e.end - e.begin;
  if (e.dtype == DType::boolean) check_bool_bytes(p, nbytes, path_, name);
  Tensor t = empty(e.shape, TensorOptions(e.dtype));
  if (nbytes) std::memcpy(t.data_ptr(), p, size_t(nbytes));
  return t;
}

std::vector<std::pair<std::string, Tensor>> load_safetensors(const std::string& path) {
  SafetensorsFile f(path);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& n : f.names()) out.emplace_back(n, f.load(n));
  return out;
}

// ---- writing ----

namespace {

// Validates `tensors` and writes one safetensors file into `out` (see save_safetensors).
void write_safetensors(AtomicFile& out, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  auto bad = [&](const std::string& what) {
    throw std::invalid_argument("save_safetensors '" + out.path() + "': " + what);
  };
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name.empty()) bad("empty tensor name");
    if (name == "__metadata__") bad("'__metadata__' is reserved and cannot name a tensor");
    if (!seen.insert(name).second) bad("tensor '" + name + "' given twice");
    if (!t.defined()) bad("tensor '" + name + "' is undefined");
  }

  // Largest elements first, then by name: with an 8-aligned data buffer every
  // tensor starts aligned for its dtype, so readers can view it in place.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    size_t sa = tensors[a].second.element_size(), sb = tensors[b].second.element_size();
    return sa != sb ? sa > sb : tensors[a].first < tensors[b].first;
  });

  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json m = ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  uint64_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    ordered_json e = ordered_json::object();
    e["dtype"] = std::string(safetensors_dtype_name(t.dtype()));
    e["shape"] = t.shape();
    e["data_offsets"] = {offset, offset + t.nbytes()};
    offset += t.nbytes();
    header[name] = std::move(e);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const ordered_json::exception& e) {
    bad(std::string("cannot encode the header (names and metadata must be UTF-8): ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(text.size()) >> (8 * i));
  out.write(len, 8);
  out.write(text);
  NoGradGuard no_grad;
  for (size_t i : order) {
    const Tensor& t = tensors[i].second;
    if (t.numel() == 0) continue;
    Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(Device::cpu()).contiguous();
    out.write(c.data_ptr(), c.nbytes());
  }
}

// "<prefix>-00001-of-00003.safetensors" (transformers' shard names: five digits).
bool is_shard_name(const std::string& name, const std::string& prefix) {
  static const std::string tail = "-00000-of-00000.safetensors";
  if (name.size() != prefix.size() + tail.size() || name.compare(0, prefix.size(), prefix) != 0) return false;
  for (size_t i = 0; i < tail.size(); ++i) {
    const char c = name[prefix.size() + i];
    if (tail[i] == '0' ? !std::isdigit(static_cast<unsigned char>(c)) : c != tail[i]) return false;
  }
  return true;
}

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  AtomicFile out(path);
  write_safetensors(out, tensors, metadata);
  out.commit();
}

// ---- sharded checkpoints ----

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& path) : path_(path) {
  std::error_code ec;
  fs::path p(path);
  fs::path index;
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "model.safetensors.index.json", ec)) {
      index = p / "model.safetensors.index.json";
    } else if (fs::exists(p / "model.safetensors", ec)) {
      p = p / "model.safetensors";
    } else {
      throw std::runtime_error("checkpoint directory '" + path +
                               "' has neither model.safetensors.index.json nor model.safetensors");
    }
  } else if (p.extension() == ".json") {
    index = p;
  }

  if (index.empty()) {
    files_.push_back(std::make_unique<SafetensorsFile>(p.string()));
    for (const auto& n : files_[0]->names()) where_[n] = 0;
    metadata_ = files_[0]->metadata();
    return;
  }

  const std::string ipath = index.string();
  const std::string text = read_file(ipath);
  auto fail = [&](const std::string& what) {
    throw std::runtime_error("checkpoint index '" + ipath + "': " + what);
  };
  json j = parse_json_strict(text, "checkpoint index '" + ipath + "'");
  if (!j.is_object()) fail("must be a JSON object");
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object()) fail("missing the \"weight_map\" object");
  if (auto md = j.find("metadata"); md != j.end() && md->is_object())
    for (auto it = md->begin(); it != md->end(); ++it)
      metadata_[it.key()] = it.value().is_string() ? it.value().get<std::string>() : it.value().dump();

  std::map<std::string, size_t> shard_index;  // shard file -> index into files_
  const fs::path dir = index.parent_path();
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    const std::string& name = it.key();
    if (!it.value().is_string()) fail("weight_map entry of '" + name + "' is not a file name");
    const std::string shard = it.value().get<std::string>();
    auto s = shard_index.find(shard);
    if (s == shard_index.end()) {
      fs::path sp = dir / shard;
      if (!fs::is_regular_file(sp, ec))
        fail("shard '" + shard + "' (holding tensor '" + name + "') does not exist at '" +
             sp.string() + "'");
      files_.push_back(std::make_unique<SafetensorsFile>(sp.string()));
      s = shard_index.emplace(shard, files_.size() - 1).first;
    }
    if (!files_[s->second]->contains(name))
      fail("tensor '" + name + "' is mapped to shard '" + shard + "', which has no such tensor");
    where_[name] = s->second;
  }
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& kv : where_) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end())
    throw std::runtime_error("checkpoint '" + path_ + "': no tensor named '" + name + "'");
  return *files_[it->second];
}

const SafetensorsEntry& SafetensorsCheckpoint::entry(const std::string& name) const {
  return file_of(name).entry(name);
}

Tensor SafetensorsCheckpoint::load(const std::string& name) const { return file_of(name).load(name); }

std::vector<std::string> stage_safetensors_sharded(
    FileSet& files, const std::string& dir, const std::vector<std::pair<std::string, Tensor>>& tensors,
    uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata, const std::string& prefix) {
  if (max_shard_bytes == 0)
    throw std::invalid_argument("save_safetensors_sharded: max_shard_bytes must be positive");
  std::set<std::string> seen;
  for (const auto& kv : tensors)
    if (!seen.insert(kv.first).second)
      throw std::invalid_argument("save_safetensors_sharded: tensor '" + kv.first + "' given twice");
  std::vector<std::vector<size_t>> shards;
  uint64_t cur = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].second.defined())
      throw std::invalid_argument("save_safetensors_sharded: tensor '" + tensors[i].first +
                                  "' is undefined");
    const uint64_t nb = tensors[i].second.nbytes();
    if (shards.empty() || (cur > 0 && cur + nb > max_shard_bytes)) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += nb;
    total += nb;
  }
  if (shards.empty()) shards.emplace_back();

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error("save_safetensors_sharded: cannot create '" + dir + "': " + ec.message());

  if (shards.size() == 1) {
    const std::string file = prefix + ".safetensors";
    write_safetensors(files.add((fs::path(dir) / file).string()), tensors, metadata);
    return {file};
  }
  std::vector<std::string> written;
  json weight_map = json::object();
  const size_t n = shards.size();
  for (size_t s = 0; s < n; ++s) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", s + 1, n);
    const std::string file = prefix + buf;
    std::vector<std::pair<std::string, Tensor>> part;
    for (size_t i : shards[s]) {
      part.push_back(tensors[i]);
      weight_map[tensors[i].first] = file;
    }
    write_safetensors(files.add((fs::path(dir) / file).string()), part, metadata);
    written.push_back(file);
  }
  json index = json::object();
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = std::move(weight_map);
  const std::string ifile = prefix + ".safetensors.index.json";
  files.add((fs::path(dir) / ifile).string()).write(index.dump(2) + "\n");
  written.push_back(ifile);
  return written;
}

void remove_stale_shards(const std::string& dir, const std::vector<std::string>& keep, const std::string& prefix) {
  const std::set<std::string> kept(keep.begin(), keep.end());
  const std::string index = prefix + ".safetensors.index.json", single = prefix + ".safetensors";
  std::vector<fs::path> stale;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (kept.count(name) || !(name == index || name == single || is_shard_name(name, prefix))) continue;
    // The stale index first: the loader prefers an index, so it must never
    // outlive the new files nor point at removed shards.
    if (name == index)
      stale.insert(stale.begin(), it->path());
    else
      stale.push_back(it->path());
  }
  if (ec) throw std::runtime_error("cannot list '" + dir + "' to remove stale shards: " + ec.message());
  for (const auto& p : stale) {
    fs::remove(p, ec);
    if (ec) throw std::runtime_error("cannot remove the stale '" + p.string() + "': " + ec.message());
  }
  if (!stale.empty()) sync_dir(dir);
}

std::vector<std::string> save_safetensors_sharded(
    const std::string& dir, const std::vector<std::pair<std::string, Tensor>>& tensors,
    uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata,
    const std::string& prefix) {
  FileSet files;
  std::vector<std::string> written = stage_safetensors_sharded(files, dir, tensors, max_shard_bytes, metadata, prefix);
  files.commit();
  remove_stale_shards(dir, written, prefix);
  return written;
}

}  // namespace areno
