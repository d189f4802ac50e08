// A client worker and a server worker in one process, connected over soft0 and driven by the
// calling thread in turn: nothing runs in the background, so each step does exactly one side's
// work of a call. What bench/rpc_path_bench counts instructions in and rpc/steady_state_test
// counts allocations in.
//
// Not thread-safe: one thread creates the pair and drives both workers.

#ifndef SWIRL_RPC_TESTING_WORKER_PAIR_H_
#define SWIRL_RPC_TESTING_WORKER_PAIR_H_

#include <memory>

#include "absl/status/statusor.h"
#include "rpc/worker.h"
#include "swirl/call.h"
#include "swirl/service.h"

namespace swirl::testing {

class WorkerPair {
 public:
  // Opens soft0, makes both workers (caller-driven, no keepalive), registers `services` on the
  // server side and links one connection. The services must outlive the pair.
  static absl::StatusOr<std::unique_ptr<WorkerPair>> Create(
      std::initializer_list<Service*> services);

  // The client's half of starting `call` (posted before this returns).
  void Start(ClientCall& call) { client_.worker->StartCall(client_.connection->id(), &call); }
  // One turn of a worker's loop: true if it did work.
  bool ServerTurn() { return server_.worker->TryDrive(); }
  bool ClientTurn() { return client_.worker->TryDrive(); }
  // Starts `call` and drives both sides until it completes (bounded by `timeout`).
  absl::Status RoundTrip(ClientCall& call, absl::Duration timeout = absl::Seconds(60));

  internal::Worker& client_worker() { return *client_.worker; }
  internal::Worker& server_worker() { return *server_.worker; }

 private:
  struct Side {
    std::unique_ptr<internal::Worker> worker;
    std::shared_ptr<internal::Connection> connection;
    internal::MethodTable methods;
  };
  WorkerPair() = default;
  absl::Status Connect(const verbs::Capabilities& caps);

  std::shared_ptr<verbs::Context> context_;
  std::shared_ptr<verbs::ProtectionDomain> pd_;
  Side client_, server_;
};

}  // namespace swirl::testing

#endif  // SWIRL_RPC_TESTING_WORKER_PAIR_H_
