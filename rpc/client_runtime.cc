#include "swirl/client_runtime.h"

#include <utility>
#include <vector>

#include "base/mutex.h"
#include "rpc/bulk_pool.h"
#include "rpc/establish.h"
#include "rpc/stats_convert.h"
#include "rpc/worker.h"

namespace swirl {

struct ClientRuntime::State {
  internal::OpenedDevice device;
  std::unique_ptr<internal::Worker> worker;
};

absl::StatusOr<std::shared_ptr<ClientRuntime>> ClientRuntime::Make(
    const ClientRuntimeOptions& options, const char* worker_name, bool own_thread) {
  auto state = std::make_unique<State>();
  auto device = internal::OpenTransport(options.transport, internal::Probe::kOncePerProcess);
  if (!device.ok()) return device.status();
  state->device = *device;
  internal::WorkerOptions wo = internal::WorkerOptionsFor(options.transport);
  wo.name = worker_name;
  wo.core = options.worker_core;
  wo.own_thread = own_thread;
  wo.max_connections = options.max_channels;
  wo.idle_yield_after = options.idle_yield_after;
  auto worker = internal::Worker::Create(state->device.context, state->device.pd,
                                         state->device.caps, wo, nullptr);
  if (!worker.ok()) return worker.status();
  state->worker = std::move(*worker);
  state->worker->Start();
  return std::shared_ptr<ClientRuntime>(new ClientRuntime(options, std::move(state)));
}

absl::StatusOr<std::shared_ptr<ClientRuntime>> ClientRuntime::Create(
    const ClientRuntimeOptions& options) {
  return Make(options, "client-worker", /*own_thread=*/true);
}

absl::StatusOr<std::shared_ptr<ClientRuntime>> ClientRuntime::Shared(
    const ClientRuntimeOptions& options) {
  // The process default (see the header): looked up by equality of every option, so that two
  // channels whose options differ in anything the runtime holds never share one. The lock is
  // held while a new runtime is made, so that two first channels of equal options make one.
  static swirl::Mutex mu;
  static auto* runtimes =
      new std::vector<std::pair<ClientRuntimeOptions, std::weak_ptr<ClientRuntime>>>();
  swirl::MutexLock lock(&mu);
  std::erase_if(*runtimes, [](const auto& entry) { return entry.second.expired(); });
  for (const auto& [made_for, runtime] : *runtimes) {
    if (made_for != options) continue;
    if (std::shared_ptr<ClientRuntime> live = runtime.lock()) return live;
  }
  auto made = Create(options);
  if (made.ok()) runtimes->emplace_back(options, *made);
  return made;
}

ClientRuntime::ClientRuntime(ClientRuntimeOptions options, std::unique_ptr<State> state)
    : options_(std::move(options)), state_(std::move(state)) {}

ClientRuntime::~ClientRuntime() { state_->worker->Stop(); }

DeviceInfo ClientRuntime::capabilities() const {
  return internal::DescribeDevice(state_->device.caps);
}
RuntimeCounters ClientRuntime::Counters() const {
  // As Server::Stats() computes its totals (rpc/server.cc), for this one worker.
  const internal::Worker& w = *state_->worker;
  const internal::WorkerStats ws = w.Stats();
  RuntimeCounters out;
  out.queue_pairs_live = ws.connections;
  out.recv_buffers_total = ws.recv_buffers_total;
  out.recv_buffers_free = ws.recv_buffers_total - ws.recv_buffers_posted;
  out.windows_outstanding = w.windows_exposed();
  if (w.bulk_pool() != nullptr) out.bulk_bytes_in_use = w.bulk_pool()->bytes_in_use();
  return out;
}

const verbs::Capabilities& ClientRuntime::device_capabilities() const {
  return state_->device.caps;
}

internal::Worker& ClientRuntime::worker() const { return *state_->worker; }

}  // namespace swirl
