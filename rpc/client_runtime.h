// swirl::ClientRuntime: what channels run on, as an object of its own: the device with its
// capability probe, and a worker (the event-loop thread, its completion queue, its receive,
// send and bulk pools). Like eRPC's Nexus it is explicit: channels share a worker only by
// running on one runtime.
//
//   swirl::ClientRuntimeOptions runtime_options;
//   runtime_options.transport.credits = 64;
//   runtime_options.worker_core = 3;
//   auto runtime = swirl::ClientRuntime::Create(runtime_options);
//   swirl::ChannelOptions options;
//   options.runtime = *runtime;  // its transport options and core are the channels'
//   auto a = swirl::Channel::Create("10.0.0.1:7100", options);
//   auto b = swirl::Channel::Create("10.0.0.2:7100", options);  // the same worker thread as a
//
// Contract:
//   * A channel given a runtime runs on its worker with the runtime's transport options and
//     worker core. Leave ChannelOptions::transport and worker_core as they are by default, or
//     set them equal to the runtime's: anything else fails Channel::Create with
//     INVALID_ARGUMENT, so that no setting is silently overridden. Only background-driven
//     channels take a runtime (with Driver::kCaller or dedicated_worker: INVALID_ARGUMENT).
//   * The process default: a background-driven channel given no runtime (and not
//     dedicated_worker) runs on ClientRuntime::Shared(ClientRuntimeOptions{its transport, its
//     worker_core}): one runtime per distinct set of options, every field compared, made by the
//     first channel that asks and destroyed with the last one on it. Two channels whose options
//     differ in any of them never share a worker. A caller-driven or dedicated_worker channel
//     has a runtime of its own, which no other channel shares.
//   * A runtime lives while anyone holds it (each channel on it does); its worker thread stops
//     with it. Thread-safe. Its worker serves at most max_channels connections at once; a
//     channel beyond that fails with RESOURCE_EXHAUSTED.
//   * The capability probe (with its remote-invalidation self-test) runs once per device, port
//     and GID per process, whichever runtime asks.

#ifndef SWIRL_RPC_CLIENT_RUNTIME_H_
#define SWIRL_RPC_CLIENT_RUNTIME_H_

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "swirl/stats.h"
#include "swirl/transport_options.h"

namespace swirl {

namespace internal {
class Worker;
}  // namespace internal
namespace verbs {
struct Capabilities;
}  // namespace verbs

struct ClientRuntimeOptions {
  TransportOptions transport;
  int worker_core = -1;        // pin the worker thread to this CPU (-1: not pinned)
  uint32_t max_channels = 64;  // connections its worker serves at once
  // While spinning, the worker gives its core to other threads between polls after this much
  // idleness (as ServerOptions::idle_yield_after). Unset: 20 us if not pinned, never if pinned.
  std::optional<absl::Duration> idle_yield_after;

  // Every field: runtimes are shared (Shared) only between equal options.
  bool operator==(const ClientRuntimeOptions&) const = default;
};

class ClientRuntime {
 public:
  // A new runtime (device opened, worker thread started), shared by the channels given it.
  static absl::StatusOr<std::shared_ptr<ClientRuntime>> Create(
      const ClientRuntimeOptions& options = {});
  // The process's runtime for `options` (see the contract above): the live one made for equal
  // options, else a new one.
  static absl::StatusOr<std::shared_ptr<ClientRuntime>> Shared(
      const ClientRuntimeOptions& options = {});

  ~ClientRuntime();  // stops the worker thread
  ClientRuntime(const ClientRuntime&) = delete;
  ClientRuntime& operator=(const ClientRuntime&) = delete;

  const ClientRuntimeOptions& options() const { return options_; }
  // What the device can do (probed, self-test included).
  DeviceInfo capabilities() const;
  // What its worker holds right now (QPs, receive buffers, exposed windows, bulk memory).
  RuntimeCounters Counters() const;

  struct State;  // internal (client_runtime.cc)

 private:
  friend class Channel;

  // A runtime for one caller-driven (own_thread false) or dedicated channel, or for many.
  static absl::StatusOr<std::shared_ptr<ClientRuntime>> Make(const ClientRuntimeOptions& options,
                                                             const char* worker_name,
                                                             bool own_thread);
  ClientRuntime(ClientRuntimeOptions options, std::unique_ptr<State> state);
  internal::Worker& worker() const;
  // The probe's full result, for the handshake.
  const verbs::Capabilities& device_capabilities() const;

  const ClientRuntimeOptions options_;
  const std::unique_ptr<State> state_;
};

}  // namespace swirl

#endif  // SWIRL_RPC_CLIENT_RUNTIME_H_
