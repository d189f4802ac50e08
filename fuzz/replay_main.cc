// The ordinary build's stand-in for libFuzzer's main (fuzz/fuzz.bzl): runs a fuzz target's
// LLVMFuzzerTestOneInput once on each file named on the command line (a directory: each file in
// it), each as one gtest case named after the file, so that a test log says which input broke
// a property (the target aborts on it; the case that was running is the last "[ RUN ]" line).
//
// Without a single input it fails: a corpus that went missing must not pass as a clean run.

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) __attribute__((weak));

namespace {

std::string Read(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A gtest name from a path: its parent directory and file name, [A-Za-z0-9_] only.
std::string CaseName(const std::filesystem::path& path) {
  std::string name = path.parent_path().filename().string() + "_" + path.filename().string();
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  std::vector<std::filesystem::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    if (std::filesystem::is_directory(arg)) {
      for (const auto& entry : std::filesystem::directory_iterator(arg)) {
        if (entry.is_regular_file()) inputs.push_back(entry.path());
      }
    } else {
      inputs.push_back(arg);
    }
  }
  std::sort(inputs.begin(), inputs.end());
  for (const std::filesystem::path& path : inputs) {
    testing::RegisterTest("Replay", CaseName(path).c_str(), nullptr, path.string().c_str(),
                          __FILE__, __LINE__, [path]() -> testing::Test* {
                            struct Case : testing::Test {
                              explicit Case(std::filesystem::path p) : path(std::move(p)) {}
                              void TestBody() override {
                                ASSERT_TRUE(std::filesystem::is_regular_file(path)) << path;
                                const std::string data = Read(path);
                                LLVMFuzzerTestOneInput(
                                    reinterpret_cast<const uint8_t*>(data.data()), data.size());
                              }
                              std::filesystem::path path;
                            };
                            return new Case(path);
                          });
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "replay: no input files given (expected the target's corpus)\n");
    return 1;
  }
  return RUN_ALL_TESTS();
}
