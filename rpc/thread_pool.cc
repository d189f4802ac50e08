#include "rpc/thread_pool.h"

namespace swirl::internal {


ThreadPool::ThreadPool(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

ThreadPool::~ThreadPool() { Stop(); }

void ThreadPool::Stop() {
  // Tasks not yet started are dropped, not run: their connections are closed by now. Running
  // ones are waited for. The queue is destroyed outside the lock (tasks own buffers and
  // connections).
  std::deque<absl::AnyInvocable<void()>> dropped;
  {
    swirl::MutexLock lock(&mu_);
    stop_ = true;
    dropped.swap(tasks_);
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void ThreadPool::Schedule(absl::AnyInvocable<void()> task) {
  {
    swirl::MutexLock lock(&mu_);
    if (!stop_) {
      tasks_.push_back(std::move(task));
      return;
    }
  }
  // Stopped (a worker still dispatching during shutdown): dropped, outside the lock.
  task = nullptr;
}

void ThreadPool::Run() {
  for (;;) {
    absl::AnyInvocable<void()> task;
    {
      swirl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
            return p->stop_ || !p->tasks_.empty();
          },
          this));
      if (stop_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace swirl::internal
