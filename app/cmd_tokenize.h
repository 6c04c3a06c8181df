// `areno tokenize`: tokenize text or an OpenAI messages file with the model
// directory's tokenizer and print the ids (and rendered prompt) as JSON.
#pragma once

#include <string>
#include <vector>

namespace areno {

// argv[0] is the subcommand name ("tokenize"). Returns the process exit code:
// 0 on success, 1 on a runtime error, 2 on a usage error.
int cmd_tokenize(int argc, char** argv);

namespace app {
// The same for the `areno` dispatcher (app/commands.h style): `args` are the
// arguments after "tokenize".
int cmd_tokenize(const std::vector<std::string>& args);
}  // namespace app

}  // namespace areno
