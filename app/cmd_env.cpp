// `areno env`: what this build is and what it can see.
#include <Eigen/Core>
#include <fmt/format.h>
#include <omp.h>

#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "app/flags.h"
#include "areno_build_config.h"
#include "tensor/backend.h"

namespace areno::app {

namespace {

constexpr const char* kEnvUsage =
    "usage: areno env [--json]\n\nPrints the version, build options, CUDA devices with "
    "their memory, and library versions.\n";

}  // namespace

int cmd_env(const Args& args) {
  bool json = false;
  Flags flags("env", kEnvUsage, Flags::OnUnknown::nothing);
  flags.toggle("--json", json);
  if (auto rc = flags.parse(args)) return *rc;
  nlohmann::json j;
  j["version"] = ARENO_VERSION;
  j["build_type"] = ARENO_BUILD_TYPE;
  j["cuda_compiled"] = cuda_compiled();
  j["cuda_arch"] = ARENO_CUDA_ARCH;
  j["cpu_threads"] = omp_get_max_threads();
  j["eigen"] = fmt::format("{}.{}.{}", EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION);
  j["fmt"] = fmt::format("{}.{}.{}", FMT_VERSION / 10000, FMT_VERSION / 100 % 100, FMT_VERSION % 100);
  j["nlohmann_json"] = fmt::format("{}.{}.{}", NLOHMANN_JSON_VERSION_MAJOR, NLOHMANN_JSON_VERSION_MINOR,
                                   NLOHMANN_JSON_VERSION_PATCH);
  j["cuda_runtime"] = cuda_runtime_version();
  j["cublas"] = cublas_version();
  j["nccl"] = nccl_version();
  j["devices"] = nlohmann::json::array({{{"name", "cpu"}, {"threads", omp_get_max_threads()}}});
  for (auto& d : cuda_devices())
    j["devices"].push_back({{"name", fmt::format("cuda:{}", d.index)},
                            {"model", d.name},
                            {"sm", fmt::format("{}.{}", d.sm_major, d.sm_minor)},
                            {"total_bytes", d.total_bytes},
                            {"free_bytes", d.free_bytes}});
  if (json) {
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("areno {} ({} build)\n", ARENO_VERSION, ARENO_BUILD_TYPE);
  fmt::print("CUDA compiled: {}{}\n", cuda_compiled() ? "yes" : "no",
             cuda_compiled() ? fmt::format(" (sm {}; runtime {}, cuBLAS {}, NCCL {})", ARENO_CUDA_ARCH,
                                           cuda_runtime_version(), cublas_version(), nccl_version())
                             : "");
  fmt::print("libraries: Eigen {}, fmt {}, nlohmann-json {}\n", j["eigen"].get<std::string>(),
             j["fmt"].get<std::string>(), j["nlohmann_json"].get<std::string>());
  fmt::print("devices:\n  cpu ({} threads)\n", omp_get_max_threads());
  for (auto& d : cuda_devices())
    fmt::print("  cuda:{} {} (sm {}.{}), {:.1f} GiB total, {:.1f} GiB free\n", d.index, d.name, d.sm_major,
               d.sm_minor, double(d.total_bytes) / (1 << 30), double(d.free_bytes) / (1 << 30));
  if (cuda_compiled() && cuda_device_count() == 0) fmt::print("  (no CUDA device visible)\n");
  return 0;
}

}  // namespace areno::app
