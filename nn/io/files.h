#pragma once
// Reading files for the loaders, with one place that sees every open.
#include <functional>
#include <string>

namespace areno {

// Reads a whole file; throws std::runtime_error naming the path and the
// reason when it cannot be opened or read.
std::string read_file(const std::string& path);

// Every file the loaders open for reading (config and index JSON, shards,
// PEFT adapters) is reported to this hook first: tests count opens with it.
// Null (the default) reports nothing. Not thread-safe: set it before loading.
using OpenHook = std::function<void(const std::string& path)>;
void set_open_hook(OpenHook hook);
void report_open(const std::string& path);

}  // namespace areno
