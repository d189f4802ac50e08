#include "tools/protoc-gen-swirl/generator.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "proto/options.pb.h"
#include "tools/protoc-gen-swirl/names.h"

namespace swirl::protoc_gen {
namespace {

using ::google::protobuf::FileDescriptor;
using ::google::protobuf::MethodDescriptor;
using ::google::protobuf::ServiceDescriptor;
using ::google::protobuf::SourceLocation;

constexpr size_t kColumnLimit = 100;

using Vars = std::map<std::string, std::string>;

// Appends `text` with every $name$ replaced by vars.at(name) ("$$" is a literal "$").
void Emit(std::string* out, const Vars& vars, absl::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t open = text.find('$', pos);
    if (open == absl::string_view::npos) {
      absl::StrAppend(out, text.substr(pos));
      return;
    }
    const size_t close = text.find('$', open + 1);
    if (close == absl::string_view::npos) {
      // Unbalanced: a bug in a template below.
      std::abort();
    }
    absl::StrAppend(out, text.substr(pos, open - pos));
    const absl::string_view name = text.substr(open + 1, close - open - 1);
    if (name.empty()) {
      absl::StrAppend(out, "$");
    } else {
      auto it = vars.find(std::string(name));
      if (it == vars.end()) std::abort();  // a bug in a template below
      absl::StrAppend(out, it->second);
    }
    pos = close + 1;
  }
}

// A declaration or definition head wrapped the way clang-format (Google style, 100 columns)
// lays it out: on one line if it fits, else parameters aligned after the open parenthesis, else
// broken after the parenthesis with a 4-space continuation indent. `tail` follows the ")".
std::string Signature(const std::string& indent, const std::string& head,
                      const std::vector<std::string>& params, const std::string& tail) {
  const std::string one_line =
      absl::StrCat(indent, head, "(", absl::StrJoin(params, ", "), ")", tail);
  if (one_line.size() <= kColumnLimit) return one_line + "\n";

  // Bin-packs params starting at column `column` (first line already holds `first_prefix`).
  auto pack = [&](const std::string& first_prefix, size_t column, std::string* out) {
    std::string line = first_prefix;
    const std::string pad(column, ' ');
    bool line_has_param = false;
    for (size_t i = 0; i < params.size(); ++i) {
      const bool last = i + 1 == params.size();
      const std::string piece = params[i] + (last ? ")" + tail : ",");
      const size_t need = (line_has_param ? 1 : 0) + piece.size();
      if (line_has_param && line.size() + need > kColumnLimit) {
        absl::StrAppend(out, line, "\n");
        line = pad;
        line_has_param = false;
      }
      absl::StrAppend(&line, line_has_param ? " " : "", piece);
      line_has_param = true;
      if (line.size() > kColumnLimit) return false;
    }
    absl::StrAppend(out, line, "\n");
    return true;
  };

  std::string aligned;
  const std::string first = absl::StrCat(indent, head, "(");
  if (pack(first, first.size(), &aligned)) return aligned;
  std::string broken = first + "\n";
  const std::string continuation = indent + "    ";
  pack(continuation, continuation.size(), &broken);  // best effort if a parameter is too long
  return broken;
}

// Comment lines ("// ...") for a .proto leading comment, indented by `indent`.
std::string CommentLines(const std::string& comment, const std::string& indent) {
  std::vector<std::string> lines = absl::StrSplit(comment, '\n');
  while (!lines.empty() && absl::StripAsciiWhitespace(lines.back()).empty()) lines.pop_back();
  while (!lines.empty() && absl::StripAsciiWhitespace(lines.front()).empty()) {
    lines.erase(lines.begin());
  }
  std::string out;
  for (std::string& line : lines) {
    absl::StripTrailingAsciiWhitespace(&line);
    // A trailing backslash would splice the next generated line into the comment.
    if (!line.empty() && line.back() == '\\') line += ".";
    if (line.empty()) {
      absl::StrAppend(&out, indent, "//\n");
    } else {
      absl::StrAppend(&out, indent, "//", line[0] == ' ' ? "" : " ", line, "\n");
    }
  }
  return out;
}

template <typename Descriptor>
std::string LeadingComment(const Descriptor* descriptor, const std::string& indent) {
  SourceLocation location;
  if (!descriptor->GetSourceLocation(&location)) return "";
  return CommentLines(location.leading_comments, indent);
}

struct Method {
  const MethodDescriptor* descriptor;
  std::string name;       // C++ identifier
  std::string request;    // qualified C++ type
  std::string response;   // qualified C++ type
  bool blocking = false;  // (swirl.blocking)
  bool one_way = false;   // (swirl.one_way)
};

struct Service {
  const ServiceDescriptor* descriptor;
  std::string service_class;  // "SService"
  std::string stub_class;     // "SStub"
  std::vector<Method> methods;
};

std::string MethodIdentifier(const MethodDescriptor* method) {
  return IsCppKeyword(method->name()) ? method->name() + "_" : method->name();
}

// Collects what the generator needs and refuses what it cannot generate.
bool Analyze(const FileDescriptor* file, std::vector<Service>* services, std::string* error) {
  const std::string scope = file->package().empty() ? "" : file->package() + ".";
  for (int i = 0; i < file->service_count(); ++i) {
    const ServiceDescriptor* sd = file->service(i);
    Service service;
    service.descriptor = sd;
    service.service_class = sd->name() + "Service";
    service.stub_class = sd->name() + "Stub";
    for (const std::string* cls : {&service.service_class, &service.stub_class}) {
      if (file->pool()->FindFileContainingSymbol(scope + *cls) != nullptr) {
        *error = absl::StrCat("swirl: the class ", *cls, " generated for service ",
                              sd->full_name(), " would collide with ", scope, *cls,
                              " in the same package; rename one of them");
        return false;
      }
    }

    // Members of each generated class, to refuse methods whose C++ names would collide.
    absl::flat_hash_map<std::string, std::string> service_members = {
        {service.service_class, "the class name"},
        {"kServiceName", "a generated constant"},
        // swirl::Service's own members, which a method of the same name would hide.
        {"full_name", "a member of swirl::Service"},
        {"methods", "a member of swirl::Service"},
        {"AddRawMethod", "a member of swirl::Service"},
        {"AddUnaryMethod", "a member of swirl::Service"},
        {"SetExecution", "a member of swirl::Service"},
        {"AddMethod", "a member of swirl::Service"},
    };
    absl::flat_hash_map<std::string, std::string> stub_members = {
        {service.stub_class, "the class name"},
        {"target", "a generated accessor"},
        {"target_", "a generated member"},
        {"owned_target_", "a generated member"},
        {"MethodIds", "a generated helper"},
    };
    auto claim = [&](absl::flat_hash_map<std::string, std::string>& members,
                     const std::string& cls, const std::string& member,
                     const MethodDescriptor* md) {
      const std::string owner = absl::StrCat("method ", md->full_name());
      auto [it, inserted] = members.emplace(member, owner);
      if (inserted) return true;
      *error = absl::StrCat("swirl: ", cls, "::", member, " generated for ", owner,
                            " collides with ", it->second, "; rename the method");
      return false;
    };

    for (int j = 0; j < sd->method_count(); ++j) {
      const MethodDescriptor* md = sd->method(j);
      if (md->client_streaming() || md->server_streaming()) {
        const char* kind = md->client_streaming() && md->server_streaming()
                               ? "bidirectional-streaming"
                               : md->client_streaming() ? "client-streaming"
                                                        : "server-streaming";
        *error = absl::StrCat("swirl supports unary methods only: ", md->full_name(), " is ",
                              kind);
        return false;
      }
      Method method;
      method.descriptor = md;
      method.name = MethodIdentifier(md);
      method.request = QualifiedClassName(md->input_type());
      method.response = QualifiedClassName(md->output_type());
      method.blocking = md->options().GetExtension(::swirl::blocking);
      method.one_way = md->options().GetExtension(::swirl::one_way);

      if (!claim(service_members, service.service_class, method.name, md)) return false;
      std::vector<std::string> stub_names = {method.name};
      if (!method.one_way) stub_names.push_back("Async" + method.name);
      for (const std::string& name : stub_names) {
        if (!claim(stub_members, service.stub_class, name, md)) return false;
      }
      service.methods.push_back(std::move(method));
    }
    services->push_back(std::move(service));
  }
  return true;
}

// ---- Header -------------------------------------------------------------------------------------

void EmitServiceDeclaration(const Service& service, std::string* out) {
  const ServiceDescriptor* sd = service.descriptor;
  Vars vars = {{"class", service.service_class}, {"full_name", sd->full_name()}};
  std::string comment = LeadingComment(sd, "");
  if (!comment.empty()) comment += "//\n";
  vars["comment"] = comment;
  Emit(out, vars,
       "$comment$"
       "// Server side of $full_name$: derive, override the methods and register an instance\n"
       "// with a swirl::Server (or offer it through ChannelOptions::services). Methods left\n"
       "// alone fail with UNIMPLEMENTED.\n"
       "class $class$ : public ::swirl::Service {\n"
       " public:\n"
       "  static constexpr char kServiceName[] = \"$full_name$\";\n"
       "\n"
       "  $class$();\n"
       "  ~$class$() override;\n");
  for (const Method& method : service.methods) {
    absl::StrAppend(out, "\n", LeadingComment(method.descriptor, "  "));
    if (method.blocking) {
      absl::StrAppend(out, "  // Runs on the server's handler thread pool (swirl.blocking).\n");
    }
    if (method.one_way) {
      absl::StrAppend(out,
                      "  // One-way (swirl.one_way): the caller gets no response; `response` is "
                      "discarded.\n");
    }
    absl::StrAppend(out, Signature("  ", "virtual ::absl::Status " + method.name,
                                   {"::swirl::ServerContext& context",
                                    "const " + method.request + "& request",
                                    method.response + "* response"},
                                   ";"));
  }
  absl::StrAppend(out, "};\n");
}

// The stubs' asynchronous style, one per call shape: a completion callback, never a future.
//
// Who this is for: a storage backend keeps many I/Os in flight per thread, and each completion
// starts the next I/O. A callback runs on the worker's loop thread, where a call it starts joins
// that iteration's doorbell with no hand-off (docs/ARCHITECTURE.md), and with a caller-owned
// ClientCall, reused call after call, nothing is allocated per call. A future allocates its
// shared state and a copy of the request per call, and can only be waited on from another
// thread (waiting on the loop thread aborts: it would wait for itself), so completions cannot
// chain on the loop; callers who want to block have the synchronous method (or
// ClientCall::Wait()). So for a unary method: Method() (blocking), AsyncMethod(call, ...)
// (allocation-free) and AsyncMethod(..., done) (the same style, owning a copy of the request,
// for callers who prefer that to managing a ClientCall); for a one-way method: Method() (never
// waits, copies the request) and Method(call, ...) (allocation-free).
void EmitStubDeclaration(const Service& service, std::string* out) {
  const ServiceDescriptor* sd = service.descriptor;
  Vars vars = {{"class", service.stub_class}, {"full_name", sd->full_name()}};
  std::string comment = LeadingComment(sd, "");
  if (!comment.empty()) comment += "//\n";
  vars["comment"] = comment;
  Emit(out, vars,
       "$comment$"
       "// Client of $full_name$ over a ::swirl::CallTarget: a ::swirl::Channel, or\n"
       "// ServerContext::caller() to call back the client of a call being served. Thread-safe\n"
       "// (as the target is); cheap to copy.\n"
       "class $class$ {\n"
       " public:\n"
       "  // Calls over `target`, which must outlive the stub.\n"
       "  explicit $class$(::swirl::CallTarget& target);\n"
       "  // Calls over `target`, which the stub keeps alive.\n"
       "  explicit $class$(::std::shared_ptr<::swirl::CallTarget> target);\n"
       "\n"
       "  ::swirl::CallTarget& target() const { return *target_; }\n");
  const std::string options_param = "const ::swirl::CallOptions& options = {}";
  for (const Method& method : service.methods) {
    const std::string request_param = "const " + method.request + "& request";
    const std::string response_param = method.response + "* response";
    absl::StrAppend(out, "\n", LeadingComment(method.descriptor, "  "));
    if (method.one_way) {
      absl::StrAppend(
          out,
          "  // One-way (swirl.one_way): there is no response. Never waits (so it may be called\n"
          "  // from a handler or callback): the request is copied, and the status is the\n"
          "  // message's if it was sent or refused at once, else OK (queued behind credits).\n",
          Signature("  ", "::absl::Status " + method.name, {request_param, options_param}, ";"),
          "  // Allocation-free: `call` and `request` stay valid until `call` completes.\n",
          Signature("  ", "void " + method.name,
                    {"::swirl::ClientCall* call", request_param, options_param}, ";"));
      continue;
    }
    absl::StrAppend(
        out, "  // Blocks until the response arrives.\n",
        Signature("  ", "::absl::Status " + method.name,
                  {request_param, response_param, options_param}, ";"),
        "  // Asynchronous: `done` runs once the call completes (on the channel's worker thread).\n"
        "  // The request is copied (one allocation per call: for none, use the form below);\n"
        "  // `response` must stay valid until `done` runs.\n",
        Signature("  ", "void Async" + method.name,
                  {request_param, response_param,
                   "::absl::AnyInvocable<void(::absl::Status)> done", options_param},
                  ";"),
        "  // Allocation-free: `call` is caller-owned and reusable once done (set its callback, if\n"
        "  // any, before each use); `request` and `response` must stay valid until it completes.\n",
        Signature("  ", "void Async" + method.name,
                  {"::swirl::ClientCall* call", request_param, response_param, options_param},
                  ";"));
  }
  absl::StrAppend(out,
                  "\n"
                  " private:\n"
                  "  struct MethodIds;\n"
                  "\n"
                  "  ::std::shared_ptr<::swirl::CallTarget> owned_target_;\n"
                  "  ::swirl::CallTarget* target_;\n"
                  "};\n");
}

std::string Header(const FileDescriptor* file, const std::vector<Service>& services,
                   const std::string& header_name) {
  const std::string base = StripProto(file->name());
  const std::string ns = PackageNamespace(file->package());
  std::string out;
  Vars vars = {{"proto", file->name()}, {"guard", IncludeGuard(header_name)}};
  Emit(&out, vars,
       "// Generated by protoc-gen-swirl from $proto$. DO NOT EDIT.\n"
       "\n"
       "#ifndef $guard$\n"
       "#define $guard$\n"
       "\n");
  if (services.empty()) {
    Emit(&out, vars, "// $proto$ defines no services.\n\n#endif  // $guard$\n");
    return out;
  }
  std::vector<std::string> includes = {"absl/functional/any_invocable.h", "absl/status/status.h",
                                       base + ".pb.h", "swirl/call.h", "swirl/service.h"};
  std::sort(includes.begin(), includes.end());
  absl::StrAppend(&out, "#include <memory>\n\n");
  for (const std::string& include : includes) absl::StrAppend(&out, "#include \"", include, "\"\n");
  absl::StrAppend(&out, "\n");
  if (!ns.empty()) absl::StrAppend(&out, "namespace ", ns, " {\n\n");
  for (size_t i = 0; i < services.size(); ++i) {
    if (i > 0) absl::StrAppend(&out, "\n");
    EmitServiceDeclaration(services[i], &out);
    absl::StrAppend(&out, "\n");
    EmitStubDeclaration(services[i], &out);
  }
  if (!ns.empty()) absl::StrAppend(&out, "\n}  // namespace ", ns, "\n");
  Emit(&out, vars, "\n#endif  // $guard$\n");
  return out;
}

// ---- Source -------------------------------------------------------------------------------------

void EmitServiceDefinition(const Service& service, std::string* out) {
  const std::string& cls = service.service_class;
  absl::StrAppend(out, cls, "::", cls, "() : ::swirl::Service(kServiceName) {\n");
  for (const Method& method : service.methods) {
    Vars vars = {
        {"name", method.name},
        {"proto_name", method.descriptor->name()},
        {"request", method.request},
        {"response", method.response},
        {"execution", method.blocking ? "kThreadPool" : "kWorker"},
        {"one_way", method.one_way ? "true" : "false"},
    };
    Emit(out, vars, "  ::swirl::Service::AddUnaryMethod<$request$, $response$>(\n");
    Emit(out, vars, "      \"$proto_name$\",\n");
    absl::StrAppend(out,
                    Signature("      ", "[this]",
                              {"::swirl::ServerContext& context",
                               "const " + method.request + "& request",
                               method.response + "* response"},
                              " {"));
    Emit(out, vars,
         "        return this->$name$(context, request, response);\n"
         "      },\n"
         "      ::swirl::MethodOptions{::swirl::Execution::$execution$, "
         "/*one_way=*/$one_way$});\n");
  }
  absl::StrAppend(out, "}\n\n", cls, "::~", cls, "() = default;\n");
  for (const Method& method : service.methods) {
    absl::StrAppend(out, "\n",
                    Signature("", "::absl::Status " + cls + "::" + method.name,
                              {"::swirl::ServerContext& /*context*/",
                               "const " + method.request + "& /*request*/",
                               method.response + "* /*response*/"},
                              " {"),
                    "  return ::absl::UnimplementedError(\"", method.descriptor->full_name(),
                    " is not implemented\");\n}\n");
  }
}

void EmitStubDefinition(const Service& service, std::string* out) {
  const std::string& cls = service.stub_class;
  Vars vars = {{"class", cls}};
  Emit(out, vars,
       "// Method ids (swirl::MethodId of \"/<service>/<method>\"), computed by the compiler.\n"
       "struct $class$::MethodIds {\n");
  for (const Method& method : service.methods) {
    const std::string wire_name =
        absl::StrCat("/", service.descriptor->full_name(), "/", method.descriptor->name());
    absl::StrAppend(out, "  static constexpr ::std::uint32_t ", method.name,
                    "() {\n"
                    "    constexpr ::std::uint32_t id = ::swirl::MethodId(\"",
                    wire_name,
                    "\");\n"
                    "    return id;\n"
                    "  }\n");
  }
  Emit(out, vars,
       "};\n"
       "\n"
       "$class$::$class$(::swirl::CallTarget& target) : target_(&target) {}\n"
       "\n"
       "$class$::$class$(::std::shared_ptr<::swirl::CallTarget> target)\n"
       "    : owned_target_(::std::move(target)), target_(owned_target_.get()) {}\n");

  const std::string options_param = "const ::swirl::CallOptions& options";
  for (const Method& method : service.methods) {
    vars["name"] = method.name;
    vars["request"] = method.request;
    vars["response"] = method.response;
    const std::string request_param = "const " + method.request + "& request";
    const std::string response_param = method.response + "* response";
    absl::StrAppend(out, "\n");
    if (method.one_way) {
      absl::StrAppend(out, Signature("", "::absl::Status " + cls + "::" + method.name,
                                     {request_param, options_param}, " {"));
      Emit(out, vars,
           "  return ::swirl::CallOneWay(*target_, MethodIds::$name$(),\n"
           "                             ::std::make_unique<$request$>(request), options);\n"
           "}\n"
           "\n");
      absl::StrAppend(out, Signature("", "void " + cls + "::" + method.name,
                                     {"::swirl::ClientCall* call", request_param, options_param},
                                     " {"));
      Emit(out, vars,
           "  call->SetMethod(MethodIds::$name$());\n"
           "  call->SetRequest(&request);\n"
           "  call->SetResponse(nullptr);\n"
           "  call->SetResponseBytes(nullptr);\n"
           "  call->SetOneWay(true);\n"
           "  call->SetOptions(options);\n"
           "  target_->Start(call);\n"
           "}\n");
      continue;
    }
    absl::StrAppend(out, Signature("", "::absl::Status " + cls + "::" + method.name,
                                   {request_param, response_param, options_param}, " {"));
    Emit(out, vars,
         "  return ::swirl::CallUnary(*target_, MethodIds::$name$(), request, response, "
         "options);\n"
         "}\n"
         "\n");
    absl::StrAppend(out, Signature("", "void " + cls + "::Async" + method.name,
                                   {request_param, response_param,
                                    "::absl::AnyInvocable<void(::absl::Status)> done",
                                    options_param},
                                   " {"));
    Emit(out, vars,
         "  // Owns the call and a copy of the request until completion. The callback deletes it:\n"
         "  // the call touches nothing of itself once its callback runs.\n"
         "  struct Holder {\n"
         "    $request$ request;\n"
         "    ::absl::AnyInvocable<void(::absl::Status)> done;\n"
         "    ::swirl::ClientCall call;\n"
         "  };\n"
         "  auto* holder = new Holder{request, ::std::move(done), {}};\n"
         "  holder->call.SetMethod(MethodIds::$name$());\n"
         "  holder->call.SetRequest(&holder->request);\n"
         "  holder->call.SetResponse(response);\n"
         "  holder->call.SetOptions(options);\n"
         "  holder->call.SetCallback([holder](::absl::Status status) {\n"
         "    if (holder->done) holder->done(::std::move(status));\n"
         "    delete holder;\n"
         "  });\n"
         "  target_->Start(&holder->call);\n"
         "}\n"
         "\n");
    absl::StrAppend(out, Signature("", "void " + cls + "::Async" + method.name,
                                   {"::swirl::ClientCall* call", request_param, response_param,
                                    options_param},
                                   " {"));
    Emit(out, vars,
         "  call->SetMethod(MethodIds::$name$());\n"
         "  call->SetRequest(&request);\n"
         "  call->SetResponse(response);\n"
         "  call->SetResponseBytes(nullptr);\n"
         "  call->SetOneWay(false);\n"
         "  call->SetOptions(options);\n"
         "  target_->Start(call);\n"
         "}\n");
  }
}

std::string Source(const FileDescriptor* file, const std::vector<Service>& services,
                   const std::string& header_name) {
  const std::string ns = PackageNamespace(file->package());
  std::string out;
  Vars vars = {{"proto", file->name()}, {"header", header_name}};
  Emit(&out, vars,
       "// Generated by protoc-gen-swirl from $proto$. DO NOT EDIT.\n"
       "\n"
       "#include \"$header$\"\n");
  if (services.empty()) return out;
  absl::StrAppend(&out,
                  "\n"
                  "#include <cstdint>\n"
                  "#include <memory>\n"
                  "#include <utility>\n"
                  "\n"
                  "#include \"absl/functional/any_invocable.h\"\n"
                  "#include \"absl/status/status.h\"\n"
                  "#include \"swirl/call.h\"\n"
                  "#include \"swirl/method_id.h\"\n"
                  "#include \"swirl/service.h\"\n"
                  "\n");
  if (!ns.empty()) absl::StrAppend(&out, "namespace ", ns, " {\n\n");
  for (size_t i = 0; i < services.size(); ++i) {
    if (i > 0) absl::StrAppend(&out, "\n");
    const std::string title = "// ---- " + services[i].descriptor->full_name() + " ";
    absl::StrAppend(&out, title,
                    std::string(title.size() < kColumnLimit ? kColumnLimit - title.size() : 4, '-'),
                    "\n\n");
    EmitServiceDefinition(services[i], &out);
    absl::StrAppend(&out, "\n");
    EmitStubDefinition(services[i], &out);
  }
  if (!ns.empty()) absl::StrAppend(&out, "\n}  // namespace ", ns, "\n");
  return out;
}

bool WriteFile(google::protobuf::compiler::GeneratorContext* context, const std::string& name,
               const std::string& contents) {
  std::unique_ptr<google::protobuf::io::ZeroCopyOutputStream> stream(context->Open(name));
  google::protobuf::io::CodedOutputStream coded(stream.get());
  coded.WriteRaw(contents.data(), static_cast<int>(contents.size()));
  return !coded.HadError();
}

}  // namespace

bool GenerateFiles(const FileDescriptor* file, GeneratedFiles* out, std::string* error) {
  std::vector<Service> services;
  if (!Analyze(file, &services, error)) return false;
  const std::string base = StripProto(file->name());
  out->header_name = base + ".swirl.h";
  out->source_name = base + ".swirl.cc";
  out->header = Header(file, services, out->header_name);
  out->source = Source(file, services, out->header_name);
  return true;
}

bool SwirlGenerator::Generate(const FileDescriptor* file, const std::string& parameter,
                              google::protobuf::compiler::GeneratorContext* context,
                              std::string* error) const {
  if (!parameter.empty()) {
    *error = "protoc-gen-swirl takes no parameters, got \"" + parameter + "\"";
    return false;
  }
  GeneratedFiles files;
  if (!GenerateFiles(file, &files, error)) return false;
  if (!WriteFile(context, files.header_name, files.header) ||
      !WriteFile(context, files.source_name, files.source)) {
    *error = "protoc-gen-swirl: could not write " + files.header_name + " or " + files.source_name;
    return false;
  }
  return true;
}

}  // namespace swirl::protoc_gen
