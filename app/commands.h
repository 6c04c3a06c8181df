#pragma once
// Subcommands of the `areno` program. Each takes the arguments after its name
// and returns the process exit code.
#include <string>
#include <vector>

namespace areno::app {

using Args = std::vector<std::string>;

int cmd_env(const Args& args);

}  // namespace areno::app
