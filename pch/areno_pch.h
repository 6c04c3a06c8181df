// Precompiled header of libareno and areno_app (the targets with many
// sources that include nlohmann-json; on the test executables it gained
// nothing measurable and was dropped): the standard library,
// fmt and nlohmann-json, which about half of the sources include and whose
// parsing was 3-7 s of each such compile (README, "Tests").
// Only headers from outside the project, so an edit to ours never rebuilds
// it; every source still includes what it uses (-Db_pch=false builds
// without this file).
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
