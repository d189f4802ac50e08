// SIGINT and SIGTERM taken synchronously, for servers that shut down gracefully on either.
//
// Construct a StopSignals first thing in main(), before any thread starts: it blocks both
// signals in the calling thread, and every thread started afterwards inherits the mask, so a
// signal sent at any moment (even before the server is up, even between a check and a pause())
// stays pending until Wait() takes it. Handlers that set a flag and pause() lose a signal that
// lands between the two, and a signal before the handler is installed kills the process.

#ifndef SWIRL_BASE_STOP_SIGNALS_H_
#define SWIRL_BASE_STOP_SIGNALS_H_

#include <pthread.h>
#include <signal.h>

namespace swirl {

class StopSignals {
 public:
  StopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // Blocks until SIGINT or SIGTERM arrives (or is already pending); returns which.
  int Wait() {
    int signal = 0;
    while (sigwait(&set_, &signal) != 0) {
    }
    return signal;
  }

 private:
  sigset_t set_;
};

}  // namespace swirl

#endif  // SWIRL_BASE_STOP_SIGNALS_H_
