// In-process tests of protoc-gen-swirl's generator: what it refuses (streaming, C++ name
// collisions), how it names things (checked against libprotoc's own C++ naming), and the shape of
// the generated text for inputs that the Bazel-built test protos do not cover.

#include "tools/protoc-gen-swirl/generator.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "google/protobuf/compiler/code_generator.h"
#include "google/protobuf/compiler/cpp/names.h"
#include "google/protobuf/compiler/parser.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
#include "tools/protoc-gen-swirl/names.h"

namespace swirl::protoc_gen {
namespace {

using ::google::protobuf::Descriptor;
using ::google::protobuf::DescriptorPool;
using ::google::protobuf::FileDescriptor;
using ::google::protobuf::FileDescriptorProto;
using ::testing::HasSubstr;
using ::testing::Not;

class FailingErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    ADD_FAILURE() << "parse error at " << line + 1 << ":" << column + 1 << ": " << message;
  }
};

// Parses .proto text (which may import only files already in `pool`) and builds it in `pool`.
const FileDescriptor* BuildProto(DescriptorPool& pool, const std::string& name,
                                 const std::string& text) {
  google::protobuf::io::ArrayInputStream input(text.data(), static_cast<int>(text.size()));
  FailingErrorCollector errors;
  google::protobuf::io::Tokenizer tokenizer(&input, &errors);
  google::protobuf::compiler::Parser parser;
  parser.RecordErrorsTo(&errors);
  FileDescriptorProto proto;
  if (!parser.Parse(&tokenizer, &proto)) return nullptr;
  proto.set_name(name);
  return pool.BuildFile(proto);
}

// Generates for `text`; the error if the generator refused it, else "".
std::string GenerateError(const std::string& text) {
  DescriptorPool pool;
  const FileDescriptor* file = BuildProto(pool, "x/in.proto", text);
  if (file == nullptr) return "proto did not build";
  GeneratedFiles files;
  std::string error;
  if (GenerateFiles(file, &files, &error)) return "";
  EXPECT_FALSE(error.empty());
  return error;
}

GeneratedFiles Generate(DescriptorPool& pool, const std::string& name, const std::string& text) {
  GeneratedFiles files;
  const FileDescriptor* file = BuildProto(pool, name, text);
  if (file == nullptr) {
    ADD_FAILURE() << "proto did not build";
    return files;
  }
  std::string error;
  EXPECT_TRUE(GenerateFiles(file, &files, &error)) << error;
  return files;
}

// ---- Refused inputs -----------------------------------------------------------------------------

constexpr char kStreaming[] = R"(
  syntax = "proto3";
  package a.b;
  message M {}
  service S {
    rpc Unary(M) returns (M);
    rpc $name$($client$M) returns ($server$M);
  }
)";

std::string StreamingProto(const std::string& name, bool client, bool server) {
  std::string text = kStreaming;
  auto replace = [&](const std::string& from, const std::string& to) {
    text.replace(text.find(from), from.size(), to);
  };
  replace("$name$", name);
  replace("$client$", client ? "stream " : "");
  replace("$server$", server ? "stream " : "");
  return text;
}

TEST(GeneratorTest, RefusesStreamingMethods) {
  EXPECT_EQ(GenerateError(StreamingProto("Up", true, false)),
            "swirl supports unary methods only: a.b.S.Up is client-streaming");
  EXPECT_EQ(GenerateError(StreamingProto("Down", false, true)),
            "swirl supports unary methods only: a.b.S.Down is server-streaming");
  EXPECT_EQ(GenerateError(StreamingProto("Both", true, true)),
            "swirl supports unary methods only: a.b.S.Both is bidirectional-streaming");
  EXPECT_EQ(GenerateError(StreamingProto("Plain", false, false)), "");
}

class MemoryContext : public google::protobuf::compiler::GeneratorContext {
 public:
  google::protobuf::io::ZeroCopyOutputStream* Open(const std::string& filename) override {
    return new google::protobuf::io::StringOutputStream(&files[filename]);
  }
  std::map<std::string, std::string> files;
};

TEST(GeneratorTest, PluginEntryPointReportsTheError) {
  DescriptorPool pool;
  const FileDescriptor* file =
      BuildProto(pool, "x/in.proto", StreamingProto("Up", true, false));
  ASSERT_NE(file, nullptr);
  SwirlGenerator generator;
  MemoryContext context;
  std::string error;
  EXPECT_FALSE(generator.Generate(file, "", &context, &error));
  EXPECT_EQ(error, "swirl supports unary methods only: a.b.S.Up is client-streaming");
}

TEST(GeneratorTest, RefusesParameters) {
  DescriptorPool pool;
  const FileDescriptor* file = BuildProto(pool, "x/in.proto", "syntax = \"proto3\";");
  ASSERT_NE(file, nullptr);
  SwirlGenerator generator;
  MemoryContext context;
  std::string error;
  EXPECT_FALSE(generator.Generate(file, "lite", &context, &error));
  EXPECT_THAT(error, HasSubstr("\"lite\""));
}

TEST(GeneratorTest, RefusesGeneratedClassNamesTakenInThePackage) {
  EXPECT_THAT(GenerateError(R"(
    syntax = "proto3";
    package a.b;
    message StoreService {}
    service Store { rpc Get(StoreService) returns (StoreService); }
  )"),
              HasSubstr("StoreService generated for service a.b.Store would collide with "
                        "a.b.StoreService"));
  EXPECT_THAT(GenerateError(R"(
    syntax = "proto3";
    package a.b;
    message M {}
    enum StoreStub { ZERO = 0; }
    service Store { rpc Get(M) returns (M); }
  )"),
              HasSubstr("StoreStub generated for service a.b.Store would collide"));
}

// One asynchronous style (generator.cc, before EmitStubDeclaration): completion callbacks, the
// allocation-free form with a caller-owned ClientCall and the form that copies the request.
// No futures, so a method may be called GetAsync beside Get.
TEST(GeneratorTest, StubsCompleteAsynchronousCallsByCallbackOnly) {
  DescriptorPool pool;
  GeneratedFiles files = Generate(pool, "x/async.proto", R"(
    syntax = "proto3";
    message M {}
    service S {
      rpc Get(M) returns (M);
      rpc GetAsync(M) returns (M);
    }
  )");
  for (const std::string* text : {&files.header, &files.source}) {
    EXPECT_THAT(*text, Not(HasSubstr("Future"))) << *text;
  }
  EXPECT_THAT(files.header, HasSubstr("  void AsyncGet(const ::M& request, ::M* response, "
                                      "::absl::AnyInvocable<void(::absl::Status)> done,\n"));
  EXPECT_THAT(files.header, HasSubstr("  void AsyncGet(::swirl::ClientCall* call, const ::M& "
                                      "request, ::M* response,\n"));
  EXPECT_THAT(files.header, HasSubstr("  ::absl::Status GetAsync(const ::M& request, ::M* "
                                      "response,\n"));
  EXPECT_THAT(files.header, HasSubstr("  void AsyncGetAsync(::swirl::ClientCall* call,"));
}

TEST(GeneratorTest, RefusesMethodsWhoseStubNamesCollide) {
  EXPECT_EQ(GenerateError(R"(
    syntax = "proto3";
    package a.b;
    message M {}
    service S {
      rpc Get(M) returns (M);
      rpc AsyncGet(M) returns (M);
    }
  )"),
            "swirl: SStub::AsyncGet generated for method a.b.S.AsyncGet collides with method "
            "a.b.S.Get; rename the method");
  EXPECT_THAT(GenerateError(R"(
    syntax = "proto3";
    message M {}
    service S { rpc SStub(M) returns (M); }
  )"),
              HasSubstr("SStub::SStub"));
  EXPECT_THAT(GenerateError(R"(
    syntax = "proto3";
    message M {}
    service S { rpc SService(M) returns (M); }
  )"),
              HasSubstr("SService::SService"));
  EXPECT_THAT(GenerateError(R"(
    syntax = "proto3";
    message M {}
    service S { rpc MethodIds(M) returns (M); }
  )"),
              HasSubstr("SStub::MethodIds"));
}

// ---- Generated text -----------------------------------------------------------------------------

TEST(GeneratorTest, FileWithoutServicesStillGetsBothFiles) {
  DescriptorPool pool;
  GeneratedFiles files = Generate(pool, "pkg/sub/plain.proto", R"(
    syntax = "proto3";
    package p;
    message M {}
  )");
  EXPECT_EQ(files.header_name, "pkg/sub/plain.swirl.h");
  EXPECT_EQ(files.source_name, "pkg/sub/plain.swirl.cc");
  EXPECT_EQ(files.header,
            "// Generated by protoc-gen-swirl from pkg/sub/plain.proto. DO NOT EDIT.\n"
            "\n"
            "#ifndef PKG_SUB_PLAIN_SWIRL_H_\n"
            "#define PKG_SUB_PLAIN_SWIRL_H_\n"
            "\n"
            "// pkg/sub/plain.proto defines no services.\n"
            "\n"
            "#endif  // PKG_SUB_PLAIN_SWIRL_H_\n");
  EXPECT_EQ(files.source,
            "// Generated by protoc-gen-swirl from pkg/sub/plain.proto. DO NOT EDIT.\n"
            "\n"
            "#include \"pkg/sub/plain.swirl.h\"\n");
}

TEST(GeneratorTest, PluginEntryPointWritesBothFiles) {
  DescriptorPool pool;
  const FileDescriptor* file = BuildProto(pool, "d/e-f.proto", R"(
    syntax = "proto3";
    package d;
    message M {}
    service S { rpc Get(M) returns (M); }
  )");
  ASSERT_NE(file, nullptr);
  SwirlGenerator generator;
  MemoryContext context;
  std::string error;
  ASSERT_TRUE(generator.Generate(file, "", &context, &error)) << error;
  ASSERT_EQ(context.files.size(), 2u);
  EXPECT_THAT(context.files["d/e-f.swirl.h"], HasSubstr("#ifndef D_E_F_SWIRL_H_\n"));
  EXPECT_THAT(context.files["d/e-f.swirl.h"], HasSubstr("#include \"d/e-f.pb.h\"\n"));
  EXPECT_THAT(context.files["d/e-f.swirl.cc"], HasSubstr("#include \"d/e-f.swirl.h\"\n"));
}

TEST(GeneratorTest, NamespacesTypesIdsAndComments) {
  DescriptorPool pool;
  ASSERT_NE(BuildProto(pool, "other/types.proto", R"(
    syntax = "proto3";
    package other.pkg;
    message Outer { message Inner { message Deepest {} } }
  )"),
            nullptr);
  GeneratedFiles files = Generate(pool, "a/b/svc.proto", R"(
    syntax = "proto3";
    package a.b;
    import "other/types.proto";
    message Req { message Part {} }

    // Service comment,
    // two lines.
    service Svc {
      // Method comment. \
      // With a blank line below.
      //
      // And a last line.
      rpc Call(Req.Part) returns (other.pkg.Outer.Inner.Deepest);
      rpc delete(Req) returns (Req);
    }
  )");
  const std::string& h = files.header;
  const std::string& cc = files.source;
  EXPECT_THAT(h, HasSubstr("// Generated by protoc-gen-swirl from a/b/svc.proto. DO NOT EDIT.\n"));
  EXPECT_THAT(h, HasSubstr("#ifndef A_B_SVC_SWIRL_H_\n#define A_B_SVC_SWIRL_H_\n"));
  EXPECT_THAT(h, HasSubstr("#include \"a/b/svc.pb.h\"\n"));
  EXPECT_THAT(h, HasSubstr("#include \"swirl/call.h\"\n#include \"swirl/service.h\"\n"));
  EXPECT_THAT(h, HasSubstr("namespace a::b {\n"));
  EXPECT_THAT(h, HasSubstr("}  // namespace a::b\n"));
  EXPECT_THAT(h, HasSubstr("// Service comment,\n// two lines.\n//\n// Server side of a.b.Svc"));
  EXPECT_THAT(h, HasSubstr("// Service comment,\n// two lines.\n//\n// Client of a.b.Svc"));
  EXPECT_THAT(h, HasSubstr("class SvcService : public ::swirl::Service {\n"));
  EXPECT_THAT(h, HasSubstr("static constexpr char kServiceName[] = \"a.b.Svc\";\n"));
  EXPECT_THAT(h, HasSubstr("class SvcStub {\n"));
  // The comment's trailing backslash must not continue the comment onto the next line.
  EXPECT_THAT(h, HasSubstr("  // Method comment. \\.\n"
                           "  // With a blank line below.\n"
                           "  //\n"
                           "  // And a last line.\n"
                           "  virtual ::absl::Status Call("));
  EXPECT_THAT(h, HasSubstr("const ::a::b::Req_Part& request"));
  EXPECT_THAT(h, HasSubstr("::other::pkg::Outer_Inner_Deepest* response"));
  EXPECT_THAT(h, HasSubstr("void AsyncCall(::swirl::ClientCall* call,"));
  // A keyword method gets a C++ name with "_" but keeps its wire name.
  EXPECT_THAT(h, HasSubstr("virtual ::absl::Status delete_("));
  EXPECT_THAT(h, HasSubstr("void Asyncdelete_("));
  EXPECT_THAT(cc, HasSubstr("AddUnaryMethod<::a::b::Req, ::a::b::Req>(\n      \"delete\",\n"));
  EXPECT_THAT(cc, HasSubstr("return this->delete_(context, request, response);"));
  EXPECT_THAT(cc, HasSubstr("::swirl::MethodId(\"/a.b.Svc/delete\")"));
  EXPECT_THAT(cc, HasSubstr("::swirl::MethodId(\"/a.b.Svc/Call\")"));
  EXPECT_THAT(cc, HasSubstr("UnimplementedError(\"a.b.Svc.Call is not implemented\")"));
  EXPECT_THAT(cc, HasSubstr("::swirl::Service(kServiceName)"));
  EXPECT_THAT(cc, HasSubstr("::swirl::MethodOptions{::swirl::Execution::kWorker, "
                            "/*one_way=*/false}"));
  // No line longer than the project's 100 columns.
  for (const std::string* text : {&h, &cc}) {
    size_t start = 0;
    while (start < text->size()) {
      size_t end = text->find('\n', start);
      if (end == std::string::npos) end = text->size();
      EXPECT_LE(end - start, 100u) << text->substr(start, end - start);
      start = end + 1;
    }
  }
}

TEST(GeneratorTest, FileWithoutPackageHasNoNamespace) {
  DescriptorPool pool;
  GeneratedFiles files = Generate(pool, "top.proto", R"(
    syntax = "proto3";
    message M {}
    service S { rpc Get(M) returns (M); }
  )");
  EXPECT_THAT(files.header, Not(HasSubstr("namespace")));
  EXPECT_THAT(files.header, HasSubstr("static constexpr char kServiceName[] = \"S\";"));
  EXPECT_THAT(files.header, HasSubstr("const ::M& request"));
  EXPECT_THAT(files.source, HasSubstr("MethodId(\"/S/Get\")"));
}

// ---- Naming -------------------------------------------------------------------------------------

TEST(NamesTest, HelpersForPaths) {
  EXPECT_EQ(StripProto("a/b.proto"), "a/b");
  EXPECT_EQ(StripProto("a/b.protodevel"), "a/b");
  EXPECT_EQ(StripProto("a/b"), "a/b");
  EXPECT_EQ(IncludeGuard("pkg/foo-bar.swirl.h"), "PKG_FOO_BAR_SWIRL_H_");
  EXPECT_EQ(IncludeGuard("9lives.swirl.h"), "P9LIVES_SWIRL_H_");
  EXPECT_EQ(PackageNamespace("a.b.c"), "a::b::c");
  EXPECT_EQ(PackageNamespace(""), "");
}

// Our class names agree with libprotoc's C++ generator, keywords and nesting included.
TEST(NamesTest, ClassNamesMatchProtobufCppGenerator) {
  const std::vector<std::string> names = {
      "Plain",    "class",     "NULL",     "delete",   "int",      "namespace", "this",
      "typename", "while",     "xor_eq",   "char8_t",  "char16_t", "concept",   "requires",
      "co_await", "constinit", "consteval", "override", "final",    "Class",
  };
  FileDescriptorProto proto;
  proto.set_name("kw/kw.proto");
  proto.set_package("kw.pkg");
  for (const std::string& name : names) {
    auto* message = proto.add_message_type();
    message->set_name(name);
    message->add_nested_type()->set_name("Inner");
    message->add_nested_type()->set_name("class");
  }
  DescriptorPool pool;
  const FileDescriptor* file = pool.BuildFile(proto);
  ASSERT_NE(file, nullptr);
  std::vector<const Descriptor*> all;
  for (int i = 0; i < file->message_type_count(); ++i) {
    all.push_back(file->message_type(i));
    for (int j = 0; j < file->message_type(i)->nested_type_count(); ++j) {
      all.push_back(file->message_type(i)->nested_type(j));
    }
  }
  for (const Descriptor* d : all) {
    SCOPED_TRACE(d->full_name());
    const std::string expected = google::protobuf::compiler::cpp::ClassName(d);
    EXPECT_EQ(ClassName(d), expected);
    EXPECT_EQ(QualifiedClassName(d), "::kw::pkg::" + expected);
    EXPECT_EQ(QualifiedClassName(d), google::protobuf::compiler::cpp::QualifiedClassName(d));
  }
}

TEST(NamesTest, MapEntryAndWellKnownTypes) {
  DescriptorPool pool;
  const FileDescriptor* file = BuildProto(pool, "m.proto", R"(
    syntax = "proto3";
    package m;
    message WithMap { map<string, int32> counts = 1; }
  )");
  ASSERT_NE(file, nullptr);
  const Descriptor* entry = file->message_type(0)->nested_type(0);
  EXPECT_EQ(ClassName(entry), google::protobuf::compiler::cpp::ClassName(entry));
  EXPECT_EQ(ClassName(entry), "WithMap_CountsEntry_DoNotUse");

  // Messages of google.protobuf are named plainly (libprotoc's QualifiedClassName would say
  // ::PROTOBUF_NAMESPACE_ID, a macro only its own generated code defines).
  const Descriptor* file_proto = FileDescriptorProto::descriptor();
  EXPECT_EQ(QualifiedClassName(file_proto), "::google::protobuf::FileDescriptorProto");
}

}  // namespace
}  // namespace swirl::protoc_gen
