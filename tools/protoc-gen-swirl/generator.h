// protoc-gen-swirl's code generator: typed swirl service bases and client stubs.
//
// For every `service S` in pkg/foo.proto (package a.b) it writes into pkg/foo.swirl.h and
// pkg/foo.swirl.cc, in namespace a::b:
//
//   class SService : public ::swirl::Service   // what a server implements: one virtual per method
//   class SStub                                // client calls over a ::swirl::CallTarget
//
// Method options from proto/options.proto: (swirl.blocking) runs the handler on the server's
// thread pool, (swirl.one_way) sends no response (the stub's call never waits: it returns the
// message's status if it settled at once, else OK; plus an allocation-free form taking a
// ClientCall).
// Streaming methods are refused. A file without services still gets both (nearly empty) files.

#ifndef SWIRL_TOOLS_PROTOC_GEN_SWIRL_GENERATOR_H_
#define SWIRL_TOOLS_PROTOC_GEN_SWIRL_GENERATOR_H_

#include <cstdint>
#include <string>

#include "google/protobuf/compiler/code_generator.h"
#include "google/protobuf/descriptor.h"

namespace swirl::protoc_gen {

struct GeneratedFiles {
  std::string header_name;  // "pkg/foo.swirl.h"
  std::string header;
  std::string source_name;  // "pkg/foo.swirl.cc"
  std::string source;
};

// Generates the two files for `file`. False with `*error` set if the file cannot be supported
// (streaming methods, names that would collide in C++).
bool GenerateFiles(const google::protobuf::FileDescriptor* file, GeneratedFiles* out,
                   std::string* error);

class SwirlGenerator : public google::protobuf::compiler::CodeGenerator {
 public:
  bool Generate(const google::protobuf::FileDescriptor* file, const std::string& parameter,
                google::protobuf::compiler::GeneratorContext* context,
                std::string* error) const override;

  uint64_t GetSupportedFeatures() const override { return FEATURE_PROTO3_OPTIONAL; }
};

}  // namespace swirl::protoc_gen

#endif  // SWIRL_TOOLS_PROTOC_GEN_SWIRL_GENERATOR_H_
