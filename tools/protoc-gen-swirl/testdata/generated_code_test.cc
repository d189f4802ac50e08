// Tests of the code protoc-gen-swirl generates for store.proto and nopkg.proto: the service
// bases register the right methods and dispatch to the virtuals, the stubs have the documented
// API and set up their calls.

#include <atomic>
#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "google/protobuf/empty.pb.h"
#include "gtest/gtest.h"
#include "rpc/server_context_access.h"
#include "swirl/call.h"
#include "swirl/channel.h"
#include "swirl/method_id.h"
#include "swirl/service.h"
#include "tools/protoc-gen-swirl/testdata/common.pb.h"
#include "tools/protoc-gen-swirl/testdata/nopkg.swirl.h"
#include "tools/protoc-gen-swirl/testdata/store.pb.h"
#include "tools/protoc-gen-swirl/testdata/store.swirl.h"

namespace {

using ::acme::common::Ack;
using ::acme::common::Note;
using ::acme::store::AdminService;
using ::acme::store::FlushRequest;
using ::acme::store::Item;
using ::acme::store::Item_Key;
using ::acme::store::StoreService;
using ::acme::store::StoreStub;
using ::google::protobuf::Empty;
using ::testing::HasSubstr;

// ---- Helpers ------------------------------------------------------------------------------------

// Collects a handler's response bytes. It never offers inline space (room_ stays 0), so that
// every Reserve and Commit reaches it.
class StringWriter : public swirl::ResponseWriter {
 public:
  const std::string& bytes() const { return buffer_; }
  bool committed() const { return committed_; }
  bool reserved() const { return reserved_; }

 private:
  char* ReserveSlow(size_t size) override {
    reserved_ = true;
    buffer_.resize(size);
    return buffer_.data();
  }
  void CommitSlow(size_t size) override {
    committed_ = true;
    buffer_.resize(size);
  }

  std::string buffer_;
  bool reserved_ = false;
  bool committed_ = false;
};

// A handler's context without a connection (the handlers under test never ask for one).
struct TestContext {
  std::atomic<bool> cancelled{false};
  swirl::ServerContext context = swirl::internal::ServerContextAccess::Make(nullptr, &cancelled);
};

swirl::Service::Method* FindMethod(const swirl::Service& service, const std::string& full_name) {
  for (const auto& method : service.methods()) {
    if (method->full_name == full_name) return method.get();
  }
  return nullptr;
}

// Serializes `request`, invokes method `full_name` of `service` through a fresh invoker.
absl::Status Invoke(swirl::Service& service, const std::string& full_name,
                    const google::protobuf::MessageLite& request, StringWriter* writer) {
  swirl::Service::Method* method = FindMethod(service, full_name);
  if (method == nullptr) return absl::NotFoundError(full_name);
  std::unique_ptr<swirl::Service::Invoker> invoker = method->new_invoker();
  TestContext ctx;
  const std::string bytes = request.SerializeAsString();
  return invoker->Invoke(ctx.context, bytes, *writer);
}

// Records the calls started on it (and never completes them: no test here waits on one).
class RecordingTarget : public swirl::CallTarget {
 public:
  void Start(swirl::ClientCall* call) override { started.push_back(call); }
  std::vector<swirl::ClientCall*> started;
};

struct ExpectedMethod {
  std::string full_name;
  swirl::Execution execution;
  bool one_way;
};

void ExpectMethods(const swirl::Service& service, const std::vector<ExpectedMethod>& expected) {
  ASSERT_EQ(service.methods().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE(expected[i].full_name);
    const swirl::Service::Method& method = *service.methods()[i];
    EXPECT_EQ(method.full_name, expected[i].full_name);
    EXPECT_EQ(method.id, swirl::MethodId(expected[i].full_name.c_str()));
    EXPECT_EQ(method.options.execution, expected[i].execution);
    EXPECT_EQ(method.options.one_way, expected[i].one_way);
    EXPECT_TRUE(static_cast<bool>(method.new_invoker));
  }
}

// ---- Registration -------------------------------------------------------------------------------

TEST(GeneratedServiceTest, StoreRegistersItsMethodsWithOptions) {
  StoreService service;
  EXPECT_EQ(service.full_name(), "acme.store.Store");
  EXPECT_STREQ(StoreService::kServiceName, "acme.store.Store");
  ExpectMethods(service, {
                             {"/acme.store.Store/Get", swirl::Execution::kWorker, false},
                             {"/acme.store.Store/Flush", swirl::Execution::kThreadPool, false},
                             {"/acme.store.Store/Notify", swirl::Execution::kWorker, true},
                         });
}

TEST(GeneratedServiceTest, SecondServiceInTheSameFile) {
  AdminService service;
  EXPECT_EQ(service.full_name(), "acme.store.Admin");
  ExpectMethods(service, {{"/acme.store.Admin/Ping", swirl::Execution::kWorker, false}});
}

TEST(GeneratedServiceTest, FileWithoutPackage) {
  ::BareService service;
  EXPECT_EQ(service.full_name(), "Bare");
  ExpectMethods(service, {{"/Bare/Echo", swirl::Execution::kWorker, false}});
}

TEST(GeneratedServiceTest, IdsDifferAcrossMethods) {
  StoreService service;
  std::vector<uint32_t> ids;
  for (const auto& method : service.methods()) ids.push_back(method->id);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_NE(ids[0], ids[1]);
  EXPECT_NE(ids[1], ids[2]);
  EXPECT_NE(ids[0], ids[2]);
}

// ---- Dispatch -----------------------------------------------------------------------------------

TEST(GeneratedServiceTest, UnoverriddenMethodsAreUnimplemented) {
  StoreService service;
  struct Case {
    std::string full_name;
    std::string message;
    std::unique_ptr<google::protobuf::MessageLite> request;
  };
  std::vector<Case> cases;
  cases.push_back({"/acme.store.Store/Get", "acme.store.Store.Get is not implemented",
                   std::make_unique<Item_Key>()});
  cases.push_back({"/acme.store.Store/Flush", "acme.store.Store.Flush is not implemented",
                   std::make_unique<FlushRequest>()});
  cases.push_back({"/acme.store.Store/Notify", "acme.store.Store.Notify is not implemented",
                   std::make_unique<Note>()});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.full_name);
    StringWriter writer;
    absl::Status status = Invoke(service, c.full_name, *c.request, &writer);
    EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(status.message(), c.message);
    EXPECT_FALSE(writer.reserved());
    EXPECT_FALSE(writer.committed());
  }
}

class TestStore : public StoreService {
 public:
  absl::Status Get(swirl::ServerContext& context, const Item_Key& request,
                   Item* response) override {
    last_context = &context;
    if (request.name() == "missing") return absl::NotFoundError("no such item");
    *response->mutable_key() = request;
    response->set_value("value of " + request.name());
    return absl::OkStatus();
  }
  absl::Status Notify(swirl::ServerContext&, const Note& request, Empty*) override {
    notes.push_back(request.text());
    return absl::OkStatus();
  }
  // Flush is not overridden.

  swirl::ServerContext* last_context = nullptr;
  std::vector<std::string> notes;
};

TEST(GeneratedServiceTest, OverriddenMethodRoundTrips) {
  TestStore service;
  swirl::Service::Method* method = FindMethod(service, "/acme.store.Store/Get");
  ASSERT_NE(method, nullptr);
  std::unique_ptr<swirl::Service::Invoker> invoker = method->new_invoker();
  TestContext ctx;

  // The same invoker twice: each call sees only its own request and response.
  for (const std::string& name : std::vector<std::string>{"apple", "pear"}) {
    SCOPED_TRACE(name);
    Item_Key key;
    key.set_name(name);
    StringWriter writer;
    ASSERT_TRUE(invoker->Invoke(ctx.context, key.SerializeAsString(), writer).ok());
    EXPECT_TRUE(writer.committed());
    Item item;
    ASSERT_TRUE(item.ParseFromString(writer.bytes()));
    EXPECT_EQ(item.key().name(), name);
    EXPECT_EQ(item.value(), "value of " + name);
    EXPECT_EQ(service.last_context, &ctx.context);
  }
}

TEST(GeneratedServiceTest, HandlerErrorIsReturnedWithoutResponse) {
  TestStore service;
  Item_Key key;
  key.set_name("missing");
  StringWriter writer;
  absl::Status status = Invoke(service, "/acme.store.Store/Get", key, &writer);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(status.message(), "no such item");
  EXPECT_FALSE(writer.committed());
}

TEST(GeneratedServiceTest, OneWayHandlerGetsTheRequest) {
  TestStore service;
  Note note;
  note.set_text("hello");
  StringWriter writer;
  ASSERT_TRUE(Invoke(service, "/acme.store.Store/Notify", note, &writer).ok());
  EXPECT_THAT(service.notes, ::testing::ElementsAre("hello"));
  EXPECT_TRUE(writer.bytes().empty());  // Empty serializes to nothing
}

TEST(GeneratedServiceTest, OtherMethodsOfAnOverridingServiceStayUnimplemented) {
  TestStore service;
  StringWriter writer;
  absl::Status status = Invoke(service, "/acme.store.Store/Flush", FlushRequest(), &writer);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(status.message()), HasSubstr("acme.store.Store.Flush"));
}

TEST(GeneratedServiceTest, BlockingMethodWithMessageFromAnotherPackage) {
  class FlushingStore : public StoreService {
   public:
    absl::Status Flush(swirl::ServerContext&, const FlushRequest& request,
                       Ack* response) override {
      response->set_version(request.sync() ? 7 : 3);
      return absl::OkStatus();
    }
  };
  FlushingStore service;
  FlushRequest request;
  request.set_sync(true);
  StringWriter writer;
  ASSERT_TRUE(Invoke(service, "/acme.store.Store/Flush", request, &writer).ok());
  Ack ack;
  ASSERT_TRUE(ack.ParseFromString(writer.bytes()));
  EXPECT_EQ(ack.version(), 7u);
}

TEST(GeneratedServiceTest, BareServiceRoundTrips) {
  class BareEcho : public ::BareService {
   public:
    absl::Status Echo(swirl::ServerContext&, const ::BareMessage& request,
                      ::BareMessage* response) override {
      response->set_n(request.n() + 1);
      return absl::OkStatus();
    }
  };
  BareEcho service;
  ::BareMessage request;
  request.set_n(41);
  StringWriter writer;
  ASSERT_TRUE(Invoke(service, "/Bare/Echo", request, &writer).ok());
  ::BareMessage response;
  ASSERT_TRUE(response.ParseFromString(writer.bytes()));
  EXPECT_EQ(response.n(), 42);
}

// ---- Stub API -----------------------------------------------------------------------------------

// The declared signatures, exactly.
[[maybe_unused]] absl::Status (StoreStub::*const kGet)(const Item_Key&, Item*,
                                                       const swirl::CallOptions&) =
    &StoreStub::Get;
[[maybe_unused]] void (StoreStub::*const kAsyncGetDone)(const Item_Key&, Item*,
                                                        absl::AnyInvocable<void(absl::Status)>,
                                                        const swirl::CallOptions&) =
    &StoreStub::AsyncGet;
[[maybe_unused]] void (StoreStub::*const kAsyncGetCall)(swirl::ClientCall*, const Item_Key&, Item*,
                                                        const swirl::CallOptions&) =
    &StoreStub::AsyncGet;
[[maybe_unused]] void (StoreStub::*const kAsyncFlushCall)(swirl::ClientCall*, const FlushRequest&,
                                                          Ack*, const swirl::CallOptions&) =
    &StoreStub::AsyncFlush;
[[maybe_unused]] absl::Status (StoreStub::*const kNotify)(const Note&, const swirl::CallOptions&) =
    &StoreStub::Notify;
[[maybe_unused]] absl::Status (::BareStub::*const kEcho)(const ::BareMessage&, ::BareMessage*,
                                                         const swirl::CallOptions&) =
    &::BareStub::Echo;

// Call forms with the options defaulted, and temporaries for the copied requests.
template <typename Stub>
concept StoreStubCallable = requires(Stub& stub, const Item_Key& key, Item* item,
                                     swirl::ClientCall* call, const Note& note) {
  { stub.Get(key, item) } -> std::same_as<absl::Status>;
  { stub.AsyncGet(Item_Key(), item, [](absl::Status) {}) } -> std::same_as<void>;
  { stub.AsyncGet(call, key, item) } -> std::same_as<void>;
  { stub.Notify(note) } -> std::same_as<absl::Status>;
  { stub.Notify(Note(), swirl::CallOptions{.timeout = absl::Seconds(1)}) }
      -> std::same_as<absl::Status>;
};
static_assert(StoreStubCallable<StoreStub>);

// One-way methods have only the fire-and-forget call.
template <typename Stub>
concept HasAsyncNotify = requires(Stub& stub, const Note& note, Empty* empty) {
  stub.AsyncNotify(note, empty, [](absl::Status) {});
};
template <typename Stub>
concept HasNotifyAsync = requires(Stub& stub, const Note& note) { stub.NotifyAsync(note); };
template <typename Stub>
concept HasTwoWayNotify = requires(Stub& stub, const Note& note, Empty* empty) {
  stub.Notify(note, empty);
};
static_assert(!HasAsyncNotify<StoreStub>);
static_assert(!HasNotifyAsync<StoreStub>);
static_assert(!HasTwoWayNotify<StoreStub>);

// One asynchronous style (generator.cc): completion callbacks, no futures.
template <typename Stub>
concept HasGetAsync = requires(Stub& stub, const Item_Key& key) { stub.GetAsync(key); };
template <typename Stub>
concept HasFlushAsync = requires(Stub& stub, const FlushRequest& request) {
  stub.FlushAsync(request);
};
static_assert(!HasGetAsync<StoreStub>);
static_assert(!HasFlushAsync<StoreStub>);

// Built over a channel (or any target), by reference or shared, but never implicitly.
static_assert(std::is_constructible_v<StoreStub, swirl::Channel&>);
static_assert(std::is_constructible_v<StoreStub, std::shared_ptr<swirl::Channel>>);
static_assert(std::is_constructible_v<StoreStub, std::shared_ptr<swirl::CallTarget>>);
static_assert(!std::is_convertible_v<swirl::CallTarget&, StoreStub>);
static_assert(!std::is_convertible_v<std::shared_ptr<swirl::CallTarget>, StoreStub>);

// The server-side virtual has the documented signature.
[[maybe_unused]] absl::Status (StoreService::*const kServiceGet)(swirl::ServerContext&,
                                                                 const Item_Key&, Item*) =
    &StoreService::Get;
static_assert(std::is_base_of_v<swirl::Service, StoreService>);
static_assert(std::is_polymorphic_v<StoreService>);

TEST(GeneratedStubTest, NonOwningStubUsesTheTarget) {
  RecordingTarget target;
  StoreStub stub(target);
  EXPECT_EQ(&stub.target(), &target);
}

TEST(GeneratedStubTest, OwningStubKeepsTheTargetAlive) {
  auto target = std::make_shared<RecordingTarget>();
  std::weak_ptr<RecordingTarget> weak = target;
  {
    StoreStub stub{std::shared_ptr<swirl::CallTarget>(target)};
    target.reset();
    ASSERT_FALSE(weak.expired());
    EXPECT_EQ(&stub.target(), weak.lock().get());
    StoreStub copy = stub;
    EXPECT_EQ(&copy.target(), &stub.target());
  }
  EXPECT_TRUE(weak.expired());
}

TEST(GeneratedStubTest, CallerOwnedCallIsStartedOnTheTarget) {
  RecordingTarget target;
  StoreStub stub(target);
  swirl::ClientCall call;
  Item_Key key;
  key.set_name("k");
  Item item;
  stub.AsyncGet(&call, key, &item);
  ASSERT_EQ(target.started.size(), 1u);
  EXPECT_EQ(target.started[0], &call);
  EXPECT_FALSE(call.done());

  // Reusable: the same call object again (this target never completes it, which is fine for a
  // call that was never handed to a worker).
  stub.AsyncGet(&call, key, &item);
  ASSERT_EQ(target.started.size(), 2u);
  EXPECT_EQ(target.started[1], &call);
}

}  // namespace
