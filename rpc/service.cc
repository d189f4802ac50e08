#include "swirl/service.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "google/protobuf/message_lite.h"
#include "rpc/wire.h"

namespace swirl {
namespace {

class RawInvoker final : public Service::Invoker {
 public:
  explicit RawInvoker(std::shared_ptr<Service::RawHandler> handler) : handler_(std::move(handler)) {}
  absl::Status Invoke(ServerContext& ctx, absl::string_view request,
                      ResponseWriter& response) override {
    return (*handler_)(ctx, request, response);
  }
  Service::RawHandler* raw_handler() override { return handler_.get(); }

 private:
  std::shared_ptr<Service::RawHandler> handler_;
};

}  // namespace

Service::Service(std::string full_name) : full_name_(std::move(full_name)) {}
Service::~Service() = default;

void Service::AddMethod(const std::string& method_name, MethodOptions options,
                        absl::AnyInvocable<std::unique_ptr<Invoker>()> new_invoker) {
  auto method = std::make_unique<Method>();
  method->full_name = absl::StrCat("/", full_name_, "/", method_name);
  method->id = rpc_wire::MethodId(method->full_name.c_str());
  method->options = options;
  method->new_invoker = std::move(new_invoker);
  methods_.push_back(std::move(method));
}

void Service::AddRawMethod(const std::string& method_name, RawHandler handler,
                           MethodOptions options) {
  auto shared = std::make_shared<RawHandler>(std::move(handler));
  AddMethod(method_name, options, [shared]() -> std::unique_ptr<Invoker> {
    return std::make_unique<RawInvoker>(shared);
  });
}

void Service::SetExecution(const std::string& method_name, Execution execution) {
  const std::string full = absl::StrCat("/", full_name_, "/", method_name);
  for (auto& m : methods_) {
    if (m->full_name == full) m->options.execution = execution;
  }
}

absl::Status Service::ResponseTooLarge(size_t size) {
  return absl::ResourceExhaustedError(
      absl::StrCat("response of ", size, " bytes exceeds the maximum message size"));
}

}  // namespace swirl
