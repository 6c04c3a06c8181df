#pragma once
// libFuzzer harnesses (issue 13, must show 2). Each harness defines
// LLVMFuzzerTestOneInput; built with clang's -fsanitize=fuzzer by
// scripts/fuzz.sh, and built with replay_main.cpp by the normal build so the
// saved corpora (tests/fuzz/corpus/<name>/) replay as a test in CI.
//
// A harness may throw nothing: the code under test reports bad input with
// exceptions, which the harness catches (std::exception); anything else -- a
// crash, a sanitizer report, a hang, an exception of another type -- is a
// finding.
#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
