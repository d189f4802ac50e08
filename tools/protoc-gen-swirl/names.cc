#include "tools/protoc-gen-swirl/names.h"

#include <cctype>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "google/protobuf/descriptor.pb.h"

namespace swirl::protoc_gen {
namespace {

// protobuf 3.21's list (src/google/protobuf/compiler/cpp/helpers.cc, kKeywordList).
constexpr const char* kKeywords[] = {
    "NULL",         "alignas",       "alignof",     "and",          "and_eq",
    "asm",          "auto",          "bitand",      "bitor",        "bool",
    "break",        "case",          "catch",       "char",         "class",
    "compl",        "const",         "constexpr",   "const_cast",   "continue",
    "decltype",     "default",       "delete",      "do",           "double",
    "dynamic_cast", "else",          "enum",        "explicit",     "export",
    "extern",       "false",         "float",       "for",          "friend",
    "goto",         "if",            "inline",      "int",          "long",
    "mutable",      "namespace",     "new",         "noexcept",     "not",
    "not_eq",       "nullptr",       "operator",    "or",           "or_eq",
    "private",      "protected",     "public",      "register",     "reinterpret_cast",
    "return",       "short",         "signed",      "sizeof",       "static",
    "static_assert", "static_cast",  "struct",      "switch",       "template",
    "this",         "thread_local",  "throw",       "true",         "try",
    "typedef",      "typeid",        "typename",    "union",        "unsigned",
    "using",        "virtual",       "void",        "volatile",     "wchar_t",
    "while",        "xor",           "xor_eq",
};

// C++20 keywords protobuf 3.21 does not rename; used only to refuse such method names.
constexpr const char* kNewerKeywords[] = {
    "char8_t", "char16_t", "char32_t", "concept", "consteval", "constinit",
    "co_await", "co_return", "co_yield", "requires",
};

const absl::flat_hash_set<std::string>& ProtobufKeywords() {
  static const auto* set =
      new absl::flat_hash_set<std::string>(std::begin(kKeywords), std::end(kKeywords));
  return *set;
}

}  // namespace

std::string ResolveKeyword(const std::string& name) {
  return ProtobufKeywords().contains(name) ? name + "_" : name;
}

bool IsCppKeyword(const std::string& name) {
  if (ProtobufKeywords().contains(name)) return true;
  for (const char* k : kNewerKeywords) {
    if (name == k) return true;
  }
  return false;
}

std::string ClassName(const google::protobuf::Descriptor* descriptor) {
  std::string name;
  if (descriptor->containing_type() != nullptr) {
    name = ClassName(descriptor->containing_type()) + "_";
  }
  name += descriptor->name();
  if (descriptor->options().map_entry()) name += "_DoNotUse";
  return ResolveKeyword(name);
}

std::string PackageNamespace(const std::string& package) {
  return absl::StrReplaceAll(package, {{".", "::"}});
}

std::string QualifiedClassName(const google::protobuf::Descriptor* descriptor) {
  const std::string& package = descriptor->file()->package();
  if (package.empty()) return "::" + ClassName(descriptor);
  return "::" + PackageNamespace(package) + "::" + ClassName(descriptor);
}

std::string StripProto(const std::string& filename) {
  for (const char* suffix : {".protodevel", ".proto"}) {
    if (absl::EndsWith(filename, suffix)) {
      return filename.substr(0, filename.size() - std::char_traits<char>::length(suffix));
    }
  }
  return filename;
}

std::string IncludeGuard(const std::string& path) {
  std::string guard;
  guard.reserve(path.size() + 1);
  for (char c : path) {
    const auto u = static_cast<unsigned char>(c);
    guard += std::isalnum(u) ? static_cast<char>(std::toupper(u)) : '_';
  }
  // An identifier cannot start with a digit.
  if (!guard.empty() && std::isdigit(static_cast<unsigned char>(guard[0]))) guard = "P" + guard;
  return guard + "_";
}

}  // namespace swirl::protoc_gen
