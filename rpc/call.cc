#include "swirl/call.h"

#include <cstdlib>

#include "base/log.h"
#include "base/notifier.h"
#include "google/protobuf/message_lite.h"
#include "rpc/worker.h"

namespace swirl {

absl::Time CallOptions::EffectiveDeadline() const {
  if (timeout == absl::InfiniteDuration()) return deadline;
  return std::min(deadline, absl::Now() + timeout);
}

ClientCall::~ClientCall() {
  // Destroying a call in flight would let the worker write into freed memory: settle it first.
  const int state = state_.load(std::memory_order_acquire);
  if (state == kQueued || state == kPending) {
    Cancel();
    (void)Wait();
  }
}

void ClientCall::Complete(absl::Status status) {
  status_ = std::move(status);
  if (callback_) return CompleteWithCallback();
  // A blocking call or one that is polled: the waiter takes it from here.
  state_.store(kDone, std::memory_order_release);
  NotifierWord::Notify(completion_);  // the owner may reuse or free this call from here on
}

// Out of line: the callback, moved to the stack, is held in a char buffer, for which
// -fstack-protector would guard every completion (base/copy.h says why that matters).
void ClientCall::CompleteWithCallback() {
  auto callback = std::move(callback_);
  callback_ = nullptr;
  state_.store(kDone, std::memory_order_release);
  // After Notify the owner may reuse or free this call: touch nothing of it afterwards.
  absl::Status copy = callback ? status_ : absl::OkStatus();
  NotifierWord::Notify(completion_);
  if (callback) callback(std::move(copy));
}

bool ClientCall::done() const { return NotifierWord::HasBeenNotified(completion_); }

absl::Status ClientCall::Wait() {
  if (worker_ != nullptr && !NotifierWord::HasBeenNotified(completion_) &&
      worker_->OnLoopThread()) {
    // Waiting here would wait for this very thread to make progress: a hang, silent and
    // permanent, under backpressure or always. A programming error, reported as one.
    SWIRL_LOG(ERROR, "ClientCall::Wait() on the thread running its worker's loop (from a "
                     "handler or callback): it could never complete; use an asynchronous call");
    std::abort();
  }
  if (worker_ != nullptr && worker_->caller_driven()) {
    while (!NotifierWord::HasBeenNotified(completion_)) worker_->TryDrive();
  } else {
    NotifierWord::Wait(completion_);
  }
  return status_;
}

void ClientCall::Cancel() {
  cancel_requested_.store(true, std::memory_order_release);
  const int state = state_.load(std::memory_order_acquire);
  if (worker_ != nullptr && (state == kQueued || state == kPending)) worker_->CancelCall(this);
}

absl::Status CallUnary(CallTarget& target, uint32_t method_id,
                       const google::protobuf::MessageLite& request,
                       google::protobuf::MessageLite* response, const CallOptions& options) {
  ClientCall call;
  call.SetMethod(method_id);
  call.SetRequest(&request);
  call.SetResponse(response);
  call.SetOptions(options);
  target.Start(&call);
  return call.Wait();
}

absl::Status CallOneWay(CallTarget& target, uint32_t method_id,
                        std::unique_ptr<const google::protobuf::MessageLite> request,
                        const CallOptions& options) {
  // Shared by this function and the completion callback; whichever lets go last frees it.
  // (ClientCall::Complete touches nothing of the call once the callback runs.)
  struct State {
    std::unique_ptr<const google::protobuf::MessageLite> request;
    ClientCall call;
  };
  auto state = std::make_shared<State>();
  state->request = std::move(request);
  state->call.SetMethod(method_id);
  state->call.SetRequest(state->request.get());
  state->call.SetOneWay(true);
  state->call.SetOptions(options);
  state->call.SetCallback([state](absl::Status) mutable { state.reset(); });
  target.Start(&state->call);
  return state->call.done() ? state->call.status() : absl::OkStatus();
}

absl::Status CallRaw(CallTarget& target, uint32_t method_id, absl::string_view request,
                     std::string* response, const CallOptions& options) {
  ClientCall call;
  call.SetMethod(method_id);
  call.SetRequestBytes(request);
  call.SetResponseBytes(response);
  call.SetOptions(options);
  target.Start(&call);
  return call.Wait();
}

}  // namespace swirl
