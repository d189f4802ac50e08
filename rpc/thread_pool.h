// Internal: a fixed-size pool of threads for blocking handlers (Execution::kThreadPool).

#ifndef SWIRL_RPC_THREAD_POOL_H_
#define SWIRL_RPC_THREAD_POOL_H_

#include <deque>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "base/mutex.h"

namespace swirl::internal {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();  // Stop()
  // Queues `task`; after Stop() it is dropped instead.
  void Schedule(absl::AnyInvocable<void()> task);
  // Drops the queued tasks and waits for the running ones. Idempotent.
  void Stop();

 private:
  void Run();
  swirl::Mutex mu_;
  std::deque<absl::AnyInvocable<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_THREAD_POOL_H_
