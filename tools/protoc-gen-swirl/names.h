// C++ names for protoc-gen-swirl: how protobuf's C++ generator (3.21) names message classes and
// namespaces, and a few helpers for the generated files' names.

#ifndef SWIRL_TOOLS_PROTOC_GEN_SWIRL_NAMES_H_
#define SWIRL_TOOLS_PROTOC_GEN_SWIRL_NAMES_H_

#include <string>

#include "google/protobuf/descriptor.h"

namespace swirl::protoc_gen {

// `name` with a "_" appended if it is a C++ keyword (or one of the few macros protobuf's C++
// generator also avoids), as protobuf's C++ generator does for class and field names.
std::string ResolveKeyword(const std::string& name);
bool IsCppKeyword(const std::string& name);

// The unqualified class name protobuf's C++ generator gives a message: nested messages are joined
// with "_" ("Outer_Inner"), keywords get a "_" suffix.
std::string ClassName(const google::protobuf::Descriptor* descriptor);

// "a.b" -> "a::b"; "" -> "".
std::string PackageNamespace(const std::string& package);

// The fully qualified C++ type of a message: "::a::b::Outer_Inner" (or "::Outer_Inner" for a
// file without a package).
std::string QualifiedClassName(const google::protobuf::Descriptor* descriptor);

// "pkg/foo.proto" -> "pkg/foo" (also strips ".protodevel").
std::string StripProto(const std::string& filename);

// Include guard for a generated file path: "pkg/foo.swirl.h" -> "PKG_FOO_SWIRL_H_".
std::string IncludeGuard(const std::string& path);

}  // namespace swirl::protoc_gen

#endif  // SWIRL_TOOLS_PROTOC_GEN_SWIRL_NAMES_H_
