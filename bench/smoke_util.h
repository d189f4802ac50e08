// Test-only helpers for the benchmark smoke tests: a minimal JSON parser for the tools' --json
// output and a way to run a tool and capture its stdout.

#ifndef SWIRL_BENCH_SMOKE_UTIL_H_
#define SWIRL_BENCH_SMOKE_UTIL_H_

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace swirl::bench_smoke {

// A minimal JSON parser (objects, arrays, strings, numbers, literals).

struct Json {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = kNull;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Json> array;
  std::map<std::string, Json> object;

  bool Has(const std::string& key) const { return kind == kObject && object.count(key) != 0; }
  const Json& operator[](const std::string& key) const { return object.at(key); }
};

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  // Parses one value that must be the whole text (trailing whitespace allowed).
  bool ParseDocument(Json* out) {
    if (!Value(out)) return false;
    Space();
    return i_ == s_.size();
  }

 private:
  void Space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) {
      ++i_;
    }
  }
  bool Literal(const char* word) {
    const std::string w(word);
    if (s_.compare(i_, w.size(), w) != 0) return false;
    i_ += w.size();
    return true;
  }
  bool String(std::string* out) {
    if (i_ >= s_.size() || s_[i_] != '"') return false;
    ++i_;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c == '\\') {
        if (i_ >= s_.size()) return false;
        char e = s_[i_++];
        if (e == 'u') {
          if (i_ + 4 > s_.size()) return false;
          out->push_back(static_cast<char>(std::stoi(s_.substr(i_, 4), nullptr, 16)));
          i_ += 4;
        } else {
          out->push_back(e == 'n' ? '\n' : e == 't' ? '\t' : e);
        }
      } else {
        out->push_back(c);
      }
    }
    if (i_ >= s_.size()) return false;
    ++i_;
    return true;
  }
  bool Value(Json* out) {
    Space();
    if (i_ >= s_.size()) return false;
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      out->kind = Json::kObject;
      Space();
      if (i_ < s_.size() && s_[i_] == '}') return ++i_, true;
      for (;;) {
        Space();
        std::string key;
        if (!String(&key)) return false;
        Space();
        if (i_ >= s_.size() || s_[i_] != ':') return false;
        ++i_;
        if (out->object.count(key) != 0) return false;  // duplicate key
        if (!Value(&out->object[key])) return false;
        Space();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == '}') return ++i_, true;
        return false;
      }
    }
    if (c == '[') {
      ++i_;
      out->kind = Json::kArray;
      Space();
      if (i_ < s_.size() && s_[i_] == ']') return ++i_, true;
      for (;;) {
        out->array.emplace_back();
        if (!Value(&out->array.back())) return false;
        Space();
        if (i_ < s_.size() && s_[i_] == ',') {
          ++i_;
          continue;
        }
        if (i_ < s_.size() && s_[i_] == ']') return ++i_, true;
        return false;
      }
    }
    if (c == '"') {
      out->kind = Json::kString;
      return String(&out->string);
    }
    if (Literal("true")) {
      out->kind = Json::kBool;
      out->boolean = true;
      return true;
    }
    if (Literal("false")) {
      out->kind = Json::kBool;
      return true;
    }
    if (Literal("null")) return true;
    return Number(out);
  }

  // JSON's number grammar only: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?. strtod alone
  // would also take nan, inf, hex and a leading '+', which a JSON reader (report.py) rejects.
  bool Number(Json* out) {
    const size_t begin = i_;
    auto digit = [&] { return i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9'; };
    auto digits = [&] {
      if (!digit()) return false;
      while (digit()) ++i_;
      return true;
    };
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    if (i_ < s_.size() && s_[i_] == '0') {
      ++i_;
    } else if (!digits()) {
      return false;
    }
    if (i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      if (!digits()) return false;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (!digits()) return false;
    }
    out->number = std::strtod(s_.substr(begin, i_ - begin).c_str(), nullptr);
    out->kind = Json::kNumber;
    return true;
  }

  const std::string& s_;
  size_t i_ = 0;
};

// The path of a binary in bench/ from inside a Bazel test (it must be in the test's data).
inline std::string BenchToolPath(const std::string& name) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr) {
    return std::string(srcdir) + "/" + (workspace ? workspace : "swirl") + "/bench/" + name;
  }
  return "bazel-bin/bench/" + name;
}

struct ToolRun {
  int status = -1;
  std::string out;  // stdout only
};

// Runs a shell command line and captures its stdout and exit status.
inline ToolRun RunCommand(const std::string& command) {
  ToolRun run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) run.out.append(buffer, n);
  const int status = pclose(pipe);
  run.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  return run;
}

}  // namespace swirl::bench_smoke

#endif  // SWIRL_BENCH_SMOKE_UTIL_H_
